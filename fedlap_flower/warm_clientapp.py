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
(``client_app._setup``), the compiled client step (``client_work``'s jitted
functions) and the ledger's last state stay in memory between rounds.

What it runs: only the ``fedlap_flower`` ClientApp installed with this
package (``fedlap_flower.client_app:app``), never code from the bundle the
SuperLink sends, and only runs that

* name that ClientApp in the bundle's ``[tool.flwr.app.components]``, and
* are signed by a key in the client's trusted entities
  (:mod:`fedlap_flower.run_signature`; skipped only with ``allow_unsigned``,
  for tests on one machine).

Any other task is answered with an error reply saying why, and nothing of it
runs. The privacy ledger's rules are the ClientApp's own and unchanged by a
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
import time
from logging import ERROR, INFO, WARNING
from typing import Callable

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
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
  make_confirm_message_received_fn_protobuf,
  make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from fedlap_flower import run_signature

CLIENTAPP_REF = "fedlap_flower.client_app:app"


def check_task(fab_content: bytes, run_config, trusted, allow_unsigned: bool) -> None:
  """Raises :class:`run_signature.UntrustedRun` unless this worker may run the task."""
  try:
    components = get_fab_config(fab_content)["tool"]["flwr"]["app"].get("components", {})
  except (ValueError, KeyError, OSError) as e:
    raise run_signature.UntrustedRun(f"the bundle cannot be read: {e}") from e
  if components.get("clientapp") != CLIENTAPP_REF:
    raise run_signature.UntrustedRun(
      f"the bundle's clientapp is {components.get('clientapp')!r}; this client runs only "
      f"{CLIENTAPP_REF!r} (installed with fedlap_flower)"
    )
  if not allow_unsigned:
    run_signature.verify(trusted, hashlib.sha256(fab_content).hexdigest(), run_config)


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


def _client(
  address: str, insecure: bool, certificates: bytes | None, token: str | None
) -> RuntimeHttpClient:
  interceptors = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
  if token is not None:
    interceptors.append(RuntimeTokenHttpInterceptor(token))
  return RuntimeHttpClient.from_server_address(
    server_address=address,
    insecure=insecure,
    root_certificates=certificates,
    interceptors=interceptors,
    retry_invoker=make_simple_http_retry_invoker(),
  )


def run_task(
  address: str,
  token: str,
  client_app: Callable,
  *,
  insecure: bool,
  certificates: bytes | None,
  trusted,
  allow_unsigned: bool,
) -> str:
  """Runs one acquired task as ``flwr-clientapp`` would; returns its sub-status."""
  client = _client(address, insecure, certificates, token)
  req = SendTaskHeartbeatRequest()

  def beat() -> bool:  # unlike Flower's, never signals this process when the task is over
    try:
      client.SendTaskHeartbeat(req)
      return True
    except httpx.HTTPError:
      return False

  heartbeat = HeartbeatSender(beat)
  t0 = time.time()
  t_app = 0.0
  context = message = reply = None
  status, details = SubStatus.FAILED, "ClientApp task failed"
  try:
    heartbeat.start()
    message, context, _run, fab = pull_task_input(client)
    try:
      check_task(fab.content, context.run_config, trusted, allow_unsigned)
      t_app = time.time()
      reply = client_app(message=message, context=context)
      t_app = time.time() - t_app
      status, details = SubStatus.COMPLETED, ""
    except run_signature.UntrustedRun as e:
      log(ERROR, "[fedlap node] refused run %s: %s", context.run_id, e)
      details = f"refused: {e}"
      reply = Message(
        Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=details), reply_to=message
      )
    except Exception as e:  # pylint: disable=broad-except  (as flwr-clientapp reports it)
      log(ERROR, "ClientApp raised an exception", exc_info=e)
      details = f"{type(e)}:<'{e}'>"
      reply = Message(
        Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message
      )
    if reply is not None and context is not None:
      push_message(client, reply, context)
  finally:
    if heartbeat.is_running:
      heartbeat.stop()
    push_task_output(client=client, context=context, sub_status=status, details=details)
    client.close()
  log(INFO, "[fedlap node] task %s: %.2f s (ClientApp %.2f s)", status, time.time() - t0, t_app)
  return status


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
  *,
  insecure: bool = True,
  certificates: bytes | None = None,
  trusted=None,
  allow_unsigned: bool = False,
  poll: float = 1.0,
  wake_fd: int | None = None,
  client_app: Callable | None = None,
) -> None:
  """Acquires and runs the SuperNode's ClientApp tasks until the process is stopped.

  Asks for a task when woken through ``wake_fd`` (the SuperNode stored a message)
  and every ``poll`` seconds.
  """
  if not allow_unsigned and not trusted:
    raise ValueError(
      "no trusted entities: a client computes only runs signed by a key it "
      "trusts (--trusted-entities FILE); --allow-unsigned-runs only for tests"
    )
  if client_app is None:
    from fedlap_flower.client_app import app as client_app  # pylint: disable=g-import-not-at-top
  acquire = _client(address, insecure, certificates, None)
  wait = _waiter(wake_fd, poll)
  request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
  log(
    INFO,
    "[fedlap node] serving ClientApp tasks of the SuperNode at %s (%s)",
    address,
    "unsigned runs allowed" if allow_unsigned else f"trusted signers {sorted(trusted)}",
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
          address,
          res.token,
          client_app,
          insecure=insecure,
          certificates=certificates,
          trusted=trusted,
          allow_unsigned=allow_unsigned,
        )
      except Exception as e:  # pylint: disable=broad-except  (the task is lost, not the node)
        log(WARNING, "[fedlap node] task %s failed: %s", res.task.task_id, e)
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
  trusted = run_signature.load_trusted(args.trusted_entities) if args.trusted_entities else None
  try:
    serve(
      args.runtime_api_address,
      insecure=certificates is None,
      certificates=certificates,
      trusted=trusted,
      allow_unsigned=args.allow_unsigned_runs,
      poll=args.poll,
      wake_fd=args.wake_fd,
    )
  except KeyboardInterrupt:  # the SuperNode ended (parent monitor) or Ctrl-C
    return 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
