"""Does the shared DSA family draw change FedLAP's accuracy? Seeds of the quickstart, old vs new.

``ClientConfig.dsa_family_draw="shared"`` (the default) draws one DSA family
per step for all clients of a round (each client still draws that family's
parameters); ``"per_client"`` is the random stream of earlier versions (each
client its own family). Every client sees each family with probability 1/6
either way; only the joint draw across clients differs. This script runs the
quickstart (FedLAP-DP and FedLAP on digits, 10 rounds) for several seeds with
each draw, in one process (the seeds of one setting share a compilation), and
compares the final test accuracies with Welch's t-test (scipy) and a
two-sided permutation test of the difference of means::

  python -m benchmarks.family_draw_accuracy                  # 5 seeds, dp and nondp
  python -m benchmarks.family_draw_accuracy --seeds=3 --variants=dp

Runs are ordered seed by seed, so a stopped run still printed whole pairs.
Each result line is printed as it arrives; the summary table comes last. The
clients run with the default backend (``auto``); the draw, not the backend,
sets the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time

import numpy as np

DRAWS = ("per_client", "shared")


def run_once(variant: str, draw: str, seed: int, workdir: str) -> dict:
  """One quickstart run; returns its final test accuracy and wall time."""
  from experiments import train
  from fedlap_runs.configs import quickstart

  cfg = quickstart.dp_config() if variant == "dp" else quickstart.nondp_config()
  cfg.seed = seed
  cfg.client.dsa_family_draw = draw
  cfg.plots = False
  cfg.progress_bar = False
  cfg.checkpoint_every = cfg.rounds
  cfg.snapshot_rounds = ()
  start = time.perf_counter()
  out = train.train_and_evaluate(cfg, workdir)
  return {
    "variant": variant,
    "draw": draw,
    "seed": seed,
    "accuracy": float(out["records"][-1]["test_accuracy"]),
    "seconds": round(time.perf_counter() - start, 1),
  }


def permutation_p(a, b, rounds: int = 20000, seed: int = 0) -> float:
  """Two-sided permutation p-value of ``mean(a) - mean(b)`` (exact when few splits)."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  pooled = np.concatenate([a, b])
  observed = abs(a.mean() - b.mean())
  n = len(a)
  splits = list(itertools.combinations(range(len(pooled)), n))
  if len(splits) > rounds:
    rng = np.random.default_rng(seed)
    splits = [rng.choice(len(pooled), n, replace=False) for _ in range(rounds)]
  count = 0
  for idx in splits:
    mask = np.zeros(len(pooled), bool)
    mask[list(idx)] = True
    count += abs(pooled[mask].mean() - pooled[~mask].mean()) >= observed - 1e-12
  return count / len(splits)


def summarise(results: list[dict]) -> list[str]:
  """The comparison table: mean, std, Welch t-test and permutation p per variant."""
  from scipy import stats

  lines = [
    "| run | per_client (old) mean +- std | shared (new) mean +- std | difference | "
    "Welch t, p | permutation p | seeds |",
    "|---|---|---|---|---|---|---|",
  ]
  for variant in sorted({r["variant"] for r in results}):
    acc = {
      d: [r["accuracy"] for r in results if r["variant"] == variant and r["draw"] == d]
      for d in DRAWS
    }
    n = min(len(acc[d]) for d in DRAWS)
    if n < 2:
      lines.append(f"| quickstart:{variant} | fewer than 2 seeds per draw | | | | | {n} |")
      continue
    old, new = np.array(acc["per_client"][:n]), np.array(acc["shared"][:n])
    t = stats.ttest_ind(new, old, equal_var=False)
    lines.append(
      f"| quickstart:{variant} | {old.mean():.4f} +- {old.std(ddof=1):.4f} | "
      f"{new.mean():.4f} +- {new.std(ddof=1):.4f} | {new.mean() - old.mean():+.4f} | "
      f"{t.statistic:+.2f}, {t.pvalue:.3f} | {permutation_p(new, old):.3f} | {n} |"
    )
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--variants", default="dp,nondp")
  args = parser.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v]
  from fedlap_runs import compilation_cache  # pylint: disable=g-import-not-at-top

  compilation_cache.enable()  # as experiments.run: each setting compiles once per machine
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for seed in range(args.seeds):
      for variant in variants:
        for draw in DRAWS:
          r = run_once(variant, draw, seed, f"{tmp}/{variant}_{draw}_{seed}")
          results.append(r)
          print(json.dumps(r), flush=True)
  print("\n".join(summarise(results)))


if __name__ == "__main__":
  main()
