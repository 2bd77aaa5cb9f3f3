"""Deterministic fault injection for the kill tests; inert unless ``FEDLAP_JAX_FAULT`` is set.

``FEDLAP_JAX_FAULT=POINT:ROUND[:SIGNAL]`` makes an ``experiments.run`` process
send itself ``SIGNAL`` (``KILL``, the default, ``TERM`` or ``INT``, Ctrl-C's) when it
reaches ``POINT`` of round ``ROUND``, so a test can interrupt a real run at a chosen
place instead of racing a timer (``tests/integration/test_kill_resume.py``). Points:

* ``slow``: the round has been computed (in its worker thread) and is made to
  last :data:`SLOW_SECONDS` longer, as a round longer than the SIGTERM grace
  period does; ``fault: round ROUND is slow`` goes to stderr when the delay
  starts. No signal is sent unless ``SIGNAL`` is given.

* ``round``: the round has been computed and evaluated; nothing of it is
  written yet (not in the ledger, the metrics or a checkpoint).
* ``ledger``: inside the atomic write of ``privacy_ledger.json``: the new
  ledger is in a temporary file that has not replaced the old one yet.
* ``checkpoint``: inside the orbax save of the round's checkpoint: the state is
  written to orbax's temporary directory, the metadata is being written, the
  checkpoint is not complete yet.

With ``SIGKILL`` the process dies on the spot (no handler, no clean-up); with
``SIGTERM`` the driver's handler lets the round finish (within the grace period,
``termination_grace_seconds``; a longer round is abandoned), saves a checkpoint
and exits with status 143.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time

ENV = "FEDLAP_JAX_FAULT"
POINTS = ("round", "ledger", "checkpoint", "slow")
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
# How much longer a round with the slow fault lasts: beyond any test's patience.
SLOW_SECONDS = 3600.0


@functools.lru_cache(maxsize=None)
def _parse(value: str):
  parts = value.split(":")
  if (
    len(parts) not in (2, 3)
    or parts[0] not in POINTS
    or not parts[1].isdigit()
    or (len(parts) == 3 and parts[2] not in SIGNALS)
  ):
    raise ValueError(
      f"{ENV}={value!r} is invalid; allowed: POINT:ROUND[:SIGNAL] with POINT "
      f"one of {POINTS} and SIGNAL one of {tuple(SIGNALS)}"
    )
  if len(parts) == 3:
    return parts[0], int(parts[1]), SIGNALS[parts[2]]
  return parts[0], int(parts[1]), None if parts[0] == "slow" else signal.SIGKILL


def due(name: str, round_index: int) -> bool:
  """Whether ``FEDLAP_JAX_FAULT`` names point ``name`` of round ``round_index``."""
  value = os.environ.get(ENV)
  if not value:
    return False
  point, at, _ = _parse(value)
  return point == name and at == int(round_index)


def point(name: str, round_index: int) -> None:
  """Signals this process if the fault is due here (``SIGKILL`` does not return)."""
  if due(name, round_index):
    signum = _parse(os.environ[ENV])[2]
    if signum is not None:
      os.kill(os.getpid(), signum)


def slow(round_index: int) -> None:
  """The ``slow`` point: announces itself on stderr, signals (if asked) and sleeps
  :data:`SLOW_SECONDS` when due; called in the round's worker thread."""
  if due("slow", round_index):
    print(f"fault: round {round_index} is slow", file=sys.stderr, flush=True)
    point("slow", round_index)
    time.sleep(SLOW_SECONDS)


@contextlib.contextmanager
def inside(name: str, round_index: int, owner, method: str):
  """While active, a call of ``owner.method`` fires point ``name`` first (when due)."""
  if not due(name, round_index):
    yield
    return
  original = getattr(owner, method)

  def fire(*args, **kwargs):
    point(name, round_index)
    return original(*args, **kwargs)

  setattr(owner, method, fire)
  try:
    yield
  finally:
    setattr(owner, method, original)
