"""The client node's processes: Flower's SuperNode and the long-lived ClientApp worker.

:func:`run_warm` (the installed Flower is one this code was tested with,
:mod:`fedlap_flower.runtime.support`):

* runs Flower's ``flower-supernode`` in this process with
  ``--isolation process`` (no executor of its own) and a SuperExec secret
  (``--superexec-auth-secret-file``, 32 random bytes in a private temporary
  directory, removed when the node ends), so that only a holder of the secret
  acquires tasks from its Runtime API;
* starts :mod:`fedlap_flower.runtime.warm_clientapp` with that secret as a
  child process, and starts it again if it ends while the node runs (after a
  ``flwr stop`` whose computation it could not stop);
* checks, every :data:`STOP_CHECK_SECONDS` while a ClientApp task runs, that
  the SuperLink still runs its run; a stopped run (``flwr stop``) has its
  tasks finished ``stopped`` and an error reply stored for its message (Flower
  1.42 itself never tells a SuperNode that a run was stopped, and its SuperNode
  would wait for that reply for ever), so the worker's next heartbeat finds the
  task no longer alive and abandons it: a stopped round ends within about
  :data:`STOP_CHECK_SECONDS` + the worker's heartbeat interval;
* makes the SuperNode ask the SuperLink for messages every ``poll`` seconds
  (Flower 1.42 waits 3 s between two pulls while idle and 0.5 s while a reply
  is pending; a round would wait for the slowest of those waits), wake the
  worker through a pipe as soon as a message and its arrays are stored, and
  retry a message's arrays not yet on the SuperLink after 50 ms (Flower: 1, 2,
  4 s): the module-level names ``time``, ``_pull_and_store_message`` and
  ``pull_objects`` of ``flwr.supernode.start_client_internal``.

:func:`run_stock` (any other Flower, or a name that changed): Flower's own
``flower-supernode`` with its default subprocess isolation, nothing replaced.
It then runs the ClientApp the bundle names, each message in a new process, so
with trusted entities it is given Flower's own ``--trusted-entities`` check,
which refuses every bundle without a Flower Hub signature: a signed
``fedlap_flower`` run is refused there, never run unchecked.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time as _time
from logging import INFO, WARNING
from pathlib import Path
from typing import NoReturn

from flwr.common.logger import log

from fedlap_flower.runtime import object_pulls

SECRET_FLAG = "--superexec-auth-secret-file"
STOP_CHECK_SECONDS = 5.0
STOPPED_REASON = "the run was stopped (flwr stop)"
# A worker that ends sooner than this after its start is started again after a growing pause.
RESTART_PAUSE = (1.0, 30.0)


class _CappedSleep:
  """The ``time`` module with ``sleep`` capped at ``cap`` seconds."""

  def __init__(self, cap: float):
    self.cap = cap

  def sleep(self, seconds: float) -> None:
    _time.sleep(min(seconds, self.cap))

  def __getattr__(self, name):
    return getattr(_time, name)


def _waking(pull_and_store, wake_fd: int):
  """``pull_and_store`` that, once a message and its arrays are stored (a task exists),
  wakes the ClientApp process by writing one byte to ``wake_fd``."""

  def wrapped(*args, **kwargs):
    run_id = pull_and_store(*args, **kwargs)
    if run_id is not None:
      try:
        os.write(wake_fd, b"!")
      except (BlockingIOError, BrokenPipeError):  # already woken, or the worker is gone
        pass
    return run_id

  return wrapped


def stop_stopped_runs(state, get_run) -> list[int]:
  """Finishes ``stopped`` the running ClientApp tasks of runs the SuperLink no longer runs,
  with an error reply for each message they held; returns those runs' ids.

  ``state``: the SuperNode's NodeState; ``get_run``: its Fleet API call, which raises
  ``RunNotRunningException`` for a run that is not running.
  """
  from flwr.app import Error  # pylint: disable=g-import-not-at-top
  from flwr.common.constant import ErrorCode, Status, SubStatus  # pylint: disable=g-import-not-at-top
  from flwr.supercore.constant import TaskType  # pylint: disable=g-import-not-at-top
  from flwr.supercore.run import RunNotRunningException  # pylint: disable=g-import-not-at-top

  tasks = [
    t
    for t in state.get_tasks(statuses=[Status.STARTING, Status.RUNNING])
    if t.type == TaskType.CLIENT_APP
  ]
  stopped = []
  for run_id in sorted({t.run_id for t in tasks}):
    try:
      get_run(run_id)
    except RunNotRunningException:
      stopped.append(run_id)
    except Exception as e:  # pylint: disable=broad-except  (the SuperLink unreachable: later)
      log(INFO, "[fedlap node] run %s: its status is unknown for now (%s)", run_id, e)
  for run_id in stopped:
    log(
      WARNING, "[fedlap node] run %s: %s; its task on this node is stopped", run_id, STOPPED_REASON
    )
    for t in tasks:
      if t.run_id == run_id:
        state.finish_task(t.task_id, SubStatus.STOPPED, STOPPED_REASON)
    state._store_error_replies(  # pylint: disable=protected-access
      {run_id}, Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=STOPPED_REASON)
    )
  return stopped


class RunWatch:
  """Runs :func:`stop_stopped_runs` every ``every`` seconds in a thread, from the first call
  of :meth:`attach` (which hands it the SuperNode's state and ``get_run``)."""

  def __init__(self, every: float = STOP_CHECK_SECONDS):
    self.every = every
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None

  def attach(self, state, get_run) -> None:
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(
          target=self._loop, args=(state, get_run), name="run-watch", daemon=True
        )
        self._thread.start()

  def _loop(self, state, get_run) -> None:
    while True:
      _time.sleep(self.every)
      try:
        stop_stopped_runs(state, get_run)
      except BaseException as e:  # pylint: disable=broad-except  (never end the watch)
        log(WARNING, "[fedlap node] checking for stopped runs failed: %r", e)


def _watching(pull_and_store, watch: RunWatch):
  """``pull_and_store`` that hands its ``state`` and ``get_run`` to ``watch``."""

  def wrapped(*args, **kwargs):
    watch.attach(kwargs["state"], kwargs["get_run"])
    return pull_and_store(*args, **kwargs)

  return wrapped


def patch_supernode(poll: float, wake_fd: int):
  """Replaces the three names of ``flwr.supernode.start_client_internal`` (see the module
  docstring); returns the module. The caller has checked them (``support.problems``)."""
  sci = importlib.import_module("flwr.supernode.start_client_internal")
  sci.time = _CappedSleep(poll)
  pull_and_store = _waking(sci._pull_and_store_message, wake_fd)  # pylint: disable=protected-access
  sci._pull_and_store_message = _watching(pull_and_store, RunWatch())  # pylint: disable=protected-access
  object_pulls.quick_object_pulls(sci)
  return sci


def supervise(command: list[str], pass_fds: tuple[int, ...], stopping: threading.Event) -> None:
  """Runs ``command`` and starts it again whenever it ends, until ``stopping`` is set."""
  pause = RESTART_PAUSE[0]
  while not stopping.is_set():
    started = _time.monotonic()
    # pylint: disable-next=consider-using-with  (it ends with this process: --parent-pid)
    proc = subprocess.Popen(command, pass_fds=pass_fds)
    code = proc.wait()
    if stopping.is_set():
      return
    lived = _time.monotonic() - started
    pause = RESTART_PAUSE[0] if lived > 10 * RESTART_PAUSE[0] else min(2 * pause, RESTART_PAUSE[1])
    log(WARNING, "[fedlap node] the ClientApp worker ended (%s); starting it again", code)
    stopping.wait(pause)


def run_warm(
  flower_args: list[str], worker_args: list[str], *, runtime_api: str, poll: float
) -> int:
  """Flower's SuperNode in this process and the worker beside it (see the module docstring).

  ``flower_args``: flower-supernode's flags (without ``--isolation``); ``worker_args``: the
  worker's flags besides the address, the wake pipe, the parent and the secret.
  """
  from flwr.supernode.cli.flower_supernode import flower_supernode  # pylint: disable=g-import-not-at-top

  private = Path(tempfile.mkdtemp(prefix="fedlap-node-"))  # 0700
  secret = private / "superexec.secret"
  fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(secrets.token_bytes(32))
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  command = [
    sys.executable,
    "-m",
    "fedlap_flower.runtime.warm_clientapp",
    "--runtime-api-address",
    runtime_api,
    "--parent-pid",
    str(os.getpid()),
    "--wake-fd",
    str(wake_r),
    SECRET_FLAG,
    str(secret),
    *worker_args,
  ]
  stopping = threading.Event()
  threading.Thread(
    target=supervise, args=(command, (wake_r,), stopping), name="worker", daemon=True
  ).start()
  patch_supernode(poll, wake_w)
  sys.argv = ["flower-supernode", *flower_args, "--isolation", "process", SECRET_FLAG, str(secret)]
  try:
    flower_supernode()
  finally:
    stopping.set()
    shutil.rmtree(private, ignore_errors=True)
  return 0


def stock_command(flower_args: list[str], trusted_entities: str | None) -> list[str]:
  """``flower-supernode`` (next to this Python, else on ``PATH``) with ``flower_args`` and,
  given trusted entities, Flower's own ``--trusted-entities`` check."""
  here = Path(sys.executable).parent / "flower-supernode"
  exe = str(here) if here.exists() else (shutil.which("flower-supernode") or "flower-supernode")
  trust = ["--trusted-entities", trusted_entities] if trusted_entities else []
  return [exe, *flower_args, *trust]


def run_stock(flower_args: list[str], trusted_entities: str | None, reasons) -> NoReturn:
  """Replaces this process with Flower's own ``flower-supernode`` (see the module docstring),
  after saying why."""
  command = stock_command(flower_args, trusted_entities)
  for reason in reasons:
    log(WARNING, "[fedlap node] %s", reason)
  log(
    WARNING,
    "[fedlap node] running Flower's own flower-supernode (subprocess isolation: a new "
    "ClientApp process per message, Flower's 3 s polling, the bundle's ClientApp)%s",
    (
      ", with Flower's --trusted-entities check: runs signed by fedlap_flower's run "
      "signature are refused until a tested Flower is installed"
      if trusted_entities
      else ""
    ),
  )
  log(INFO, "[fedlap node] %s", " ".join(command))
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(command[0], command)
