"""A long-lived ClientApp process: one per SuperNode, serving every message of every run.

Flower 1.42 runs a ClientApp as a new ``flwr-clientapp`` process per message
(``flower-superexec`` starts one for each task the SuperNode creates): every
round pays for Python and JAX imports, the client's data, the privacy ledger's
recomputation and reading compiled programs back from the disk cache. With the
SuperNode started as ``flower-supernode --isolation process``, no executor
runs beside it; this process takes that role for one SuperNode: it acquires
each ClientApp task from the SuperNode's Runtime API and runs it *itself*,
speaking the same protocol as ``flwr-clientapp`` (pull the task input, call
the ClientApp, push the reply and the task's outcome), so the data
(``client_app._setup``), the compiled client step (``method_work``'s jitted
functions) and the ledger's last state stay in memory between rounds.

What it runs: only the ``fedlap_flower`` ClientApp installed with this
package (``fedlap_flower.client_app:app``), never code from the bundle the
SuperLink sends, and only runs that

* name that ClientApp in the bundle's ``[tool.flwr.app.components]``, and
* are signed by a key in the client's trusted entities
  (:mod:`fedlap_flower.runtime.run_signature`; skipped only with
  ``allow_unsigned``, for tests on one machine), and, on a run's first task,
  signed at most ``max_run_age`` seconds ago (give or take ``clock_skew``)
  with a ``run-nonce`` this client has not computed under another run
  (:mod:`fedlap_flower.signed_runs`, in the node config's ``state-dir``).

Any other task is answered with an error reply saying why, and nothing of it
runs.

As SuperExec does, it acquires tasks with the SuperNode's SuperExec secret
(``--superexec-auth-secret-file``: HMAC-signed ``AcquireTask`` requests), so
that no other local process can take this node's tasks from its Runtime API.
It honours ``flwr stop``: when the task's heartbeat says the task is no longer
alive, the ClientApp's computation is abandoned, the task reported
``stopped``, and, while that computation still runs in its thread, this
process exits (``fedlap_flower.node`` starts a new one). The privacy ledger's rules are the ClientApp's own and unchanged by a
long-lived process: each train message locks the client's state directory
(``fcntl``), records the round on disk before computing it, and releases the
lock; the ledger is re-read from disk every round (a cached copy is used only
when the file's text is unchanged).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import select
import sys
import threading
import time
import traceback
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import httpx
from flwr.app import Error, Message
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
from flwr.proto.runtime_pb2 import (  # pylint: disable=no-name-in-module
  AcquireTaskRequest,
  PullAppMessagesRequest,
  PullTaskInputRequest,
  SendTaskHeartbeatRequest,
)
from flwr.supercore import log
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
  make_confirm_message_received_fn_protobuf,
  make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import (
  RuntimeTokenHttpInterceptor,
  RuntimeVersionHttpInterceptor,
  SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import RetryInvoker, exponential, make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from fedlap_runs import termination
from fedlap_flower import signed_runs
from fedlap_flower.runtime import run_signature, support

CLIENTAPP_REF = "fedlap_flower.client_app:app"
# The task's heartbeat said it is no longer alive (flwr stop): what the abandoned task reports.
STOPPED_DETAILS = "stopped: the task is no longer alive (the run was stopped)"
# Seconds between two heartbeats of a task (Flower's flwr-clientapp: about 20 s). A stopped
# run's task is abandoned at the first heartbeat after the SuperNode finished it.
HEARTBEAT_SECONDS = 2.0


def printable(text: Any) -> str:
  """``str(text)`` with every character that is not printable (newlines, carriage returns,
  ANSI escapes) escaped as Python writes it (``\\n``, ``\\x1b``): what a run or a message
  makes this worker log stays on its own line and cannot forge another."""
  return "".join(
    c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text)
  )


def _printable_exception(e: BaseException) -> str:
  """``e``'s traceback, its exception's text through :func:`printable`."""
  frames = "".join(traceback.format_tb(e.__traceback__))
  return f"Traceback (most recent call last):\n{frames}{printable(f'{type(e).__name__}: {e}')}"


class Policy(NamedTuple):
  """Which runs this worker computes.

  Attributes:
    trusted: the signers' keys by fingerprint (:func:`run_signature.load_trusted`).
    allow_unsigned: compute unsigned runs (tests on one machine only).
    max_run_age, clock_skew: seconds (:func:`run_signature.check_age`).
  """

  trusted: Mapping[str, Any] | None
  allow_unsigned: bool = False
  max_run_age: float = run_signature.DEFAULT_MAX_RUN_AGE
  clock_skew: float = run_signature.DEFAULT_CLOCK_SKEW


def check_task(
  fab_content: bytes,
  run_config: Mapping[str, Any],
  node_config: Mapping[str, Any],
  run_id: int,
  policy: Policy,
  now: float | None = None,
) -> None:
  """Raises :class:`run_signature.UntrustedRun` unless this worker may run the task.

  For a signed run's first task on this client it also records the run (its nonce, in the
  node config's ``state-dir``) before returning: see the module docstring.
  """
  try:
    components = get_fab_config(fab_content)["tool"]["flwr"]["app"].get("components", {})
  except (ValueError, KeyError, OSError) as e:
    raise run_signature.UntrustedRun("clientapp", f"the bundle cannot be read: {e}") from e
  if components.get("clientapp") != CLIENTAPP_REF:
    raise run_signature.UntrustedRun(
      "clientapp",
      f"the bundle's clientapp is {components.get('clientapp')!r}; this client runs only "
      f"{CLIENTAPP_REF!r} (installed with fedlap_flower)",
    )
  if policy.allow_unsigned:
    return
  signer = run_signature.verify(
    policy.trusted or {}, hashlib.sha256(fab_content).hexdigest(), run_config
  )
  state_dir = node_config.get("state-dir")
  if not isinstance(state_dir, str) or not state_dir:
    raise run_signature.UntrustedRun(
      "state-dir",
      "this node records the signed runs it computes in its state directory, and its node "
      "config has no state-dir; allowed: --node-config \"... state-dir='/var/lib/fedlap/site_k'\"",
    )
  signed_at = int(run_config.get("signed-at", 0))
  now = time.time() if now is None else now
  try:
    signed_runs.admit(
      Path(state_dir),
      str(run_config[run_signature.NONCE_KEY]),
      int(run_id),
      check_new=lambda: run_signature.check_age(
        signed_at, now, policy.max_run_age, policy.clock_skew
      ),
      details={"signed_at": signed_at, "signer": signer},
    )
  except signed_runs.ReplayedRun as e:
    raise run_signature.UntrustedRun(e.field, str(e)) from None


def pull_task_input(client: RuntimeHttpClient, backoff: float = 0.05):
  """``flwr-clientapp``'s ``pull_task_input`` (1.42), retrying objects every ``backoff`` s.

  A task is acquirable as soon as the SuperNode has its message, possibly before the
  SuperNode holds the message's arrays; Flower's pull then waits 1, 2, 4, ... s.
  """
  res = client.PullTaskInput(PullTaskInputRequest())
  TaskIdentity.task_id = res.task_id
  TaskIdentity.run_id = res.run.run_id
  TaskIdentity.node_id = res.context.node_id
  context = context_from_proto(res.context)
  run = run_from_proto(res.run)
  fab = fab_from_proto(res.fab)
  pulled = client.PullMessages(PullAppMessagesRequest())
  if not pulled.messages_list:
    raise RuntimeError("No messages received from Runtime API")
  node = Node(node_id=context.node_id)
  tree = pulled.message_object_trees[0]
  message = pull_and_inflate_object_from_tree(
    tree,
    make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
    make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
    return_type=Message,
    max_tries_per_object=None,
    initial_backoff=backoff,
    backoff_cap=20 * backoff,
  )
  message.metadata.__dict__["_message_id"] = tree.object_id  # as flwr-clientapp sets it
  return message, context, run, fab


# A task's calls are retried on these answers of the Runtime API (and on transport errors);
# any other error answer reaches the caller (401: the task's token is no longer valid).
RETRIED_STATUS = frozenset({502, 503, 504})
# An HTTP answer that means the task is over: its token was revoked (401) or its run is not
# running (403).
TASK_OVER_STATUS = frozenset({401, 403})


def _task_retry_invoker() -> RetryInvoker:
  """Flower's HTTP retries for a task's calls, without Flower's reaction to a revoked token
  (``flwr-clientapp``'s invoker sends SIGINT to its own process, which would end this one)."""

  def give_up(e: Exception) -> bool:
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code not in RETRIED_STATUS

  return RetryInvoker(
    wait_gen_factory=lambda: exponential(max_delay=20),
    recoverable_exceptions=(httpx.TransportError, httpx.HTTPStatusError),
    max_tries=None,
    max_time=120.0,
    should_giveup=give_up,
  )


def _client(
  address: str,
  insecure: bool,
  certificates: bytes | None,
  token: str | None,
  superexec_secret: bytes | None = None,
) -> RuntimeHttpClient:
  interceptors: list = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
  if token is not None:
    interceptors.append(RuntimeTokenHttpInterceptor(token))
  if superexec_secret is not None:  # as flower-superexec signs AcquireTask
    interceptors.append(
      SuperExecAuthHttpInterceptor(
        master_secret=superexec_secret, protected_methods=support.SUPEREXEC_AUTH_METHODS
      )
    )
  return RuntimeHttpClient.from_server_address(
    server_address=address,
    insecure=insecure,
    root_certificates=certificates,
    interceptors=interceptors,
    retry_invoker=make_simple_http_retry_invoker() if token is None else _task_retry_invoker(),
  )


def heartbeat_fn(client, stop: termination.TermSignal) -> Callable[[], bool]:
  """``flwr-clientapp``'s task heartbeat (1.42), except that a task no longer alive (``flwr
  stop``, :func:`fedlap_flower.runtime.supernode.stop_stopped_runs`), or whose token the
  SuperNode revoked (401) or whose run is not running (403), sets ``stop`` (as if a signal
  named ``task-stopped`` arrived) instead of raising SIGINT in this long-lived process.
  Returns False when the call failed."""
  req = SendTaskHeartbeatRequest()

  def over() -> None:
    if stop.received is None:
      stop.received, stop.received_at = "task-stopped", time.monotonic()

  def beat() -> bool:
    try:
      res = client.SendTaskHeartbeat(req)
    except httpx.HTTPStatusError as e:
      if e.response.status_code in TASK_OVER_STATUS:
        over()
      return False
    except httpx.HTTPError:
      return False
    if not res.success:
      over()
    return True

  return beat


class Heartbeat:
  """Calls ``beat()`` now and every ``every`` seconds in a thread until :meth:`stop`."""

  def __init__(self, beat: Callable[[], bool], every: float = HEARTBEAT_SECONDS):
    self._beat, self._every = beat, every
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self._beat()
      except Exception as e:  # pylint: disable=broad-except  (the next beat may succeed)
        log(WARNING, "[fedlap node] task heartbeat failed: %r", e)
      self._stop.wait(self._every)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()


def run_task(
  address: str,
  token: str,
  client_app: Callable,
  policy: Policy,
  *,
  insecure: bool,
  certificates: bytes | None,
) -> str:
  """Runs one acquired task as ``flwr-clientapp`` would; returns its sub-status.

  The ClientApp computes in a worker thread (:func:`fedlap_runs.termination.wait_for`) while
  this thread watches the heartbeat: a stopped task is abandoned at once (its thread computes
  on; :func:`serve` then ends this process).
  """
  client = _client(address, insecure, certificates, token)
  stop = termination.TermSignal()  # never installed as a handler: set by the heartbeat
  heartbeat = Heartbeat(heartbeat_fn(client, stop))
  t0 = time.time()
  t_app = 0.0
  context = message = reply = None
  status, details = SubStatus.FAILED, "ClientApp task failed"
  try:
    heartbeat.start()
    message, context, _run, fab = pull_task_input(client)
    try:
      check_task(fab.content, context.run_config, context.node_config, context.run_id, policy)
      app_started = time.time()
      try:
        reply = termination.wait_for(
          lambda: client_app(message=message, context=context), stop, grace_seconds=0.0
        )
      finally:
        t_app = time.time() - app_started
      status, details = SubStatus.COMPLETED, ""
    except termination.Abandoned:
      log(WARNING, "[fedlap node] run %s: %s", context.run_id, STOPPED_DETAILS)
      status, details, reply = SubStatus.STOPPED, STOPPED_DETAILS, None
    except run_signature.UntrustedRun as e:
      log(ERROR, "[fedlap node] refused run %s: %s", context.run_id, printable(e))
      details = f"refused: {e}"
      reply = Message(
        Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=details), reply_to=message
      )
    except Exception as e:  # pylint: disable=broad-except  (as flwr-clientapp reports it)
      log(ERROR, "ClientApp raised an exception\n%s", _printable_exception(e))
      details = f"{type(e)}:<'{e}'>"
      reply = Message(
        Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message
      )
    if reply is not None and context is not None:
      push_message(client, reply, context)
  finally:
    heartbeat.stop()
    push_task_output(client=client, context=context, sub_status=status, details=details)
    client.close()
  log(INFO, "[fedlap node] task %s: %.2f s (ClientApp %.2f s)", status, time.time() - t0, t_app)
  return status


