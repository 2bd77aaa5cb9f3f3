"""Many clients: time per round and peak memory for 5 to 500 clients on the same total data.

The 8,000 MNIST training records of the ``mnist10k`` subset (built by
``python -m fedlap_runs.datasets mnist10k``; ``--data PATH`` for another copy)
are split by the project's Dirichlet partition
(``data.partition=dirichlet``, ``alpha`` 0.5) among K = 5, 20, 100 and 500
clients; each setting runs FedLAP-DP and DP-FedAvg through the experiment
driver (:func:`experiments.train.train_and_evaluate`) with 5 clients per round
(``data.clients_per_round=5``: only their block goes to the device) and with
every client (``None``: today's path). Per setting, one fresh process (so its
peak RSS is its own): the first round (compile included), the median of the
later rounds' ``round_seconds`` (round + test evaluation + the clients'
ledgers), peak RSS (``ru_maxrss``), the clients' data on the host and the
block a round moves to the device, and the 1-minute load average before and
after (the machine is shared with other jobs: compare rows of one table, the
relative scaling is what matters). The accounting column is the mean time per round
spent composing ledgers (:class:`fedlap_jax.accounting.ClientLedgers` with 5 per round:
one RDP composition per distinct participant ledger; every client: the one ledger of
``q = B / min_k N_k``).

A small workload per client keeps the 500-client rounds in CPU reach: a
ConvNet of width 16 and depth 2, FedLAP-DP with one outer iteration of 4 noisy
real batches, ``ipc`` 2, two server epochs; DP-FedAvg one local epoch. Every
client's Poisson batch is ``B = 3`` (the smallest of the 500 clients holds 3
records; ``B <= min_k N_k`` under DP), so a FedLAP-DP client costs the same
at every K, and a DP-FedAvg client's ``T = round(N_max / B)`` steps shrink as
the clients get smaller. The privacy figures of these runs are not meaningful
(q = 1 for the smallest client); the accounting cost is part of the round.

  python -m fedlap_runs.datasets mnist10k            # once: the data (needs tfds online)
  python -m benchmarks.many_clients                  # the table, JSON lines and the PNG
  python -m benchmarks.many_clients --data PATH      # mnist10k from elsewhere
  python -m benchmarks.many_clients --small          # a quick check: digits, K 5 and 20, 2 rounds
  python -m benchmarks.many_clients --from-log LOG   # table and plot again from a run's output
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLIENTS = (5, 20, 100, 500)
SMALL_CLIENTS = (5, 20)
METHODS = ("fedlap_dp", "dp_fedavg")
PER_ROUND = 5
BATCH = 3
SUBSET = "mnist10k"
PNG = Path(__file__).parent / "results" / "many_clients.png"


def default_data() -> Path:
  """Where ``python -m fedlap_runs.datasets mnist10k`` writes the subset by default."""
  from fedlap_runs import datasets  # pylint: disable=g-import-not-at-top

  return datasets.output_path(SUBSET)


def bench_config(
  method: str,
  num_clients: int,
  per_round: int | None,
  *,
  rounds: int,
  small: bool,
  data: str | os.PathLike | None = None,
):
  """The measured config: ``method`` on K Dirichlet clients, ``per_round`` of them per round.

  ``data``: the mnist10k npz (default :func:`default_data`); unused with ``small``
  (scikit-learn's digits).
  """
  from fedlap_runs.configs import baselines, quickstart  # pylint: disable=g-import-not-at-top

  if method == "fedlap_dp":
    cfg = quickstart.dp_config()
    c = cfg.client
    c.ipc, c.iterations, c.max_outer, c.batch_loop, c.boost_loop, c.inner_loop = 2, 1, 1, 4, 1, 0
    c.dsa_strategy = ""
    cfg.server.dsa_strategy = ""
    cfg.server.max_epochs = 2
  elif method == "dp_fedavg":
    cfg = baselines.get_baseline_config("mnist", "dp_fedavg")
    cfg.baseline.local_epochs = 1
  else:
    raise SystemExit(f"method={method!r} is invalid; allowed: one of {METHODS}")
  if small:
    cfg.data.name, cfg.data.source = "digits", "sklearn"
    cfg.data.normalisation = "test_split"
  else:
    cfg.data.name, cfg.data.source = "mnist", f"npz:{data or default_data()}"
    cfg.data.normalisation = "published"
  cfg.data.partition = "dirichlet"
  cfg.data.dirichlet_alpha = 0.5
  cfg.data.num_clients = num_clients
  cfg.data.clients_per_round = per_round
  cfg.client.batch_size = BATCH
  cfg.model.width, cfg.model.depth = 16, 2
  cfg.rounds = rounds
  cfg.seed = 0  # a measurement, not a private run: the seed the recorded figures used
  cfg.client_backend = "map"
  cfg.plots = cfg.progress_bar = False
  cfg.snapshot_rounds = ()
  cfg.checkpoint_every = rounds
  cfg.eval_chunk_size = 500
  return cfg


def measure(
  method: str,
  num_clients: int,
  per_round: int | None,
  rounds: int,
  small: bool,
  data: str | None = None,
) -> dict:
  """One setting in this process (call it in a fresh one: peak RSS is the process's)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from experiments import train  # pylint: disable=g-import-not-at-top

  from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top

  cfg = bench_config(method, num_clients, per_round, rounds=rounds, small=small, data=data)
  # Time the accounting apart (every ledger's round composition goes through here).
  spent = []
  compose = accounting.PrivacyLedger.record_round

  def timed(self, *a, **kw):
    t = time.perf_counter()
    try:
      return compose(self, *a, **kw)
    finally:
      spent.append(time.perf_counter() - t)

  accounting.PrivacyLedger.record_round = timed
  load_before = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    out = train.train_and_evaluate(cfg, workdir)
    total = time.perf_counter() - t0
    info = json.loads((Path(workdir) / "run_info.json").read_text())
  records = out["timing"]  # round_seconds: timing.jsonl's records, one per round
  sizes = info["client_sizes"]
  accounting_s = sum(spent) / len(records)
  n_max = max(sizes)
  record_bytes = int(np.prod(info["image_shape"]))  # uint8 pixels
  m = num_clients if per_round is None else per_round
  return {
    "method": method,
    "clients": num_clients,
    "per_round": m,
    "rounds": rounds,
    "first_round_s": round(records[0]["round_seconds"], 2),
    "round_s": round(statistics.median(r["round_seconds"] for r in records[1:]), 3),
    "rounds_s": [round(r["round_seconds"], 3) for r in records],
    "accounting_s": round(accounting_s, 3),
    "ledger_compositions": len(spent),
    "total_s": round(total, 1),
    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "host_data_mb": round(num_clients * n_max * record_bytes / 1e6, 2),
    "block_mb": round(m * n_max * record_bytes / 1e6, 2),
    "n_min": min(sizes),
    "n_max": n_max,
    "epsilon_max": out["records"][-1]["epsilon"],
    "load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
  }


def run_child(
  method: str,
  num_clients: int,
  per_round: int | None,
  rounds: int,
  small: bool,
  data: str | None = None,
) -> dict:
  argv = [
    sys.executable,
    "-m",
    "benchmarks.many_clients",
    "--one",
    f"{method},{num_clients},{per_round or 0}",
    f"--rounds={rounds}",
  ]
  if small:
    argv.append("--small")
  if data:
    argv.append(f"--data={data}")
  proc = subprocess.run(argv, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    raise SystemExit(
      f"setting {method} K={num_clients} m={per_round} failed "
      f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
  return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
  out = [
    "| method | clients K | per round | N_k min..max | round 1 with compile (s) | "
    "s / round | of which accounting | peak RSS (MB) | host data (MB) | device block (MB) | "
    "load before, after |",
    "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in rows:
    out.append(
      f"| {r['method']} | {r['clients']} | {r['per_round']} | {r['n_min']}..{r['n_max']}"
      f" | {r['first_round_s']} | {r['round_s']} | {r['accounting_s']} | "
      f"{r['peak_rss_mb']} | "
      f"{r['host_data_mb']} | {r['block_mb']} | {r['load'][0]}, {r['load'][1]} |"
    )
  return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
  for method in METHODS:
    for all_clients, style in ((False, "-o"), (True, "--s")):
      # K = 5 is on both lines (5 per round is every client there).
      pts = sorted(
        (r["clients"], r["round_s"] - r["accounting_s"])
        for r in rows
        if r["method"] == method
        and (r["per_round"] == r["clients"] if all_clients else r["per_round"] == PER_ROUND)
      )
      if pts:
        label = f"{method}, {'all clients' if all_clients else f'{PER_ROUND} per round'}"
        ax.plot(*zip(*pts), style, label=label)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("clients K (same 8,000 records, Dirichlet alpha 0.5)")
  ax.set_ylabel("s / round, accounting excluded")
  ax.set_title("Round time vs clients (shared 2-core CPU)", fontsize=10)
  ax.legend(fontsize=7)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--small", action="store_true", help="digits (sklearn), K 5 and 20, 2 rounds: a quick check"
  )
  parser.add_argument(
    "--data",
    default=None,
    help="the mnist10k npz (default: where `python -m fedlap_runs.datasets mnist10k` writes it)",
  )
  parser.add_argument(
    "--rounds",
    type=int,
    default=None,
    help="rounds per setting (default 3; --small 2); the first compiles",
  )
  parser.add_argument("--clients", default=None, help="comma-separated K (default 5,20,100,500)")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--png", default=str(PNG))
  parser.add_argument(
    "--from-log",
    default=None,
    help="print the table and draw the plot from the JSON lines of an earlier run",
  )
  parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  rounds = args.rounds or (2 if args.small else 3)
  if rounds < 2:
    raise SystemExit(f"--rounds={rounds} is invalid; allowed: >= 2 (round 1 compiles)")
  if args.from_log:
    rows = [
      json.loads(l) for l in Path(args.from_log).read_text().splitlines() if l.startswith("{")
    ]
    print(table(rows))
    plot(rows, Path(args.png))
    print(f"plot: {args.png} ({Path(args.png).stat().st_size / 1e3:.0f} KB)")
    return 0
  if args.one:
    method, k, m = args.one.split(",")
    print(
      json.dumps(measure(method, int(k), int(m) or None, rounds, args.small, args.data)), flush=True
    )
    return 0
  if not args.small and not Path(args.data or default_data()).is_file():
    raise SystemExit(
      f"--data={str(args.data or default_data())!r} is invalid: no such file; "
      f"allowed: the {SUBSET} npz, built by `python -m fedlap_runs.datasets "
      f"{SUBSET}`, or --small (scikit-learn's digits, offline)"
    )
  ks = (
    [int(k) for k in args.clients.split(",")]
    if args.clients
    else SMALL_CLIENTS
    if args.small
    else CLIENTS
  )
  rows = []
  for method in args.methods.split(","):
    for k in ks:
      for per_round in (PER_ROUND, None) if k > PER_ROUND else (None,):
        rows.append(run_child(method, k, per_round, rounds, args.small, args.data))
        print(json.dumps(rows[-1]), flush=True)
  print(table(rows))
  plot(rows, Path(args.png))
  print(f"plot: {args.png} ({Path(args.png).stat().st_size / 1e3:.0f} KB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
