"""Benchmarks of fedlap_jax (timings, FLOPs, memory); see BENCHMARKS.md."""
