"""Kill test: real ``python -m experiments.run`` processes, killed and resumed.

A tiny FedLAP-DP run (digits, ConvNet-8x1, 6 rounds, a checkpoint every 2
rounds) is run once straight, and once as a chain of processes that are
interrupted at deterministic points by the fault-injection hook
(:mod:`experiments.faults`, ``FEDLAP_JAX_FAULT=POINT:ROUND[:SIGNAL]``):

1. SIGKILL during round 3 (computed, nothing of it written);
2. SIGKILL inside the checkpoint save of round 4 (orbax's temporary directory
   half written);
3. SIGKILL inside the atomic write of the privacy ledger after round 5;
4. SIGTERM during round 5: the round finishes, checkpoint 5 is saved, exit 143;
5. the last resume runs round 6.

The final metrics, privacy ledger, synthetic sets and checkpointed state must
equal the straight run's. The processes share a persistent XLA compilation
cache (only the first one compiles), so the whole test takes about a minute on
2 busy CPU cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import checkpointing

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {
    "model.width": 8, "model.depth": 1, "client.ipc": 2, "client.iterations": 1,
    "client.max_outer": 1, "client.batch_loop": 2, "client.boost_loop": 1,
    "client.inner_loop": 0, "client.batch_size": 16, "client.dsa_strategy": "",
    "server.dsa_strategy": "", "server.max_epochs": 2, "rounds": 6, "eval_chunk_size": 400,
    "checkpoint_every": 2, "plots": False, "progress_bar": False,
}
TIMING = ("round_seconds", "wall_seconds", "first_in_process")


def launch(workdir: Path, cache: Path, fault: str | None = None) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("FEDLAP_JAX_FAULT", None)
  if fault:
    env["FEDLAP_JAX_FAULT"] = fault
  argv = [sys.executable, "-m", "experiments.run", "--config=quickstart:dp_loops",
          *(f"--config.{k}={v}" for k, v in FLAGS.items()), f"--workdir={workdir}"]
  return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def rounds_in(workdir: Path) -> list[int]:
  return [r["round"] for r in checkpointing.read_metrics(workdir / "metrics.jsonl")]


def complete_checkpoints(workdir: Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def ledger_rounds(workdir: Path) -> int:
  return json.loads((workdir / "privacy_ledger.json").read_text())["rounds"]


def state_arrays(workdir: Path, round_index: int) -> dict:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(workdir / "checkpoints")
  restored = manager.restore(round_index, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))
  manager.close()
  return {k: np.asarray(v) for k, v in restored["state"].items()}


@pytest.mark.slow
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
  cache = tmp_path / "xla_cache"
  straight, chain = tmp_path / "straight", tmp_path / "chain"
  done = launch(straight, cache)
  assert done.returncode == 0, done.stderr[-2000:]

  # 1. SIGKILL in round 3: checkpoint 2 and records 1..2 survive.
  p = launch(chain, cache, "round:3")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert complete_checkpoints(chain) == [2] and rounds_in(chain) == [1, 2]
  assert ledger_rounds(chain) == 2

  # 2. SIGKILL inside the save of checkpoint 4: only orbax's temporary directory exists.
  p = launch(chain, cache, "checkpoint:4")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert "resuming from round 2" in p.stdout
  assert complete_checkpoints(chain) == [2] and rounds_in(chain) == [1, 2, 3, 4]
  assert [n.name for n in (chain / "checkpoints").iterdir() if not n.name.isdigit()]
  assert ledger_rounds(chain) == 4

  # 3. SIGKILL inside the ledger write of round 5: the old ledger file is intact.
  p = launch(chain, cache, "ledger:5")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert "resuming from round 2" in p.stdout
  assert complete_checkpoints(chain) == [2, 4] and rounds_in(chain) == [1, 2, 3, 4]
  assert ledger_rounds(chain) == 4
  assert list(chain.glob(".privacy_ledger.json.tmp*"))  # the write was cut short

  # 4. SIGTERM in round 5: the round finishes, checkpoint 5 is saved, exit 143.
  p = launch(chain, cache, "round:5:TERM")
  assert p.returncode == 143, p.stderr[-2000:]
  assert "resuming from round 4" in p.stdout
  assert "terminated by SIGTERM after round 5: checkpoint 5 saved" in p.stderr
  assert complete_checkpoints(chain) == [4, 5] and rounds_in(chain) == [1, 2, 3, 4, 5]
  assert ledger_rounds(chain) == 5

  # 5. The last resume finishes the run.
  p = launch(chain, cache)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "resuming from round 5" in p.stdout

  a = checkpointing.read_metrics(straight / "metrics.jsonl")
  b = checkpointing.read_metrics(chain / "metrics.jsonl")
  assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
      [{k: v for k, v in r.items() if k not in TIMING} for r in b]
  assert json.loads((straight / "privacy_ledger.json").read_text()) == \
      json.loads((chain / "privacy_ledger.json").read_text())
  assert ledger_rounds(chain) == 6
  with np.load(straight / "synthetic" / "round_0006.npz") as x, \
       np.load(chain / "synthetic" / "round_0006.npz") as y:
    for k in x.files:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  want, got = state_arrays(straight, 6), state_arrays(chain, 6)
  assert want.keys() == got.keys() and len(want) > 5
  for k in want:  # parameters, synthetic sets, PRNG key, round counter
    np.testing.assert_array_equal(want[k], got[k], err_msg=k)
