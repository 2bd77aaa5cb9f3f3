"""Prompt termination of a process whose main thread waits on long jitted computations.

Python runs a signal handler only in the main thread, between two bytecodes: a main thread
blocked in one long XLA computation (a one-shot method's round is the whole run) handles
SIGTERM or Ctrl-C only when the computation returns, minutes or hours later, while a
scheduler kills it about 30 s after SIGTERM. So the computation runs in a daemon worker
thread and the main thread waits on it in short, interruptible steps:

* :class:`TermSignal` turns SIGTERM into a flag with its arrival time (a second SIGTERM
  kills the process as usual);
* :func:`wait_for` runs a function in a worker thread; it returns the result, re-raises the
  worker's exception, raises :class:`Abandoned` when SIGTERM arrived and the function did not
  finish within ``grace_seconds`` of it, and lets ``KeyboardInterrupt`` (or a handler's
  ``SystemExit``) through at once;
* :func:`call_interruptibly`: the same without a grace period, for processes whose own
  handlers end them (Flower's ClientApp and ServerApp processes), which it then ends at once;
* :func:`exit_process`: the process's exit with a status; with an abandoned worker still
  computing, ``os._exit`` after flushing stdout and stderr (the interpreter's own shutdown
  waits for the computation, or aborts the process when the worker, inside XLA, meets it).

A thread cannot be stopped from outside: an abandoned worker computes on until the process
exits, and whatever it would return is dropped. Callers write their files (atomically)
before they exit, never from the worker.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

WORKER_NAME = "computation"
ABANDONED_NAME = "computation (abandoned)"
POLL_SECONDS = 0.1


class Abandoned(RuntimeError):
  """The computation did not finish within the grace period after SIGTERM."""


class TermSignal:
  """``with stop:`` turns SIGTERM into ``stop.received`` (the signal's name) and
  ``stop.received_at`` (``time.monotonic()`` at its arrival) instead of killing the
  process; a second SIGTERM kills it as usual.

  Installed only in the main thread (Python delivers signals there); elsewhere a no-op.
  """

  def __init__(self):
    self.received = None
    self.received_at = None
    self._previous = None

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    self.received_at = time.monotonic()
    signal.signal(signum, signal.SIG_DFL)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


class _Worker:
  """``fn()`` in a daemon thread; ``done`` is set when it returned or raised."""

  def __init__(self, fn: Callable[[], Any]):
    self.done = threading.Event()
    self.result = None
    self.error = None
    self.thread = threading.Thread(target=self._run, args=(fn,), name=WORKER_NAME, daemon=True)
    self.thread.start()

  def _run(self, fn):
    try:
      self.result = fn()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    finally:
      self.done.set()

  def outcome(self):
    if self.error is not None:
      raise self.error
    return self.result


def wait_for(
  fn: Callable[[], Any], stop: TermSignal | None = None, *, grace_seconds: float = math.inf
) -> Any:
  """``fn()``, computed in a worker thread while this thread waits interruptibly.

  Args:
    fn: the computation (no arguments; it must not write the caller's files).
    stop: the caller's active :class:`TermSignal`, or ``None`` (no grace period).
    grace_seconds: how long after SIGTERM (``stop.received_at``) the computation may go on.

  Returns:
    What ``fn`` returned (its exception is re-raised here).

  Raises:
    Abandoned: SIGTERM arrived and ``fn`` had not finished ``grace_seconds`` after it (the
      worker goes on computing; see :func:`exit_process`).
    KeyboardInterrupt: Ctrl-C while waiting (the worker goes on likewise).
  """
  if threading.current_thread() is not threading.main_thread():
    return fn()  # signals reach only the main thread: nothing to wait for interruptibly
  worker = _Worker(fn)
  try:
    while not worker.done.wait(POLL_SECONDS):
      if (
        stop is not None
        and stop.received_at is not None
        and time.monotonic() - stop.received_at >= grace_seconds
      ):
        raise Abandoned(
          f"the computation did not finish within {grace_seconds:g} s of {stop.received}"
        )
  except BaseException:  # Abandoned, Ctrl-C, a handler's SystemExit: the worker computes on
    worker.thread.name = ABANDONED_NAME
    raise
  return worker.outcome()


def call_interruptibly(fn: Callable[..., Any], *args, **kwargs) -> Any:
  """``fn(*args, **kwargs)`` in a worker thread, so the main thread's signal handlers (e.g.
  Flower's, which end the process on SIGTERM) run at once instead of after the computation.
  Off the main thread (a simulation worker) a plain call.

  A handler's ``SystemExit`` while the worker still computes ends the process here with its
  code (:func:`exit_process`): the interpreter's shutdown would meet the worker inside XLA and
  abort the process (SIGABRT) instead of exiting.
  """
  try:
    return wait_for(lambda: fn(*args, **kwargs))
  except SystemExit as e:
    if computing():
      exit_process(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
    raise


def computing() -> bool:
  """Whether an abandoned worker thread is still computing."""
  return any(t.name == ABANDONED_NAME and t.is_alive() for t in threading.enumerate())


def exit_process(status: int) -> None:
  """Exits with ``status``: ``sys.exit``, or ``os._exit`` after flushing stdout and stderr when
  an abandoned worker still computes (the interpreter's shutdown could wait for it)."""
  if computing():
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)
