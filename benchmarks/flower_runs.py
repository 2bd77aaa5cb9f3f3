r"""FedLAP(-DP) under experiments.run, Flower's simulation engine and its deployment engine.

  python -m benchmarks.flower_runs --out runs/flower_report \
      [--configs quickstart:dp_loops quickstart:nondp] [--overrides "rounds=3"] \
      [--engines experiments simulation deployment deployment-server-keys] \
      [--seeds 0 1 2] [--max-epsilon 50]

For every config and seed it runs each engine and writes ``OUT/<label>/s<seed>/<engine>/``
(``metrics.jsonl`` of experiments.run or of the Flower ServerApp, the Flower
processes' logs, the clients' state directories), then ``OUT/report.md`` and
``OUT/report.json``: accuracy per round, epsilon per client, wall time, bytes
uploaded per round against the model size, where engines share their
randomness whether their numbers are identical, and the seconds each round
after the first costs per engine with its ratio to experiments.run's (the
machine, its core count and the load average before and after each engine).

* ``experiments``: ``experiments.train.train_and_evaluate`` (one process).
* ``simulation``: ``flwr run`` on ``flower-superlink --simulation`` with
  ``num-supernodes = data.num_clients`` virtual clients (Ray).
* ``deployment``: ``flower-superlink`` and one client node per client
  (:mod:`fedlap_flower.node`: ``flower-supernode --isolation process`` with
  ``--node-config "partition-id=k num-partitions=K state-dir=... max-epsilon=..."``
  and its long-lived ClientApp process), then ``flwr run``.
* ``deployment-server-keys`` (DP configs only): the deployment with the
  test-only ``unsafe-dp-keys-from-server`` (and the clients' consent): DP noise
  from the server's keys, so the numbers must equal experiments.run's.

Without DP every Flower engine gets the server's round keys and must equal
experiments.run bit for bit. Under DP (client-secret keys) they cannot; compare
several ``--seeds``: the report gives mean and standard deviation per engine.
Wall times include process start-up and compilation (round 1; compiled
programs are cached on disk in ``OUT/jax_cache``). A round's seconds: for
experiments.run its ``round_seconds``; for a Flower engine the ServerApp's
wall clock from the end of the previous round to the end of this one
(``timing.jsonl``'s ``wall_seconds``), so the time between rounds counts too.

The speed check of a deployment round against an in-process one:

  python -m benchmarks.flower_runs --out runs/flower_speed --configs quickstart:dp \
      --overrides "rounds=6" --engines experiments deployment
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

ENGINES = ("experiments", "simulation", "deployment", "deployment-server-keys")
# A deployment round after the first (5 client nodes on one machine) against the same round
# under experiments.run: the most it may cost, as a ratio of medians.
DEPLOYMENT_GOAL = 1.5


def _federation():
  """The tests' harness of local Flower processes (``tests/flower_federation.py``; it is not
  part of the package)."""
  tests = str(Path(__file__).resolve().parents[1] / "tests")
  if tests not in sys.path:
    sys.path.insert(0, tests)
  import flower_federation  # pylint: disable=g-import-not-at-top

  return flower_federation


def _read_jsonl(path: Path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def run_experiments(config: str, overrides: str, workdir: Path) -> dict:
  from experiments import train  # pylint: disable=g-import-not-at-top
  from fedlap_flower import settings  # pylint: disable=g-import-not-at-top

  cfg, label = settings.load_config(config, overrides)
  cfg.unlock()
  cfg.plots = False
  cfg.progress_bar = False
  t0 = time.time()
  result = train.train_and_evaluate(cfg, workdir, config_name=label)
  info = json.loads((workdir / "run_info.json").read_text())
  records = [
    {
      "round": r["round"],
      "test_accuracy": r["test_accuracy"],
      "test_loss": r["test_loss"],
      "epsilon": r.get("epsilon"),
      "round_seconds": t["round_seconds"],  # timing.jsonl's record of the round
      # experiments.run counts the synthetic images only (float32).
      "upload_bytes": info["upload_floats_per_client"] * 4 * len(info["client_sizes"]),
    }
    for r, t in zip(result["records"], result["timing"])
  ]
  return {
    "records": records,
    "wall_seconds": time.time() - t0,
    "model_bytes": info["num_params"] * 4,
    "client_sizes": info["client_sizes"],
  }


def run_flower(
  config: str,
  overrides: str,
  workdir: Path,
  *,
  engine: str,
  num_clients: int,
  dp: bool,
  max_epsilon: float,
  jax_cache: Path,
  timeout: float,
  stock: bool = False,
  node_extra: dict | None = None,
) -> dict:
  """``stock``: Flower's own ``flower-supernode`` (a ClientApp process per message) in place
  of :mod:`fedlap_flower.node`; ``node_extra``: more node config (e.g. compute caps)."""
  from fedlap_flower import settings  # pylint: disable=g-import-not-at-top

  Federation = _federation().Federation

  server_keys = engine == "deployment-server-keys"
  env = {"JAX_COMPILATION_CACHE_DIR": str(jax_cache)}
  if server_keys:
    env[settings.UNSAFE_ENV] = "1"
  if engine == "simulation":  # virtual clients have no node config: their own state root
    env[settings.STATE_ROOT_ENV] = str(workdir / "clients")
  run_dir = workdir / "server"
  run_config = {
    "config": config,
    "overrides": overrides,
    "run-dir": str(run_dir),
    "round-timeout": timeout,
    "unsafe-dp-keys-from-server": server_keys,
  }
  t0 = time.time()
  with Federation(workdir / "processes", simulation=engine == "simulation", env=env) as fed:
    if engine != "simulation":
      for k in range(num_clients):
        node = {
          "partition-id": k,
          "num-partitions": num_clients,
          "state-dir": str(workdir / "clients" / f"client-{k}"),
        }
        if dp:  # a client with its own max-epsilon refuses non-DP runs
          node["max-epsilon"] = max_epsilon
        node.update(node_extra or {})
        fed.start_supernode(k, node, stock=stock)
    else:
      run_config["max-epsilon"] = max_epsilon
    t_submit = time.time()
    run_id = fed.run(run_config, num_supernodes=num_clients)
    status = fed.wait(run_id, timeout=timeout * 20)
    (workdir / "serverapp.log").write_text(fed.logs(run_id))
  if status != "finished:completed":
    raise RuntimeError(f"{engine} run of {config} ended {status}; see {workdir}")
  # The ServerApp keeps each round's seconds in timing.jsonl, beside metrics.jsonl.
  timing = {t["round"]: t for t in _read_jsonl(run_dir / "timing.jsonl")}
  records = [
    {**r, "wall_seconds": timing[r["round"]]["wall_seconds"]}
    for r in _read_jsonl(run_dir / "metrics.jsonl")
  ]
  return {
    "records": records,
    "wall_seconds": time.time() - t0,
    "run_seconds": records[-1]["wall_seconds"],
    "setup_seconds": t_submit - t0,
    "model_bytes": records[-1]["model_bytes"],
  }


def machine() -> str:
  """The CPU model, its logical core count and the OS, for the report."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"{model}, {os.cpu_count()} logical cores, {platform.platform()}"


