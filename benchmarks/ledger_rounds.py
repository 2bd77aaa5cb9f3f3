"""Time of one round of :meth:`fedlap_jax.accounting.ClientLedgers.record_round` at K clients.

  python -m benchmarks.ledger_rounds [--clients 500] [--rounds 6] [--per-round 5 500]

K clients hold the records of a Dirichlet partition (alpha 0.5, seed 0) of 8,000 records in
10 balanced classes (:func:`fedlap_runs.data.partition`; no data set is read), each at least
``B = 3``; the mechanism is the many-clients benchmark's FedLAP-DP (sigma 1, ``B = 3``,
``T = 4`` per round, delta 1e-5; ``q_k = 3 / N_k`` up to 1, so the epsilons mean nothing).
Each round charges the clients :func:`fedlap_jax.participation.sample_clients` draws from
the public seed 0. Three ways, side by side in this process:

* ``before``: a participant's ledger composed in its own ``dp_accounting.RdpAccountant``
  (a deep copy of the ledger, ``compose(round_event)``, ``get_epsilon``), once per distinct
  ledger among the round's participants: the accounting this module replaced, kept here
  for the comparison;
* ``after, add_remove``: :class:`~fedlap_jax.accounting.ClientLedgers` with the same
  figure (per-rate RDP vectors cached, composed by addition);
* ``after, replace_one``: the headline the experiments report (replace-one by PLD, one
  composition per distinct rate and step count of the round, cached) plus add/remove.

Prints, per (way, participants per round), the first round (cold caches), the median of
the later rounds and of the last half of the rounds (once most rates were met: with
sampling, a round costs the most while new rates keep appearing), with the 1-minute load
average after each way; the epsilons of the two add/remove ways must agree.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

SIGMA, BATCH, STEPS, DELTA = 1.0, 3, 4, 1e-5


def client_sizes(num_clients: int) -> list[int]:
  """``N_k`` of the Dirichlet partition (alpha 0.5, seed 0) of 8,000 records, each >= B."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  y = np.repeat(np.arange(10), 800)
  parts = data_lib.partition(
    y, num_clients=num_clients, scheme="dirichlet", num_classes=10, alpha=0.5, seed=0
  )
  return [max(BATCH, len(p)) for p in parts]


class BeforeLedgers:
  """Per-client ledgers composed as before: one RdpAccountant per distinct ledger and round."""

  def __init__(self, sizes):
    from dp_accounting import rdp  # pylint: disable=g-import-not-at-top

    self.ledgers = [{"n": n, "steps": (), "acc": rdp.RdpAccountant(), "eps": 0.0} for n in sizes]

  def record_round(self, steps=None, *, participants) -> float:
    del steps  # always STEPS
    ids = participants
    from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top

    done, new = {}, list(self.ledgers)
    for i in ids:
      old = self.ledgers[i]
      key = (old["n"], old["steps"])
      if key not in done:
        led = copy.deepcopy(old)
        led["acc"].compose(
          accounting.round_event(
            noise_multiplier=SIGMA,
            batch_size=BATCH,
            min_client_size=led["n"],
            steps_per_round=STEPS,
          )
        )
        led["eps"] = float(led["acc"].get_epsilon(DELTA))
        led["steps"] = led["steps"] + (STEPS,)
        done[key] = led
      new[i] = done[key]
    self.ledgers = new
    return max(l["eps"] for l in self.ledgers)


def after_ledgers(sizes, adjacency):
  from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top

  return accounting.DpMechanism(
    noise_multiplier=SIGMA,
    batch_size=BATCH,
    steps_per_round=STEPS,
    delta=DELTA,
    adjacency=adjacency,
  ).client_ledgers(sizes)


def time_rounds(ledgers, draws) -> tuple[list[float], float]:
  seconds, eps = [], 0.0
  for ids in draws:
    t0 = time.perf_counter()
    eps = max(ledgers.record_round(participants=ids))
    seconds.append(time.perf_counter() - t0)
  return seconds, eps


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--clients", type=int, default=500)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--per-round", type=int, nargs="+", default=[5, 500])
  args = p.parse_args(argv)
  from fedlap_jax import accounting, participation  # pylint: disable=g-import-not-at-top

  sizes = client_sizes(args.clients)
  print(
    f"K = {args.clients} clients, N_k {min(sizes)}..{max(sizes)} ({len(set(sizes))} "
    f"distinct), sigma {SIGMA}, B {BATCH}, T {STEPS}, delta {DELTA:g}, "
    f"{args.rounds} rounds; load before {os.getloadavg()[0]:.2f}"
  )
  print(
    "| way | per round | round 1 (s) | median of rounds 2.. (s) | median of the last half "
    "(s) | final epsilon | load |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for m in args.per_round:
    draws = [
      participation.sample_clients(0, r, args.clients, m).tolist()
      for r in range(1, args.rounds + 1)
    ]
    eps_of = {}
    for way, make in (
      ("before", lambda: BeforeLedgers(sizes)),
      ("after, add_remove", lambda: after_ledgers(sizes, "add_remove")),
      ("after, replace_one", lambda: after_ledgers(sizes, "replace_one")),
    ):
      for cache in (
        accounting._step_rdp,
        accounting._step_pld,  # pylint: disable=protected-access
        accounting._replace_one,
      ):  # pylint: disable=protected-access
        cache.cache_clear()  # each way starts cold
      seconds, eps = time_rounds(make(), draws)
      eps_of[way] = eps
      later = statistics.median(seconds[1:]) if len(seconds) > 1 else float("nan")
      last = statistics.median(seconds[len(seconds) // 2 :])
      print(
        f"| {way} | {m} | {seconds[0]:.3f} | {later:.4f} | {last:.4f} | {eps:.4f} | "
        f"{os.getloadavg()[0]:.2f} |",
        flush=True,
      )
    if abs(eps_of["before"] - eps_of["after, add_remove"]) > 1e-9 * eps_of["before"]:
      raise SystemExit(f"the add/remove epsilons differ: {eps_of}")
  print(f"load after {os.getloadavg()[0]:.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
