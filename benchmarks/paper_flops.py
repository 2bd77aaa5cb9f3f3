"""FLOPs of one paper-shaped CIFAR-10 round, counted on the CPU with matrix-product convolutions.

XLA's cost analysis on a GPU leaves out the convolutions and matrix products it
hands to cuDNN / cuBLAS (custom calls), so the FLOP/s ``gpu_round.py`` prints
there are far too low. This script counts the same rounds on the CPU, where
the ConvNet's ``hybrid`` implementation makes every convolution an XLA dot,
and combines the per-step counts with the loop counts of a full round (every
trajectory runs ``max_outer`` iterations, as in the H100 runs: 200 real
batches per client; server 100 steps for ``cifar_dp``, 4 for ``cifar_nondp``).
The count is useful work: a real gradient counts the microbatches of the CPU
plan that hold the ``B = 256`` real examples, and an evaluation counts the real
records. Accelerators run one pass over all ``capacity`` slots of the Poisson
buffer (356), so they execute more on that step.
Only compiles, runs nothing; ~1 minute. From the repository root::

  PYTHONPATH=. python benchmarks/paper_flops.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import bench  # noqa: E402
from fedlap_jax.methods.fedlap import config as config_lib  # noqa: E402

# name -> (config, server steps of the measured round)
ROUNDS = {
  "cifar_dp": (config_lib.paper_dp_config, 100),
  "cifar_nondp": (bench.paper_nondp_bounded, 4),
}


def round_flops(name: str) -> tuple[float, dict[str, float]]:
  """``(FLOPs of one round, per-step FLOPs)`` for a paper config with all loops run."""
  make, server_steps = ROUNDS[name]
  cfg = make()
  cc = cfg.client
  problem = bench.PROBLEMS["cifar"]
  clients = bench.random_clients(dataclasses.replace(problem, records=512))
  _, apply_fn, params = bench.make_model(problem, "hybrid", width=128)
  units = bench.unit_flops(apply_fn, params, clients, cfg, problem)
  k = problem.num_clients
  metrics = types.SimpleNamespace(
    client=types.SimpleNamespace(
      real_accesses=np.full(k, cc.real_accesses_per_round),
      outer_iterations=np.full((k, cc.iterations), cc.max_outer),
    ),
    server=types.SimpleNamespace(steps=np.array(server_steps)),
  )
  return bench.round_flops(metrics, units, cfg, problem), units


def main() -> int:
  for name in ROUNDS:
    total, units = round_flops(name)
    steps = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in units.items())
    print(f"{name}: {total / 1e12:.1f} TFLOP per round (GFLOP per step: {steps})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
