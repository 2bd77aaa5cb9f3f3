r"""What one hostile client can still do to the Flower server's aggregate, measured.

  python -m benchmarks.flower_hostile [--out runs/flower_hostile.json] [--cases ...]

Each case runs the Flower app in process (the real ServerApp and ClientApp over
:class:`flower_harness.InProcessGrid`, no SuperLink) on scikit-learn's digits
with 5 clients; client 0 (node 101) computes its round honestly and then
changes its reply within what the server accepts (every value inside the
bounds of :mod:`fedlap_flower.replies`), every round. The honest run and the
run with client 0 silent are the references. Without DP the server sends the
round keys, so every difference comes from the tampered reply; the hybrid DP
recipe runs with the test-only server keys for the same reason.

Cases (``quickstart:nondp``, 10 rounds, unless named otherwise):

* ``honest``, ``silent``: all 5 clients honest; client 0 silent.
* ``num_examples_max``: client 0 says ``num-examples = MAX_NUM_EXAMPLES`` from
  its first reply on (pinned then; ``server.weighting='size'``, the default
  without DP); ``num_examples_max_uniform``: the same under
  ``server.weighting='uniform'``.
* ``radius_floor_<strategy>``: client 0 sends the smallest radius accepted
  (:func:`fedlap_jax.update_bounds.radius_floor`) under
  ``server.radius_strategy`` ``min`` (the default), ``median``, ``mean``;
  ``radius_max_max``: the largest, ``r``, under ``max``;
  ``honest_<strategy>``: the honest run under that strategy.
* ``hybrid_honest``, ``hybrid_silent``, ``hybrid_flipped_delta``
  (``quickstart:dp``, 5 rounds): client 0's model delta sign-flipped and scaled
  to 0.99 x the server's delta bound (:func:`fedlap_jax.update_bounds.matching_delta_bound`).

And the ServerApp Grid's pulls of a reply (Flower's HTTP Grid against a fake
SuperLink, :func:`pull_cases`; ``--pulls-only``): ``trickle``, a reply whose
objects arrive one at a time, listed before an honest one; ``oversized``, a
200 MB reply where the round's update takes 26 KB.

Printed: the test accuracy after round 1 and after the last round per case,
and the ratio of the tampered delta's norm to the honest one. The results
live in docs/flower.md with this command.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_NODE = 101  # partition 0

NONDP = ("quickstart:nondp", "")
HYBRID = ("quickstart:dp", "")


def _eta(msg) -> float:
  """The round's client learning rate ``eta_m``, as the server's message names it."""
  return float(msg.content["message"]["rates.client"].numpy())


def _update(content, **arrays):
  """``content`` with these arrays of its ``"update"`` record (FedLAP's wire names)."""
  from flwr.app import Array, ArrayRecord, RecordDict

  old = {k: a.numpy() for k, a in content["update"].items()}
  new = {**old, **arrays}
  return RecordDict(
    {**dict(content.items()), "update": ArrayRecord({k: Array(v) for k, v in new.items()})}
  )


def _metrics(content, **values):
  from flwr.app import MetricRecord, RecordDict

  return RecordDict(
    {**dict(content.items()), "metrics": MetricRecord({**dict(content["metrics"]), **values})}
  )


def _num_examples(content, msg):
  from fedlap_flower import replies

  return _metrics(content, **{"num-examples": replies.MAX_NUM_EXAMPLES})


def _radius_floor(content, msg):
  from fedlap_jax import update_bounds

  return _update(content, radius=np.array(update_bounds.radius_floor(_eta(msg)), np.float32))


def _radius_max(content, msg):
  from fedlap_flower import settings

  r = settings.run_settings({"config": NONDP[0]}).cfg.client.radius
  return _update(content, radius=np.array(r, np.float32))


def _flipped_delta(stats):
  """Client 0's delta, sign-flipped, scaled to 0.99 x the server's bound (records the ratio)."""

  def tamper(content, msg):
    from fedlap_runs import library_configs
    from fedlap_flower import replies, settings
    from fedlap_jax import update_bounds

    run = settings.run_settings({"config": HYBRID[0], "overrides": HYBRID[1]})
    fc = library_configs.library_config(run.cfg)
    update = content["update"]
    leaves = {k: a.numpy() for k, a in update.items() if k.startswith("model_delta.")}
    d = sum(v.size for v in leaves.values())
    bound = update_bounds.matching_delta_bound(fc.client, _eta(msg), d)
    norm = replies.check_delta_norm(leaves, None)
    scale = -0.99 * bound / norm
    stats.append({"honest_norm": norm, "bound": bound, "ratio_to_honest": 0.99 * bound / norm})
    return _update(content, **{k: (v * scale).astype(v.dtype) for k, v in leaves.items()})

  return tamper


def cases(stats):
  """``name -> (config, overrides, tamper or None, silent)``."""
  out = {
    "honest": (*NONDP, None, False),
    "silent": (*NONDP, None, True),
    "num_examples_max": (*NONDP, _num_examples, False),
    "honest_uniform": (NONDP[0], "server.weighting=uniform", None, False),
    "num_examples_max_uniform": (NONDP[0], "server.weighting=uniform", _num_examples, False),
    "radius_floor_min": (*NONDP, _radius_floor, False),
  }
  for strategy in ("median", "mean", "max"):
    over = f"server.radius_strategy={strategy}"
    out[f"honest_{strategy}"] = (NONDP[0], over, None, False)
    if strategy == "max":
      out["radius_max_max"] = (NONDP[0], over, _radius_max, False)
    else:
      out[f"radius_floor_{strategy}"] = (NONDP[0], over, _radius_floor, False)
  out["hybrid_honest"] = (*HYBRID, None, False)
  out["hybrid_silent"] = (*HYBRID, None, True)
  out["hybrid_flipped_delta"] = (*HYBRID, _flipped_delta(stats), False)
  return out


def run_case(config, overrides, tamper, silent, workdir: Path) -> list[dict]:
  """The ServerApp's per-round records of one case."""
  from flwr.app import Message
  from flower_harness import node_configs, run_inprocess
  from fedlap_flower import settings

  rc = {"config": config, "overrides": overrides, "run-dir": str(workdir / "run"), "min-clients": 4}
  if config == HYBRID[0]:
    rc.update({"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0})
    os.environ[settings.UNSAFE_ENV] = "1"

  def hook(grid):
    if silent:
      grid.silent.add(HOSTILE_NODE)
    if tamper is None:
      return
    real = grid.answer

    def answer(msg):
      reply = real(msg)
      if msg.metadata.dst_node_id == HOSTILE_NODE and msg.metadata.message_type == "train":
        return Message(content=tamper(reply.content, msg), reply_to=msg)
      return reply

    grid.answer = answer

  records, _ = run_inprocess(rc, node_configs(state_root=workdir / "state"), grid_hook=hook)
  return records


# The ServerApp Grid's pulls of a reply: Flower's HTTP Grid against the tests' fake SuperLink.


def pull_cases(
  trickle_objects: int = 40, every: float = 0.25, timeout: float = 2.0, big_mb: int = 200
) -> dict:
  """``trickle``: a reply whose ``trickle_objects`` objects arrive one every ``every`` s, listed
  before a complete honest one, which is listed 0.3 s into a round of ``timeout`` s: the
  round's seconds and which replies it takes. ``oversized``: a reply of ``big_mb`` MB where
  the round's update takes 26 KB (100 images of 8 x 8 x 1, their labels and mask, a radius): the bytes of it
  pulled before it is refused, and the round's seconds."""
  from fedlap_flower.runtime import object_pulls
  from tests.fake_superlink import FakeSuperLink, prompt_grid_over, reply_objects

  rng = np.random.default_rng(0)
  trickled = reply_objects(
    "m0", {f"a{i}": rng.normal(size=8) for i in range(trickle_objects // 2)}, 0
  )
  honest = reply_objects("m1", {"a": np.ones(100, np.float32)}, 1)
  order = {i: n for n, i in enumerate(trickled[2])}
  out = {}
  superlink = FakeSuperLink(
    [trickled, honest],
    available=lambda i, t: i not in order or t >= every * order[i],
    listed=(0, 0.3),
  )
  grid = prompt_grid_over(superlink)
  t0 = time.monotonic()
  got = {
    m.metadata.reply_to_message_id: m for m in grid.send_and_receive(["a", "b"], timeout=timeout)
  }
  out["trickle"] = {
    "seconds": time.monotonic() - t0,
    "round_timeout": timeout,
    "trickled_taken": "m0" in got and not got["m0"].has_error(),
    "honest_taken": "m1" in got and not got["m1"].has_error(),
  }
  big = reply_objects("m0", {"x": np.arange(big_mb * 2**20 // 4, dtype=np.float32)}, 0)
  superlink = FakeSuperLink([big, honest])
  grid = prompt_grid_over(superlink)
  update_bytes = 100 * 8 * 8 * 4 + 100 * 4 + 100 + 4  # x, y, mask, radius
  if hasattr(grid, "limit_replies"):
    grid.limit_replies(update_bytes, 4)
  t0 = time.monotonic()
  got = {
    m.metadata.reply_to_message_id: m for m in grid.send_and_receive(["a", "b"], timeout=timeout)
  }
  out["oversized"] = {
    "seconds": time.monotonic() - t0,
    "reply_bytes": sum(len(b) for b in big[2].values()),
    "pulled_bytes": sum(n for i, n in superlink.pulled.items() if i in big[2]),
    "taken": "m0" in got and not got["m0"].has_error(),
    "honest_taken": "m1" in got and not got["m1"].has_error(),
  }
  limits = getattr(object_pulls, "GRID_LIMITS", None)
  if limits is not None:
    limits.__init__()
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/flower_hostile.json")
  parser.add_argument("--cases", nargs="*", default=None, help="names of cases (default: all)")
  parser.add_argument(
    "--pulls-only", action="store_true", help="only the trickled and the oversized reply"
  )
  args = parser.parse_args(argv)
  pulls = pull_cases()
  for name, figures in pulls.items():
    print(f"{name:28s} {json.dumps(figures, default=float)}", flush=True)
  if args.pulls_only:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(pulls, indent=2, default=float) + "\n")
    return 0
  sys.path.insert(0, str(ROOT / "tests"))  # flower_harness: the in-process grid
  os.environ.setdefault("FEDLAP_FLOWER_JAX_CACHE", "off")
  from flwr.common.logger import FLOWER_LOGGER  # pylint: disable=g-import-not-at-top

  FLOWER_LOGGER.setLevel(logging.WARNING)  # Flower's per-round INFO lines
  stats: list[dict] = []
  table = cases(stats)
  names = args.cases or list(table)
  results: dict = dict(pulls)
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      t0 = time.time()
      records = run_case(*table[name], Path(tmp) / name)
      results[name] = {
        "accuracy": [r["test_accuracy"] for r in records],
        "server_radius": [r.get("server_radius") for r in records],
        "server_steps": [r.get("server_steps") for r in records],
        "clients_ok": [r["clients_ok"] for r in records],
        "seconds": time.time() - t0,
      }
      acc = results[name]["accuracy"]
      print(
        f"{name:28s} round 1 {100 * acc[0]:5.1f} %  last (round {len(acc)}) "
        f"{100 * acc[-1]:5.1f} %  server steps {results[name]['server_steps']}",
        flush=True,
      )
  if stats:
    ratios = [s["ratio_to_honest"] for s in stats]
    print(f"flipped delta: {min(ratios):.2f}x to {max(ratios):.2f}x the honest delta's norm")
    results["hybrid_flipped_delta_norms"] = stats
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(results, indent=2, default=float) + "\n")
  print(f"wrote {args.out}")
  finite = all(math.isfinite(a) for r in results.values() if "accuracy" in r for a in r["accuracy"])
  return 0 if finite else 1


if __name__ == "__main__":
  sys.exit(main())
