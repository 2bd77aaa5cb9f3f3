"""Whether this Flower install is one the runtime code was tested with, name by name.

The modules of :mod:`fedlap_flower.runtime` use, re-create or replace parts of
Flower that are not its public API. Each part is a :data:`PARTS` entry whose
check looks at what is installed: the Flower version (one of
:data:`TESTED_FLOWER_VERSIONS`), then each name the part uses, by identity
(the object a module-level name must be), signature (the parameters passed)
and, where the part replaces a name *inside* Flower's code, the source lines
that must call it (a refactor such as ``from time import sleep`` makes a
replaced ``time`` module a no-op). :func:`problems` lists what does not hold;
the caller then runs Flower's own code for that part and says so
(:func:`fedlap_flower.runtime.supernode.main`,
:func:`fedlap_flower.runtime.object_pulls.quick_object_pulls`).

Parts:

* ``supernode``: the SuperNode's polling delays and its wake-up of the worker
  (``flwr.supernode.start_client_internal``'s ``time``,
  ``_pull_and_store_message`` and ``pull_objects``);
* ``worker``: the long-lived ClientApp process
  (:mod:`fedlap_flower.runtime.warm_clientapp`), which speaks the Runtime API
  protocol of ``flwr-clientapp`` and authenticates as SuperExec does;
* ``grid``: the ServerApp Grid's object pulls (``pull_objects`` inside the Grid's
  module, and the ``httpx.Client`` its Runtime API client sends through);
* ``serverapp``: the server's ServerApp runner (:mod:`fedlap_flower.runtime.serverapp`),
  which has no Flower path to fall back to: :func:`require` refuses it, saying what to do
  instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from importlib import metadata
from typing import Callable

TESTED_FLOWER_VERSIONS = ("1.42.0",)
# What a user of another Flower installs to run what needs the checked internals.
TESTED_INSTALL = "pip install 'flwr[simulation]==1.42.0'"
# flwr-clientapp's pull_task_input (1.42.0), which warm_clientapp re-creates: its source's sha256.
PULL_TASK_INPUT_SHA256 = "5607a23e1673ee876930c1b35685b8dfdfd8b3776a436560b0467042e15fc695"
# The Runtime API method SuperExec signs (flwr.supercore.superexec.run_superexec, 1.42.0).
SUPEREXEC_AUTH_METHODS = frozenset({"/flwr.proto.Runtime/AcquireTask"})
PULL_BACKOFF_PARAMS = ("max_time", "max_tries_per_object", "initial_backoff", "backoff_cap")


def flower_version() -> str:
  """The installed ``flwr`` distribution's version ("" when none is installed)."""
  for name in ("flwr", "flwr-nightly"):
    try:
      return metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
  return ""


def _params(fn) -> tuple[str, ...]:
  return tuple(inspect.signature(fn).parameters)


def _source(fn) -> str:
  try:
    return inspect.getsource(fn)
  except (OSError, TypeError):
    return ""


class _Checks:
  """Collects the problems of one part; each check names the Flower object it looked at."""

  def __init__(self):
    self.found: list[str] = []

  def module(self, name: str):
    try:
      return importlib.import_module(name)
    except ImportError as e:
      self.found.append(f"{name} cannot be imported ({e})")
      return None

  def attr(self, module, name: str):
    if module is None:
      return None
    value = getattr(module, name, None)
    if value is None:
      self.found.append(f"{module.__name__}.{name} is missing")
    return value

  def params(self, fn, where: str, expected: tuple[str, ...], *, exact: bool = False) -> None:
    if fn is None:
      return
    try:
      got = _params(fn)
    except (TypeError, ValueError):
      self.found.append(f"{where} has no readable signature")
      return
    if (got != expected) if exact else not set(expected) <= set(got):
      self.found.append(f"{where} takes {got}; expected {'' if exact else 'at least '}{expected}")

  def calls(self, fn, where: str, call: str) -> None:
    if fn is not None and f"{call}(" not in _source(fn):
      self.found.append(f"{where} no longer calls {call}(...) (its source changed)")

  def same(self, value, expected, where: str, what: str) -> None:
    if value is not None and expected is not None and value is not expected:
      self.found.append(f"{where} is not {what}")