def round_seconds(engine: str, records: list[dict]) -> list[float]:
  """Seconds of each round after the first (see the module docstring)."""
  if engine == "experiments":
    return [r["round_seconds"] for r in records[1:]]
  wall = [r["wall_seconds"] for r in records]
  return [b - a for a, b in zip(wall, wall[1:])]


def _fmt(v, digits=4):
  return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def report(results: dict, out: Path) -> str:
  lines = [
    "# FedLAP(-DP): experiments.run vs Flower simulation vs Flower deployment",
    "",
    f"Machine: {machine()}.",
    "",
  ]
  for label, by_seed in results.items():
    lines += [f"## {label}", ""]
    for seed, by_engine in by_seed.items():
      engines = list(by_engine)
      rounds = len(next(iter(by_engine.values()))["records"])
      lines += [
        f"### seed {seed}: test accuracy per round",
        "",
        "| round | " + " | ".join(engines) + " |",
        "|---:|" + "---:|" * len(engines),
      ]
      for i in range(rounds):
        lines.append(
          f"| {i + 1} | "
          + " | ".join(_fmt(by_engine[e]["records"][i]["test_accuracy"]) for e in engines)
          + " |"
        )
      ref = by_engine.get("experiments")
      lines += [
        "",
        "| engine | wall s | load avg (before, after) | final acc | final epsilon | "
        "epsilon per client | upload B/round | model B | upload / model | "
        "identical to experiments.run |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---|",
      ]
      for e in engines:
        r = by_engine[e]
        last = r["records"][-1]
        same = "-"
        if ref is not None and e != "experiments":
          same = all(
            a["test_accuracy"] == b["test_accuracy"]
            and a["test_loss"] == b["test_loss"]
            and a.get("epsilon") == b.get("epsilon")
            for a, b in zip(r["records"], ref["records"])
          )
        per_client = last.get("epsilon_per_client")
        lines.append(
          f"| {e} | {r['wall_seconds']:.0f} | {_fmt(r.get('load_average'))} | "
          f"{last['test_accuracy']:.4f} | "
          f"{_fmt(last.get('epsilon'), 3)} | "
          f"{', '.join(f'{k}: {v:.3f}' for k, v in per_client.items()) if per_client else '-'}"
          f" | {last['upload_bytes']} | {r['model_bytes']} | "
          f"{last['upload_bytes'] / r['model_bytes']:.3f} | {same} |"
        )
      lines.append("")
      ref_s = round_seconds("experiments", ref["records"]) if ref is not None else []
      goal_line = None
      lines += [
        f"### seed {seed}: seconds per round after the first",
        "",
        "| engine | rounds 2.. (s) | median s | median / experiments.run's | "
        "load avg (before, after) |",
        "|---|---|---:|---:|---|",
      ]
      for e in engines:
        secs = round_seconds(e, by_engine[e]["records"])
        if not secs:
          continue
        med = statistics.median(secs)
        ratio = f"{med / statistics.median(ref_s):.2f}" if ref_s else "-"
        lines.append(
          f"| {e} | {', '.join(f'{v:.2f}' for v in secs)} | {med:.2f} | {ratio} | "
          f"{_fmt(by_engine[e].get('load_average'))} |"
        )
        if e == "deployment" and ref_s:
          goal = med / statistics.median(ref_s) <= DEPLOYMENT_GOAL
          goal_line = (
            f"Goal: a deployment round after the first costs at most "
            f"{DEPLOYMENT_GOAL}x an experiments.run round: "
            f"{'met' if goal else 'NOT met'} ({med / statistics.median(ref_s):.2f}x)."
          )
      lines.append("")
      if goal_line:
        lines += [goal_line, ""]
    if len(by_seed) > 1:
      engines = sorted({e for by_engine in by_seed.values() for e in by_engine})
      lines += [
        f"### {label}: final test accuracy over seeds {list(by_seed)}",
        "",
        "| engine | mean | std | values |",
        "|---|---:|---:|---|",
      ]
      for e in engines:
        vals = [
          by_engine[e]["records"][-1]["test_accuracy"]
          for by_engine in by_seed.values()
          if e in by_engine
        ]
        std = statistics.stdev(vals) if len(vals) > 1 else math.nan
        lines.append(
          f"| {e} | {statistics.mean(vals):.4f} | {std:.4f} | "
          f"{', '.join(f'{v:.4f}' for v in vals)} |"
        )
      lines.append("")
  text = "\n".join(lines)
  (out / "report.md").write_text(text)
  (out / "report.json").write_text(json.dumps(results, indent=1, default=str))
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, required=True)
  p.add_argument("--configs", nargs="+", default=["quickstart:dp_loops", "quickstart:nondp"])
  p.add_argument("--overrides", default="")
  p.add_argument("--engines", nargs="+", default=list(ENGINES[:3]), choices=ENGINES)
  p.add_argument("--seeds", nargs="+", type=int, default=[0])
  p.add_argument("--max-epsilon", type=float, default=50.0)
  p.add_argument("--round-timeout", type=float, default=900.0)
  args = p.parse_args(argv)
  args.out = args.out.resolve()  # the Flower processes run in their own directories
  # SIGTERM unwinds like Ctrl-C, so every Federation stops its processes.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  from fedlap_flower import settings  # pylint: disable=g-import-not-at-top

  args.out.mkdir(parents=True, exist_ok=True)
  jax_cache = args.out / "jax_cache"
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(jax_cache))
  results: dict = {}
  for config in args.configs:
    for seed in args.seeds:
      overrides = f"{args.overrides} seed={seed}".strip()
      cfg, label = settings.load_config(config, overrides)
      for engine in args.engines:
        if engine == "deployment-server-keys" and not cfg.dp.enabled:
          continue
        wd = args.out / label / f"s{seed}" / engine
        print(f"== {label} seed {seed}: {engine} -> {wd}", flush=True)
        load_before = os.getloadavg()[0]
        if engine == "experiments":
          res = run_experiments(config, overrides, wd)
        else:
          res = run_flower(
            config,
            overrides,
            wd,
            engine=engine,
            num_clients=int(cfg.data.num_clients),
            dp=bool(cfg.dp.enabled),
            max_epsilon=args.max_epsilon,
            jax_cache=jax_cache,
            timeout=args.round_timeout,
          )
        # The machine may be shared: the 1-minute load average before and after the run.
        res["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        print(
          f"   final accuracy {res['records'][-1]['test_accuracy']:.4f}, "
          f"{res['wall_seconds']:.0f} s, load average {res['load_average']}",
          flush=True,
        )
        results.setdefault(label, {}).setdefault(seed, {})[engine] = res
        report(results, args.out)
  print(report(results, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
