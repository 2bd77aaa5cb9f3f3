"""FedLAP rounds of an experiment config on its real data, per client backend (CPU or GPU).

Compares the clients one after another (``map``) with the side-by-side path
(``vmap``: every step batched over the clients, one DSA family per step shared
by them, masked loop termination) and, for reference, ``map`` with the old
per-client family draw. Each variant: the first round's seconds (compile
included), then ``--rounds`` more rounds of the same compiled program (the state carried, as in a run), wall and
process CPU seconds per round (median), and the 1-minute load average before
and after (this 2-core machine is shared; CPU seconds are the steadier figure
under load)::

  python -m benchmarks.client_backends --config=quickstart:dp_loops
  python -m benchmarks.client_backends --config=quickstart:nondp --variants map,vmap
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

VARIANTS = {
  "map": ("map", "shared"),
  "vmap": ("vmap", "shared"),
  "map:per_client": ("map", "per_client"),
}


def measure(config: str, variant: str, rounds: int) -> dict:
  from fedlap_runs import build, configs

  backend, draw = VARIANTS[variant]
  cfg = configs.load(config)
  cfg.seed = 0  # a measurement, not a private run: the seed the recorded figures used
  cfg.client_backend = backend
  cfg.client.dsa_family_draw = draw
  setup = build.build_run(cfg)
  state, clients = setup.state, setup.clients
  load_before = os.getloadavg()[0]
  round_fn = setup.algorithm.round
  t0 = time.perf_counter()
  state, _ = jax.block_until_ready(round_fn(state, clients))  # compiles, then round 1
  compile_s = time.perf_counter() - t0
  walls, cpus = [], []
  for _ in range(rounds):
    t, c = time.perf_counter(), time.process_time()
    state, _ = jax.block_until_ready(round_fn(state, clients))
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
  return {
    "config": config,
    "variant": variant,
    "first_round_s": round(compile_s, 1),
    "wall_s": round(statistics.median(walls), 3),
    "cpu_s": round(statistics.median(cpus), 3),
    "rounds": rounds,
    "walls": [round(w, 2) for w in walls],
    "load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="quickstart:dp_loops")
  parser.add_argument("--variants", default="map,vmap")
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  rows = []
  for variant in args.variants.split(","):
    if variant not in VARIANTS:
      raise SystemExit(f"--variants item {variant!r} is invalid; allowed: {sorted(VARIANTS)}")
    rows.append(measure(args.config, variant, args.rounds))
    print(json.dumps(rows[-1]), flush=True)
  print(
    "| config | variant | round 1 with compile (s) | wall s / round | CPU s / round | "
    "load before, after |"
  )
  print("|---|---|---:|---:|---:|---|")
  for r in rows:
    print(
      f"| {r['config']} | {r['variant']} | {r['first_round_s']} | {r['wall_s']} | {r['cpu_s']} "
      f"| {r['load'][0]}, {r['load'][1]} |"
    )


if __name__ == "__main__":
  main()