def _supernode(c: _Checks) -> None:
  import time  # pylint: disable=g-import-not-at-top

  sci = c.module("flwr.supernode.start_client_internal")
  utils = c.module("flwr.supercore.inflatable.inflatable_utils")
  c.same(c.attr(sci, "time"), time, "start_client_internal.time", "the time module")
  loop = c.attr(sci, "start_client_internal")
  c.calls(loop, "start_client_internal.start_client_internal", "time.sleep")
  c.calls(loop, "start_client_internal.start_client_internal", "_pull_and_store_message")
  for passed in ("state=state", "get_run=get_run"):  # the run watch takes them from there
    if loop is not None and passed not in _source(loop):
      c.found.append(f"start_client_internal no longer passes {passed} (its source changed)")
  c.calls(c.attr(sci, "_push_messages"), "start_client_internal._push_messages", "time.sleep")
  pull_store = c.attr(sci, "_pull_and_store_message")
  c.params(
    pull_store,
    "start_client_internal._pull_and_store_message",
    (
      "state",
      "object_store",
      "node_config",
      "receive",
      "get_run",
      "get_fab",
      "pull_object",
      "confirm_message_received",
      "trusted_entities",
    ),
    exact=True,
  )
  c.calls(pull_store, "start_client_internal._pull_and_store_message", "pull_objects")
  pulls = c.attr(sci, "pull_objects")
  c.same(
    pulls,
    c.attr(utils, "pull_objects"),
    "start_client_internal.pull_objects",
    "inflatable_utils.pull_objects",
  )
  c.params(pulls, "start_client_internal.pull_objects", PULL_BACKOFF_PARAMS)
  nodestate = c.module("flwr.supernode.nodestate.in_memory_nodestate")
  state_cls = c.attr(nodestate, "InMemoryNodeState")
  for name, params in (
    ("get_tasks", ("statuses",)),
    ("finish_task", ("self", "task_id", "sub_status", "details")),
    ("_store_error_replies", ("self", "run_ids", "error")),
  ):
    c.params(
      c.attr(state_cls, name), f"InMemoryNodeState.{name}", params, exact=name != "get_tasks"
    )
  c.attr(c.module("flwr.supercore.run"), "RunNotRunningException")
  cli = c.module("flwr.supernode.cli.flower_supernode")
  c.params(c.attr(cli, "flower_supernode"), "flower_supernode.flower_supernode", (), exact=True)
  c.attr(c.module("flwr.supercore.auth"), "add_superexec_auth_secret_args")


def _worker(c: _Checks) -> None:
  pb = c.module("flwr.proto.runtime_pb2")
  for name, fields in (
    ("AcquireTaskRequest", ("supported_task_types",)),
    ("AcquireTaskResponse", ("task", "token")),
    ("PullTaskInputRequest", ()),
    ("PullAppMessagesRequest", ()),
    ("SendTaskHeartbeatRequest", ()),
    ("SendTaskHeartbeatResponse", ("success",)),
  ):
    cls = c.attr(pb, name)
    if cls is not None:
      missing = [f for f in fields if f not in cls.DESCRIPTOR.fields_by_name]
      if missing:
        c.found.append(f"runtime_pb2.{name} lacks fields {missing}")
  rc = c.module("flwr.supernode.runtime.run_clientapp")
  pull = c.attr(rc, "pull_task_input")
  if pull is not None:
    digest = hashlib.sha256(_source(pull).encode()).hexdigest()
    if digest != PULL_TASK_INPUT_SHA256:
      c.found.append("run_clientapp.pull_task_input changed (warm_clientapp re-creates it)")
  c.params(
    c.attr(rc, "push_message"),
    "run_clientapp.push_message",
    ("client", "message", "context"),
    exact=True,
  )
  c.params(
    c.attr(rc, "push_task_output"),
    "run_clientapp.push_task_output",
    ("client", "context", "sub_status", "details"),
    exact=True,
  )
  utils = c.module("flwr.supercore.inflatable.inflatable_utils")
  c.params(
    c.attr(utils, "pull_and_inflate_object_from_tree"),
    "inflatable_utils.pull_and_inflate_object_from_tree",
    ("return_type", *PULL_BACKOFF_PARAMS),
  )
  inter = c.module("flwr.supercore.interceptors")
  c.params(
    c.attr(inter, "SuperExecAuthHttpInterceptor"),
    "SuperExecAuthHttpInterceptor",
    ("master_secret", "protected_methods"),
    exact=True,
  )
  c.attr(inter, "RuntimeTokenHttpInterceptor")
  c.attr(inter, "RuntimeVersionHttpInterceptor")
  rs = c.module("flwr.supercore.superexec.run_superexec")
  methods = c.attr(rs, "_SUPEREXEC_AUTH_METHODS")
  if methods is not None and frozenset(methods) != SUPEREXEC_AUTH_METHODS:
    c.found.append(f"SuperExec signs {sorted(methods)}, not {sorted(SUPEREXEC_AUTH_METHODS)}")
  c.params(
    c.attr(c.module("flwr.supercore.heartbeat"), "HeartbeatSender"),
    "HeartbeatSender",
    ("heartbeat_fn",),
    exact=True,
  )
  c.params(
    c.attr(c.module("flwr.supercore.retry"), "RetryInvoker"),
    "RetryInvoker",
    ("wait_gen_factory", "recoverable_exceptions", "max_tries", "max_time", "should_giveup"),
  )
  c.attr(c.module("flwr.supercore.runtime"), "RuntimeHttpClient")
  c.attr(c.module("flwr.supercore.task_identity"), "TaskIdentity")