# The worker's exit status after a stopped task whose computation it could not stop.
EXIT_ABANDONED = 75


def _waiter(wake_fd: int | None, poll: float) -> Callable[[], None]:
  """Returns ``wait()``: until a byte arrives on ``wake_fd`` or ``poll`` seconds passed."""
  if wake_fd is None:
    return lambda: time.sleep(poll)

  def wait() -> None:
    ready, _, _ = select.select([wake_fd], [], [], poll)
    if ready and not os.read(wake_fd, 4096):
      raise KeyboardInterrupt  # the SuperNode closed the pipe: it has ended

  return wait


def serve(
  address: str,
  policy: Policy,
  *,
  insecure: bool = True,
  certificates: bytes | None = None,
  superexec_secret: bytes | None = None,
  poll: float = 1.0,
  wake_fd: int | None = None,
  client_app: Callable | None = None,
) -> int:
  """Acquires and runs the SuperNode's ClientApp tasks until the process is stopped.

  Asks for a task when woken through ``wake_fd`` (the SuperNode stored a message)
  and every ``poll`` seconds. Returns :data:`EXIT_ABANDONED` after a stopped task whose
  computation still runs (the caller ends the process).
  """
  if not policy.allow_unsigned and not policy.trusted:
    raise ValueError(
      "no trusted entities: a client computes only runs signed by a key it "
      "trusts (--trusted-entities FILE); --allow-unsigned-runs only for tests"
    )
  if client_app is None:
    from fedlap_flower.client_app import app as client_app  # pylint: disable=g-import-not-at-top
  acquire = _client(address, insecure, certificates, None, superexec_secret)
  wait = _waiter(wake_fd, poll)
  request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
  log(
    INFO,
    "[fedlap node] serving ClientApp tasks of the SuperNode at %s (%s)",
    address,
    "unsigned runs allowed"
    if policy.allow_unsigned
    else f"trusted signers {sorted(policy.trusted)}",
  )
  while True:
    try:
      res = acquire.AcquireTask(request)
    except httpx.TransportError:  # the SuperNode is starting or restarting
      time.sleep(0.5)
      continue
    if res.HasField("task") and res.token:
      try:
        run_task(
          address, res.token, client_app, policy, insecure=insecure, certificates=certificates
        )
      except Exception as e:  # pylint: disable=broad-except  (the task is lost, not the node)
        log(WARNING, "[fedlap node] task %s failed: %s", res.task.task_id, printable(e))
      if termination.computing():  # a stopped task's computation goes on in its thread
        log(WARNING, "[fedlap node] ending this process to stop the abandoned computation")
        return EXIT_ABANDONED
    else:
      wait()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--runtime-api-address", required=True)
  p.add_argument(
    "--root-certificates",
    default=None,
    help="CA of the SuperNode's Runtime API TLS certificate (default: plain HTTP on loopback)",
  )
  p.add_argument("--trusted-entities", default=None)
  p.add_argument("--allow-unsigned-runs", action="store_true")
  p.add_argument("--max-run-age", type=float, default=run_signature.DEFAULT_MAX_RUN_AGE)
  p.add_argument("--clock-skew", type=float, default=run_signature.DEFAULT_CLOCK_SKEW)
  p.add_argument(
    "--superexec-auth-secret-file",
    default=None,
    help="the SuperNode's SuperExec secret: AcquireTask requests are signed with it",
  )
  p.add_argument(
    "--poll", type=float, default=1.0, help="seconds between two asks for a task when not woken"
  )
  p.add_argument(
    "--wake-fd",
    type=int,
    default=None,
    help="a pipe the SuperNode writes to when it stored a message",
  )
  p.add_argument("--parent-pid", type=int, default=None)
  args = p.parse_args(argv)
  if args.parent_pid is not None:
    start_parent_process_monitor(args.parent_pid)
  certificates = None
  if args.root_certificates:
    with open(args.root_certificates, "rb") as f:
      certificates = f.read()
  secret = None
  if args.superexec_auth_secret_file:
    secret = Path(args.superexec_auth_secret_file).read_bytes()
  trusted = run_signature.load_trusted(args.trusted_entities) if args.trusted_entities else None
  policy = Policy(trusted, args.allow_unsigned_runs, args.max_run_age, args.clock_skew)
  try:
    status = serve(
      args.runtime_api_address,
      policy,
      insecure=certificates is None,
      certificates=certificates,
      superexec_secret=secret,
      poll=args.poll,
      wake_fd=args.wake_fd,
    )
  except KeyboardInterrupt:  # the SuperNode ended (parent monitor) or Ctrl-C
    return 0
  termination.exit_process(status)
  return status


if __name__ == "__main__":
  sys.exit(main())
