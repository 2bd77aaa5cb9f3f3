"""Benchmarks of fedlap_jax (timings, FLOPs, memory); see docs/benchmarks.md."""
