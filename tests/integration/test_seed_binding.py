"""A DP work dir binds its drawn seed to the run that drew it.

A tiny FedLAP-DP run (digits, ConvNet-8x1) without ``--config.seed`` stops in round 2 before
its first checkpoint (as a kill or a NaN does); a second run on the work dir with another
noise multiplier, or under other ``XLA_FLAGS``, would read the seed back and draw the same
noise for another computation: it is refused with exit status 2, naming the fields, and no
releasable file (``train.log``, ``metrics.jsonl``, the synthetic sets, the ledger) changes.
The same command again resumes.
"""

from __future__ import annotations

import os

import pytest

from conftest import TINY_FEDLAP_FLAGS
from experiments import resume, run, train
from fault_run import install

from fedlap_runs import seeds

FLAGS = {
  **TINY_FEDLAP_FLAGS,
  "rounds": 3,
  "snapshot_rounds": "(1,)",
  "checkpoint_every": 100,  # no checkpoint before the stop
  "plots": False,
}
RELEASABLE = ("train.log", "metrics.jsonl", "privacy_ledger.json", "synthetic/round_0001.npz")


class Killed(Exception):
  """Stands for SIGKILL at the fault point (the test's own process must live on)."""


def argv(workdir, **changed):
  flags = {**FLAGS, **changed}
  return [
    "prog",
    "--config=quickstart:dp_loops",
    *(f"--config.{k}={v}" for k, v in flags.items()),
    f"--workdir={workdir}",
  ]


def contents(workdir):
  return {name: (workdir / name).read_bytes() for name in RELEASABLE}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
  """Round 1 written and charged, the run stopped in round 2 with no checkpoint."""
  workdir = tmp_path_factory.mktemp("stopped")
  mp = pytest.MonkeyPatch()

  def kill():
    raise Killed()

  install("round", 2, kill, mp.setattr)
  with pytest.raises(Killed):
    run.main(argv(workdir))
  mp.undo()
  assert not seeds.holds_checkpoints(workdir)
  stored, origin = seeds.stored_seed(workdir)
  assert origin == seeds.DRAWN and stored >= seeds.DRAWN_MIN
  return workdir


def test_a_changed_run_is_refused_before_it_writes(stopped, capsys):
  before = contents(stopped)
  assert b'"rounds": 1' in before["privacy_ledger.json"]
  assert run.main(argv(stopped, **{"dp.noise_multiplier": 4.0, "learning_rate": 0.1})) == 2
  err = capsys.readouterr().err
  assert "dp.noise_multiplier" in err and "learning_rate" in err
  assert str(seeds.stored_seed(stopped)[0]) not in err  # the seed stays secret
  assert contents(stopped) == before
  cfg = run.flags.parse_argv(argv(stopped, **{"dp.noise_multiplier": 4.0}))[0].config
  with pytest.raises(resume.SeedBindingError) as e:
    train.train_and_evaluate(cfg, stopped)
  assert e.value.fields == ["dp.noise_multiplier"]
  assert contents(stopped) == before


def test_other_xla_flags_are_refused(stopped, monkeypatch, capsys):
  before = contents(stopped)
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false"
  monkeypatch.setenv("XLA_FLAGS", flags.strip())
  assert run.main(argv(stopped)) == 2
  assert "xla_flags" in capsys.readouterr().err
  assert contents(stopped) == before


def test_the_same_command_resumes_the_run(stopped):
  assert run.main(argv(stopped)) == 0
  ledger = (stopped / "privacy_ledger.json").read_text()
  assert '"rounds": 3' in ledger
