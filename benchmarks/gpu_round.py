"""One prepared script for a single accelerator: paper-shaped CIFAR-10 rounds on random data.

Runs, in this order and within ``--budget-s`` (default 420 s, so the whole
script stays under 8 minutes including start-up; a part is not started if the
previous one's duration would take it past the budget):

1. a paper ``cifar_dp`` round: 5 clients x 10,000 images 32x32x3, ConvNet-128,
   R_i 4, max_outer 5, batch_loop 10, R_b 5, R_l 2, ipc 10, B 256, sigma 1,
   C 1, r 1.5 constant, server up to 100 epochs (T = 200 real batches per
   client);
2. a paper ``cifar_nondp`` round: R_i 1, max_outer 5, batch_loop 40, R_b 5,
   R_l 0, ipc 50, radius calibration 100 epochs with the real loss on 2,048
   records per client, server up to 100 epochs, r 10;
3. the DP gradient (256 examples) by every per-example method and ConvNet
   implementation, to pick the defaults for this backend.

Rounds run in the ``--variants`` given (default ``new,old``): ``new`` is the
side-by-side path (``client_backend="vmap"``: the five clients' steps batched,
one DSA family per step shared by the clients, masked loop termination;
``ClientConfig.dsa_family_draw="shared"``), ``old`` the program measured
before it (``"map"``, one client after another, each client its own DSA
family: ``"per_client"``); any ``BACKEND`` or ``BACKEND:DRAW`` also works
(e.g. ``map:shared``). For each it prints compile time, seconds
per round (median of ``--repeats`` runs after compiling) and achieved FLOP/s (XLA's FLOPs of each
repeated step times the loop counts the round reports), as a Markdown table,
then each round against the goals (``cifar_dp`` <= 3 s,
``cifar_nondp`` <= 8 s, compile <= 30 s; :data:`GOALS`) and new against old,
and writes JSON to ``$OUT/gpu_round.json`` (or ``--json``). On a GPU, XLA's
counts leave out what it hands to cuDNN (the convolutions of ``impl="flax"``),
so those FLOP/s are far too low there; docs/benchmarks.md gives the same
rounds' FLOPs counted on the CPU.

Needs only JAX (with CUDA), flax, optax, chex and numpy: no network, no
tensorflow(-datasets), no dp_accounting; jax_privacy is optional. From the
repository root::

  PYTHONPATH=. python benchmarks/gpu_round.py            # on the GPU machine
  PYTHONPATH=. python benchmarks/gpu_round.py --small    # smoke test on a CPU (< 2 min)
  PYTHONPATH=. python benchmarks/gpu_round.py --from-json gpu_round.json   # its goal lines
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bench  # noqa: E402
from fedlap_jax import dispatch
from fedlap_jax.methods.fedlap import config as config_lib  # noqa: E402


# Goals on one H100: seconds per round and compile seconds.
GOALS = {"cifar_dp": 3.0, "cifar_nondp": 8.0}
COMPILE_GOAL_S = 30.0
VARIANTS = {"new": ("vmap", "shared"), "old": ("map", "per_client")}


def parse_variant(item: str) -> tuple[str, str | None]:
  """``new`` / ``old`` / ``BACKEND`` / ``BACKEND:DRAW`` -> ``(backend, draw or None)``."""
  if item in VARIANTS:
    return VARIANTS[item]
  backend, _, draw = item.partition(":")
  if backend not in dispatch.CLIENT_BACKENDS or (draw and draw not in config_lib.DSA_FAMILY_DRAWS):
    raise SystemExit(
      f"--variants item {item!r} is invalid; allowed: new, old, BACKEND or "
      f"BACKEND:DRAW with BACKEND in {dispatch.CLIENT_BACKENDS} and DRAW in "
      f"{config_lib.DSA_FAMILY_DRAWS}"
    )
  return backend, draw or None


def with_draw(cfg, draw: str | None):
  """``cfg`` with ``client.dsa_family_draw = draw`` (unchanged for None)."""
  if draw is None:
    return cfg
  return dataclasses.replace(cfg, client=dataclasses.replace(cfg.client, dsa_family_draw=draw))


def goal_lines(rows: list[dict]) -> list[str]:
  """Each round against :data:`GOALS` / :data:`COMPILE_GOAL_S`, and new against old."""
  lines = []
  by = {}
  for r in rows:
    name, variant = r.get("config"), r.get("variant")
    if name not in GOALS:
      continue
    by[(name, variant)] = r
    goal = GOALS[name]
    round_ok = "met" if r["median_s"] <= goal else "NOT met"
    compile_ok = "met" if r["compile_s"] <= COMPILE_GOAL_S else "NOT met"
    lines.append(
      f"{name} [{variant}]: {r['median_s']:.2f} s/round (goal <= {goal:g} s: {round_ok}), "
      f"compile {r['compile_s']:.1f} s (goal <= {COMPILE_GOAL_S:g} s: {compile_ok})"
    )
  for name in GOALS:
    new, old = by.get((name, "new")), by.get((name, "old"))
    if new and old:
      lines.append(
        f"{name}: new / old = {new['median_s']:.2f} / {old['median_s']:.2f} s = "
        f"{new['median_s'] / old['median_s']:.2f} (compile {new['compile_s']:.1f} "
        f"vs {old['compile_s']:.1f} s)"
      )
  return lines


def configs(small: bool) -> dict:
  """``name -> (FedLAPConfig, Problem, width)``; ``small`` shrinks everything for a CPU."""
  dp = config_lib.paper_dp_config()
  nondp = bench.paper_nondp_bounded()
  problem = bench.PROBLEMS["cifar"]
  width = 128
  if small:
    problem = dataclasses.replace(problem, records=400)
    width = 16
    dp = dataclasses.replace(
      dp,
      client=dataclasses.replace(
        dp.client, iterations=1, max_outer=2, batch_loop=2, boost_loop=2, inner_loop=1
      ),
      server=dataclasses.replace(dp.server, max_epochs=3),
    )
    nondp = dataclasses.replace(
      nondp,
      client=dataclasses.replace(
        nondp.client,
        ipc=10,
        max_outer=2,
        batch_loop=2,
        boost_loop=2,
        calibration_epochs=2,
        calibration_eval_size=256,
      ),
      server=dataclasses.replace(nondp.server, max_epochs=3),
    )
  return {"cifar_dp": (dp, problem, width), "cifar_nondp": (nondp, problem, width)}


def device_peak_bytes() -> int | None:
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # some backends have no memory statistics
    return None
  return stats.get("peak_bytes_in_use")


def round_row(name, cfg, problem, width, repeats, impl, variant):
  backend, draw = parse_variant(variant)
  cfg = with_draw(cfg, draw)
  clients = bench.random_clients(problem)
  _, apply_fn, params = bench.make_model(problem, impl, width=width)
  fn, args = bench.op_round(apply_fn, params, clients, cfg, problem, client_backend=backend)
  res = bench.measure(f"{name} [{variant}, impl={impl}]", fn, args, repeats=repeats, warmup=False)
  metrics = res["output"][1]
  units = bench.unit_flops(apply_fn, params, clients, cfg, problem)
  res["flops_executed"] = bench.round_flops(metrics, units, cfg, problem)
  note = (
    f"client_backend={backend!r}, dsa_family_draw={cfg.client.dsa_family_draw!r}: "
    f"{problem.num_clients} clients x {problem.records}, "
    f"width {width}, "
    f"{int(np.sum(metrics.client.real_accesses))} real batches, "
    f"server {int(metrics.server.epochs)} epochs"
  )
  out = bench.row(res, None, note)
  out.update(config=name, variant=variant, impl=impl)
  return out


def per_example_rows(problem, width, repeats, impls, deadline):
  cfg = config_lib.paper_dp_config()
  clients = bench.random_clients(dataclasses.replace(problem, num_clients=1))
  methods = ["layerwise", "vmap"]
  try:
    import jax_privacy  # noqa: F401

    methods.append("jax_privacy")
  except ImportError:
    pass
  rows = []
  for impl in impls:
    _, apply_fn, params = bench.make_model(problem, impl, width=width)
    for method in [None] + methods:
      if time.monotonic() > deadline:
        bench._log("budget reached: remaining per-example measurements skipped")
        return rows
      fn, args = bench.op_gradient(
        apply_fn, params, clients, cfg, dp=method is not None, slots=256, method=method or "auto"
      )
      label = f"DP gradient [{method}]" if method else "non-DP gradient"
      res = bench.measure(f"{label}, impl={impl}", fn, args, repeats=repeats)
      # XLA counts a chunk loop once: FLOPs of the slots actually processed.
      res["flops_executed"] = bench.gradient_flops(
        apply_fn, params, clients, cfg, 256, dp=method is not None, method=method or "auto"
      )
      rows.append(bench.row(res, None, "256 examples"))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke test")
  parser.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --small)")
  parser.add_argument(
    "--budget-s", type=float, default=420.0, help="skip what would start after this many seconds"
  )
  parser.add_argument("--impl", default="auto", help="ConvNet.impl of the rounds")
  parser.add_argument("--only", default="cifar_dp,cifar_nondp,per_example")
  parser.add_argument(
    "--variants",
    default="new,old",
    help="round variants, measured in this order (every config with the "
    "first, then the next): new (vmap, shared DSA family), old (map, "
    "per-client family), BACKEND or BACKEND:DRAW",
  )
  parser.add_argument(
    "--client-backends",
    default=None,
    help="earlier spelling: backends only (each with the config's draw); overrides --variants",
  )
  parser.add_argument("--json", default=None)
  parser.add_argument(
    "--from-json",
    default=None,
    metavar="PATH",
    help="measure nothing: print the goal lines of an earlier run's JSON",
  )
  args = parser.parse_args(argv)
  if args.from_json:
    with open(args.from_json) as f:
      for line in goal_lines(json.load(f)["rows"]):
        print(line)
    return 0
  if args.repeats is None:
    args.repeats = 1 if args.small else 2
  start = time.monotonic()
  deadline = start + args.budget_s
  env = bench.environment()
  bench._log(f"environment: {env}")
  rows = []
  parts = args.only.split(",")
  last = 0.0  # duration of the last round part: do not start one that would overrun
  variants = (args.client_backends or args.variants).split(",")
  for variant in variants:
    parse_variant(variant)  # refuse a bad item before anything runs
  for variant in variants:
    for name, (cfg, problem, width) in configs(args.small).items():
      if name not in parts:
        continue
      if time.monotonic() + last > deadline:
        bench._log(f"budget: {name} [{variant}] skipped (would end after --budget-s)")
        continue
      bench._log(f"{name} [{variant}] ...")
      t0 = time.monotonic()
      rows.append(round_row(name, cfg, problem, width, args.repeats, args.impl, variant))
      last = time.monotonic() - t0
      bench._log(
        f"{name} [{variant}]: {rows[-1]['median_s']:.2f} s/round, "
        f"compile {rows[-1]['compile_s']:.1f} s, part took {last:.0f} s"
      )
  if "per_example" in parts:
    problem, width = configs(args.small)["cifar_dp"][1:]
    impls = ["flax", "hybrid"] if jax.default_backend() != "cpu" else ["hybrid"]
    rows += per_example_rows(problem, width, args.repeats, impls, deadline)
  env["device_peak_bytes"] = device_peak_bytes()
  env["total_s"] = time.monotonic() - start
  title = f"gpu_round.py{' --small' if args.small else ''} on {env['device_kind']}"
  print(bench.markdown(rows, title))
  if args.small:
    print("(--small: shrunk rounds on this machine; the goals are for the full rounds on an H100)")
  for line in goal_lines(rows):
    print(line)
  print(
    f"\ntotal {env['total_s']:.0f} s, jax {env['jax']} on {env['backend']} "
    f"({env['devices']}), device peak {env['device_peak_bytes']}"
  )
  path = args.json or os.path.join(os.environ.get("OUT", "."), "gpu_round.json")
  with open(path, "w") as f:
    json.dump({"environment": env, "title": title, "rows": rows}, f, indent=1, default=str)
  bench._log(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
