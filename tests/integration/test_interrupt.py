"""Ctrl-C keeps the finished rounds, and no early exit leaves a load on a background thread.

A tiny FedLAP-DP run (digits, ConvNet-8x1, 4 rounds, no checkpoint due before its last round)
gets SIGINT, as Ctrl-C sends it, in round 3 (``tests/fault_run.py slow:3:INT``): round 2 is
checkpointed before round 3 is abandoned, so the same command again resumes after round 2
(not from round 0) and ends with every round's record and a ledger of 4 rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from conftest import TINY_FEDLAP_FLAGS
from fault_run import command
from pathlib import Path

import pytest

from experiments import run

from fedlap_runs import checkpointing, export_cache

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {**TINY_FEDLAP_FLAGS, "rounds": 4, "checkpoint_every": 100, "plots": False}


def launch(workdir: Path, cache: Path, fault: str | None = None) -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  argv = [
    *command(fault),
    "--config=quickstart:dp_loops",
    *(f"--config.{k}={v}" for k, v in FLAGS.items()),
    f"--workdir={workdir}",
  ]
  return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def rounds_in(workdir: Path) -> list[int]:
  return [r["round"] for r in checkpointing.read_metrics(workdir / "metrics.jsonl")]


def ledger_rounds(workdir: Path) -> int:
  return json.loads((workdir / "privacy_ledger.json").read_text())["rounds"]


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_last_finished_round_and_the_rerun_redoes_one(tmp_path):
  workdir, cache = tmp_path / "run", tmp_path / "cache"
  first = launch(workdir, cache, "slow:3:INT")
  assert first.returncode == 130, first.stderr[-3000:]
  assert checkpointing.Checkpointer(workdir / "checkpoints").all_rounds() == [2]
  assert rounds_in(workdir) == [1, 2] and ledger_rounds(workdir) == 3  # round 3 charged
  log = (workdir / "train.log").read_text()
  assert "interrupted (Ctrl-C) during round 3" in log and "redo round 3" in log
  second = launch(workdir, cache)
  assert second.returncode == 0, second.stderr[-3000:]
  log = (workdir / "train.log").read_text()
  assert "resuming from round 2" in log
  assert rounds_in(workdir) == [1, 2, 3, 4] and ledger_rounds(workdir) == 4


def test_an_early_exit_waits_for_the_program_load_on_its_thread(tmp_path, monkeypatch, capsys):
  """``--workdir=FILE`` is refused while a prefetch still loads (slowed here): the command
  returns only once the load's thread is done (a thread inside XLA at the interpreter's exit
  aborts the process)."""
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / f"entry{export_cache.SUFFIX}").write_bytes(b"")
  started = threading.Event()

  def slow_load(path, key):
    del path, key
    started.set()
    time.sleep(1.0)
    raise RuntimeError("not a program")

  monkeypatch.setattr(export_cache, "_prefetching", {})
  monkeypatch.setattr(export_cache, "directory", lambda: cache)
  monkeypatch.setattr(export_cache, "_read_hint", lambda cache_dir, hint: "entry")
  monkeypatch.setattr(export_cache, "_load", slow_load)
  afile = tmp_path / "file"
  afile.write_text("")
  assert run.main(["prog", "--config=quickstart:nondp", f"--workdir={afile}"]) == 2
  assert "--workdir" in capsys.readouterr().err
  assert started.is_set()
  alive = [t for t in threading.enumerate() if t.name == "fedlap-prefetch" and t.is_alive()]
  assert alive == []
