r"""Does the Flower app need its own client worker? One deployment round three ways, alternated.

  python -m benchmarks.flower_decision --out runs/flower_decision [--repeats 2] [--small]

For each config (:data:`CONFIGS`; ``--small``: :data:`SMALL`, a CI-sized check) it runs the
arms ``experiments`` (``experiments.run`` in this process), ``stock`` (a SuperLink and one
Flower ``flower-supernode`` per client: a new ClientApp process per message) and ``warm``
(one :mod:`fedlap_flower.node` per client: its long-lived ClientApp process), in the order
a b c a b c ... (``--repeats`` times), so a shared machine's load falls on them alike. All
runs share one JAX persistent compilation cache (``OUT/jax_cache``), which round 1 of the
first runs fills: a run's seconds are the median of its rounds after the first (for
``experiments`` its ``round_seconds``; for a deployment the ServerApp's wall clock from the
end of one round to the end of the next). It prints each run's seconds, then per config the
median per arm, and the ratios stock / warm and each deployment / experiments.

The decision's rule: if stock is within :data:`STOCK_GOAL` x the warm worker on the round of
at least 60 s in process, the worker is not worth its Flower internals.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from benchmarks import flower_runs

ARMS = ("experiments", "stock", "warm")
STOCK_GOAL = 1.5
TINY = (
  "client.batch_loop=1 client.boost_loop=1 client.max_outer=1 client.calibration_epochs=2 "
  "client.dsa_strategy='' server.dsa_strategy='' server.max_epochs=2 eval_chunk_size=128"
)
# label: (config, overrides). "long": the quickstart's FedLAP-DP with a wider model and more
# client steps, a round of at least 60 s in process on the 2-core VM.
CONFIGS = {
  "quickstart": ("quickstart:dp", "rounds=2"),
  "long": ("quickstart:dp", "rounds=2 model.width=64 client.max_outer=40 client.boost_loop=40"),
}
SMALL = {"tiny": ("quickstart:dp", f"rounds=2 {TINY}")}


def caps(cfg) -> dict:
  """The node config that lets a client compute what ``cfg`` asks beyond the default caps."""
  from fedlap_flower import settings  # pylint: disable=g-import-not-at-top

  out = {}
  for key, (field, default) in settings.COMPUTE_CAPS.items():
    section, name = field.split(".")
    value = cfg[section].get(name) if section in cfg else None
    if isinstance(value, int) and value > default:
      out[key] = value
  return out


def run_arm(arm: str, config: str, overrides: str, workdir: Path, jax_cache: Path) -> list[float]:
  """One run of ``arm``; its seconds per round after the first."""
  if arm == "experiments":
    records = flower_runs.run_experiments(config, overrides, workdir)["records"]
  else:
    from fedlap_flower import settings  # pylint: disable=g-import-not-at-top

    cfg, _ = settings.load_config(config, overrides)
    records = flower_runs.run_flower(
      config,
      overrides,
      workdir,
      engine="deployment",
      num_clients=int(cfg.data.num_clients),
      dp=bool(cfg.dp.enabled),
      max_epsilon=1e6,
      jax_cache=jax_cache,
      timeout=1800.0,
      stock=arm == "stock",
      node_extra=caps(cfg),
    )["records"]
  return flower_runs.round_seconds("experiments" if arm == "experiments" else "deployment", records)


def summary(results: dict) -> str:
  lines = [
    "| config | arm | per run (s) | median (s) | / experiments | / warm |",
    "|---|---|---|---:|---:|---:|",
  ]
  for label, by_arm in results.items():
    med = {a: statistics.median(r) for a, r in by_arm.items() if r}
    for arm, runs in by_arm.items():
      if not runs:
        continue
      ratio = {b: f"{med[arm] / med[b]:.2f}" if b in med else "-" for b in ("experiments", "warm")}
      lines.append(
        f"| {label} | {arm} | {', '.join(f'{v:.2f}' for v in runs)} | {med[arm]:.2f} | "
        f"{ratio['experiments']} | {ratio['warm']} |"
      )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=Path("runs/flower_decision"))
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--small", action="store_true", help="one tiny config, CI-sized")
  p.add_argument("--configs", nargs="+", default=None, help="labels of CONFIGS (default all)")
  args = p.parse_args(argv)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every Federation stops
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)
  jax_cache = out / "jax_cache"
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache)
  configs = SMALL if args.small else {k: CONFIGS[k] for k in (args.configs or CONFIGS)}
  print(f"machine: {flower_runs.machine()}", flush=True)
  results: dict = {label: {arm: [] for arm in ARMS} for label in configs}
  for label, (config, overrides) in configs.items():
    print(f"== {label}: --config={config} overrides: {overrides}", flush=True)
    for rep in range(args.repeats):
      for arm in ARMS:
        wd = out / label / f"{arm}-{rep}"
        shutil.rmtree(wd, ignore_errors=True)
        load = os.getloadavg()[0]
        t0 = time.time()
        secs = run_arm(arm, config, overrides, wd, jax_cache)
        run_s = statistics.median(secs)
        results[label][arm].append(run_s)
        print(
          f"   {label} {arm} run {rep}: rounds 2.. {[round(s, 2) for s in secs]} s -> "
          f"{run_s:.2f} s (wall {time.time() - t0:.0f} s, load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f})",
          flush=True,
        )
        (out / "results.json").write_text(json.dumps(results, indent=1))
    if len(configs) > 1:
      print(summary({label: results[label]}), flush=True)
  print(summary(results))
  long_ = results.get("long", {})
  if long_.get("stock") and long_.get("warm"):
    ratio = statistics.median(long_["stock"]) / statistics.median(long_["warm"])
    print(
      f"stock / warm on the long round: {ratio:.2f} "
      f"({'within' if ratio <= STOCK_GOAL else 'over'} {STOCK_GOAL}x)"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
