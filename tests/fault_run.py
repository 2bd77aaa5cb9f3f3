"""Runs ``experiments.run`` with a fault injected at a chosen point of a chosen round.

  python tests/fault_run.py POINT:ROUND[:SIGNAL] --config=NAME [--config.FIELD=VALUE ...]

is ``python -m experiments.run --config=NAME ...`` (from the repository root) that sends
itself ``SIGNAL`` (``KILL``, the default, ``TERM`` or ``INT``, Ctrl-C's) when it reaches
``POINT`` of round ``ROUND``, so a test can interrupt a real run at a chosen place instead of
racing a timer (``tests/integration/test_kill_resume.py``). Each point is a wrapper on a
function the run calls there; the shipped code knows nothing of it. Points:

* ``round``: the round has been computed and evaluated; nothing of it is written yet (not in
  the ledger, the metrics or a checkpoint): before the trainer's ``_charge``.
* ``ledger``: inside the atomic write of ``privacy_ledger.json``: the new ledger is in a
  temporary file that has not replaced the old one yet (``os.replace`` in the round's
  ``_charge``).
* ``checkpoint``: inside the orbax save of the round's checkpoint: the state is written to
  orbax's temporary directory, the metadata is being written, the checkpoint is not complete
  yet (``JsonCheckpointHandler.async_save`` in the round's ``Checkpointer.save``).
* ``slow``: the round has been computed (in its worker thread, at the end of the trainer's
  ``_compute``) and is made to last :data:`SLOW_SECONDS` longer, as a round longer than the
  SIGTERM grace period does; ``fault: round ROUND is slow`` goes to stderr when the delay
  starts. No signal is sent unless ``SIGNAL`` is given.

With ``SIGKILL`` the process dies on the spot (no handler, no clean-up); with ``SIGTERM``
the driver's handler lets the round finish (within the grace period,
``termination_grace_seconds``; a longer round is abandoned), saves a checkpoint and exits
with status 143. A test in process uses :func:`install` with an action of its own (e.g.
raising an exception) and ``monkeypatch.setattr``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POINTS = ("round", "ledger", "checkpoint", "slow")
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
# How much longer a round with the slow fault lasts: beyond any test's patience.
SLOW_SECONDS = 3600.0
LEDGER_FILE = "privacy_ledger.json"


def command(fault: str | None = None) -> list[str]:
  """The start of a command line: this launcher with ``fault``, or without a fault
  ``python -m experiments.run`` (both to be run from the repository root)."""
  if fault is None:
    return [sys.executable, "-m", "experiments.run"]
  parse(fault)  # a bad fault is refused here, not in the child process
  return [sys.executable, str(Path(__file__).resolve()), fault]


def parse(value: str):
  """``(point, round, signal or None)`` of ``POINT:ROUND[:SIGNAL]``."""
  parts = value.split(":")
  if (
    len(parts) not in (2, 3)
    or parts[0] not in POINTS
    or not parts[1].isdigit()
    or (len(parts) == 3 and parts[2] not in SIGNALS)
  ):
    raise ValueError(
      f"fault={value!r} is invalid; allowed: POINT:ROUND[:SIGNAL] with POINT "
      f"one of {POINTS} and SIGNAL one of {tuple(SIGNALS)}"
    )
  if len(parts) == 3:
    return parts[0], int(parts[1]), SIGNALS[parts[2]]
  return parts[0], int(parts[1]), None if parts[0] == "slow" else signal.SIGKILL


def install(point: str, at: int, action, patch=setattr) -> None:
  """Makes ``action()`` run at ``point`` of round ``at`` of every later run in this process;
  ``patch(owner, name, value)`` installs the wrapper (``monkeypatch.setattr`` to undo it)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from experiments import train  # pylint: disable=g-import-not-at-top
  from fedlap_runs import checkpointing  # pylint: disable=g-import-not-at-top

  loop = train._RoundLoop  # pylint: disable=protected-access

  def swapped(owner, name, make, call):
    """``call()`` with ``owner.name`` replaced by ``make(original)`` meanwhile."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
      return call()
    finally:
      setattr(owner, name, original)

  if point == "round":
    charge = loop._charge  # pylint: disable=protected-access

    def charge_round(self, m, idx):
      if m == at:
        action()
      return charge(self, m, idx)

    patch(loop, "_charge", charge_round)
  elif point == "ledger":
    charge = loop._charge  # pylint: disable=protected-access

    def replace_firing(replace):
      def fire(src, dst, *args, **kwargs):
        if Path(dst).name == LEDGER_FILE:
          action()
        return replace(src, dst, *args, **kwargs)

      return fire

    def charge_ledger(self, m, idx):
      if m != at:
        return charge(self, m, idx)
      return swapped(os, "replace", replace_firing, lambda: charge(self, m, idx))

    patch(loop, "_charge", charge_ledger)
  elif point == "checkpoint":
    save = checkpointing.Checkpointer.save
    handler = ocp.handlers.JsonCheckpointHandler

    def firing(async_save):
      def fire(*args, **kwargs):
        action()
        return async_save(*args, **kwargs)

      return fire

    def save_checkpoint(self, round_index, state, meta):
      if round_index != at:
        return save(self, round_index, state, meta)
      return swapped(handler, "async_save", firing, lambda: save(self, round_index, state, meta))

    patch(checkpointing.Checkpointer, "save", save_checkpoint)
  elif point == "slow":
    compute = loop._compute  # pylint: disable=protected-access

    def compute_slowly(self, m, idx, state):
      out = compute(self, m, idx, state)
      if m == at:
        print(f"fault: round {m} is slow", file=sys.stderr, flush=True)
        action()
        time.sleep(SLOW_SECONDS)
      return out

    patch(loop, "_compute", compute_slowly)
  else:
    raise ValueError(f"point={point!r} is invalid; allowed: one of {POINTS}")


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    sys.exit(f"usage: {argv[0]} POINT:ROUND[:SIGNAL] [experiments.run arguments ...]")
  point, at, signum = parse(argv[1])
  sys.path[0] = str(ROOT)  # as ``python -m`` from the repository root (not tests/)

  def send():
    if signum is not None:
      os.kill(os.getpid(), signum)

  # Ctrl-C at a terminal meets Python's own SIGINT handler; a process started in the
  # background by a shell without job control inherits SIGINT ignored, and Python then
  # installs none.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  install(point, at, send)
  sys.argv = [argv[0], *argv[2:]]
  runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv)