def _grid(c: _Checks) -> None:
  grid = c.module("flwr.superlink.grid.http_grid")
  utils = c.module("flwr.supercore.inflatable.inflatable_utils")
  pulls = c.attr(grid, "pull_objects")
  c.same(
    pulls, c.attr(utils, "pull_objects"), "http_grid.pull_objects", "inflatable_utils.pull_objects"
  )
  c.params(pulls, "http_grid.pull_objects", PULL_BACKOFF_PARAMS)
  c.attr(utils, "ObjectPullError")
  cls = c.attr(grid, "HttpGrid")
  c.calls(getattr(cls, "pull_messages", None), "HttpGrid.pull_messages", "pull_objects")
  # Its Runtime API client (``_client``) sends through an httpx.Client (``_client``), whose
  # hooks bound one object's response (object_pulls.cap_object_responses).
  c.calls(getattr(cls, "_connect", None), "HttpGrid._connect", "from_server_address")
  proto = c.attr(c.module("flwr.supercore.protobuf.client"), "ProtobufClient")
  c.calls(getattr(proto, "__init__", None), "ProtobufClient.__init__", "httpx.Client")


def _serverapp(c: _Checks) -> None:
  rt = c.module("flwr.superlink.runtime.run_serverapp")
  c.same(
    c.attr(rt, "run_"),
    c.attr(c.module("flwr.server.run_serverapp"), "run"),
    "run_serverapp.run_",
    "flwr.server.run_serverapp.run",
  )
  task = c.attr(rt, "run_serverapp")
  c.calls(task, "run_serverapp.run_serverapp", "run_")
  if task is not None and "load_app(" in _source(task):
    c.found.append("run_serverapp.run_serverapp loads an app itself (its source changed)")
  c.calls(
    c.attr(c.module("flwr.supercore.superexec.run_superexec"), "run_superexec"),
    "run_superexec.run_superexec",
    "get_executor",
  )


PARTS: dict[str, Callable[[_Checks], None]] = {
  "supernode": _supernode,
  "worker": _worker,
  "grid": _grid,
  "serverapp": _serverapp,
}


@functools.lru_cache(maxsize=None)
def _problems_cached(part: str, version: str) -> tuple[str, ...]:
  return _problems(part, version)


def _problems(part: str, version: str) -> tuple[str, ...]:
  checks = _Checks()
  if version not in TESTED_FLOWER_VERSIONS:
    checks.found.append(
      f"Flower {version or '(not installed)'} is not a version this code was tested with "
      f"{list(TESTED_FLOWER_VERSIONS)}"
    )
  else:
    PARTS[part](checks)
  return tuple(checks.found)


class UncheckedFlower(SystemExit):
  """A part that cannot run on the installed Flower, and what to do instead.

  Attributes:
    field: ``"flwr"``; value: the installed Flower version; problems: what the check found.
  """

  def __init__(self, part: str, found: tuple[str, ...], instead: str):
    self.field, self.value, self.problems = "flwr", flower_version(), found
    super().__init__(
      f"{part}: this code uses Flower internals checked on Flower "
      f"{list(TESTED_FLOWER_VERSIONS)} only, and refuses to run on flwr {self.value!r}: "
      f"{'; '.join(found)}. Instead: {TESTED_INSTALL}, or {instead}"
    )


def require(part: str, instead: str) -> None:
  """Raises :class:`UncheckedFlower` (saying ``instead``) unless :func:`problems` finds
  nothing amiss for ``part``."""
  if found := problems(part):
    raise UncheckedFlower(part, found, instead)


def problems(part: str, version: str | None = None, *, cached: bool = True) -> tuple[str, ...]:
  """What keeps ``part`` (a :data:`PARTS` key) from running on this Flower install; empty if
  nothing does. ``version`` (default: the installed one) is for tests."""
  if part not in PARTS:
    raise ValueError(f"part={part!r}; allowed: one of {sorted(PARTS)}")
  version = flower_version() if version is None else version
  return _problems_cached(part, version) if cached else _problems(part, version)
