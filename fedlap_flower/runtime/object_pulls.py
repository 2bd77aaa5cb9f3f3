"""Quicker retries of a message's arrays not yet on the SuperLink.

A message and its arrays travel separately (the message first, then one
request per array), so a message can be listed before its arrays arrived;
Flower 1.42 then retries each missing array after 1, 2, 4, ... s (up to
10 s). :func:`quick_object_pulls` makes a module that pulls arrays (the
ServerApp Grid's, the SuperNode's) retry after 50 ms, doubling up to 1 s, by
replacing that module's ``pull_objects`` (checked first:
:mod:`fedlap_flower.runtime.support`).

The ServerApp Grid's pulls also take :data:`GRID_LIMITS`, which the round sets
(:class:`fedlap_flower.prompt_grid.PromptGrid`, the strategy): a reply's
objects are pulled until the round's deadline at most (Flower retries a
missing object up to 2 hours, so a client pushing one object every few seconds
would hold the round, and every reply listed after its own, that long); a
reply whose object tree holds more objects than the round's update can take is
refused before any of it is pulled (Flower's tree gives object ids, not sizes);
and each object, and the reply in all, may be at most so many bytes, counted as
they arrive. A reply refused so becomes Flower's error reply for it (its reason
says why), which the strategy reports and leaves out. One object's bytes are bounded
before it is read whole too (:func:`cap_object_responses`): the Grid's Runtime API
client (``httpx``) refuses a pull-object response whose ``Content-Length`` is above
the bound before reading its body, or stops reading it once that many bytes arrived,
and asks for it uncompressed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from logging import WARNING
from types import ModuleType
from typing import Callable

import httpx
from flwr.common.logger import log

from fedlap_flower.runtime import support

GRID_MODULE = "flwr.superlink.grid.http_grid"


@dataclasses.dataclass
class PullLimits:
  """What pulling one message may take (``None``: no bound of this kind).

  Attributes:
    deadline: ``time.monotonic()`` after which a missing object is no longer waited for.
    max_objects: objects in the message's tree.
    max_object_bytes: bytes of one object.
    max_bytes: bytes of all its objects.
  """

  deadline: float | None = None
  max_objects: int | None = None
  max_object_bytes: int | None = None
  max_bytes: int | None = None


# The ServerApp Grid's limits, set by the round (module docstring).
GRID_LIMITS = PullLimits()
# The bytes of one chunk of an array as Flower sends it (its default), and the most an honest
# object holds beyond them (its header; a record of metrics or a status).
CHUNK_BYTES = 5 * 2**20
OBJECT_OVERHEAD = 2**16
# What a reply holds beside its update's arrays (its npy headers, metrics and status): bytes,
# and objects (the message, its record dict and records).
REPLY_OVERHEAD_BYTES = 2**20
REPLY_OVERHEAD_OBJECTS = 8
# The Runtime API's path of one object's pull (Flower's HTTP Grid) and what its response
# holds beyond the object's bytes (the protobuf's flags and length prefix).
PULL_OBJECT_PATH = "/v1/runtime/pull-object"
RESPONSE_OVERHEAD = 2**10


class ObjectTooLarge(Exception):
  """A pulled object's response holds more bytes than the round allows (its body past the
  bound was not read)."""


class _Capped(httpx.SyncByteStream):
  """``stream`` raising :class:`ObjectTooLarge` once more than ``cap`` bytes arrived."""

  def __init__(self, stream, cap: int):
    self.stream, self.cap = stream, cap

  def __iter__(self):
    seen = 0
    for chunk in self.stream:
      seen += len(chunk)
      if seen > self.cap:
        raise ObjectTooLarge(f"its response passed {self.cap} bytes; the rest was not read")
      yield chunk

  def close(self) -> None:
    self.stream.close()


def cap_object_responses(client: httpx.Client, limits: PullLimits) -> None:
  """Makes ``client`` (the Grid's Runtime API client's ``httpx.Client``) ask for each object
  uncompressed and refuse a pull-object response above ``limits.max_object_bytes`` plus
  :data:`RESPONSE_OVERHEAD` (read at each response; ``None``: no bound) before reading it
  whole: by its ``Content-Length`` before any of its body, else once that many bytes arrived
  (:class:`ObjectTooLarge`, which :func:`bounded` makes Flower's error for the reply)."""
  hooks = client.event_hooks
  if any(getattr(h, "fedlap_cap", False) for h in hooks["response"]):
    return

  def request(req: httpx.Request) -> None:
    if req.url.path == PULL_OBJECT_PATH:
      req.headers["accept-encoding"] = "identity"  # the bound is of the bytes as they arrive

  def response(res: httpx.Response) -> None:
    if limits.max_object_bytes is None or res.request.url.path != PULL_OBJECT_PATH:
      return
    cap = limits.max_object_bytes + RESPONSE_OVERHEAD
    declared = res.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
      res.close()
      raise ObjectTooLarge(f"its response declares {declared} bytes; none of it was read")
    res.stream = _Capped(res.stream, cap)

  response.fedlap_cap = True  # type: ignore[attr-defined]
  client.event_hooks = {
    "request": [*hooks["request"], request],
    "response": [*hooks["response"], response],
  }


def limit_replies(limits: PullLimits, update_bytes: int, arrays: int) -> None:
  """Sets ``limits`` to what a reply of ``arrays`` arrays of ``update_bytes`` bytes in all may
  take: that plus an eighth and :data:`REPLY_OVERHEAD_BYTES`; each object a chunk and its
  header; the objects of that many bytes in chunks, of ``arrays`` arrays and of the records."""
  limits.max_bytes = int(update_bytes + update_bytes // 8 + REPLY_OVERHEAD_BYTES)
  limits.max_object_bytes = CHUNK_BYTES + OBJECT_OVERHEAD
  limits.max_objects = REPLY_OVERHEAD_OBJECTS + 2 * int(arrays) - (-limits.max_bytes // CHUNK_BYTES)


def bounded(
  object_ids: list[str], pull_object_fn: Callable[[str], bytes], limits: PullLimits
) -> tuple[Callable[[str], bytes], float | None]:
  """``pull_object_fn`` counting the bytes it returns against ``limits``, and the seconds left
  to pull ``object_ids`` in (``None``: Flower's own limit).

  Raises:
    ObjectPullError: the tree holds more than ``limits.max_objects`` objects (nothing pulled);
      from the returned function, an object or all of them so far above their bytes.
  """
  # Flower's internals: imported only once the check passed (quick_grid_pulls, the node).
  from flwr.supercore.inflatable.inflatable_utils import ObjectPullError  # pylint: disable=g-import-not-at-top

  if limits.max_objects is not None and len(object_ids) > limits.max_objects:
    raise ObjectPullError(
      object_ids[0],
      f"the message's tree holds {len(object_ids)} objects; allowed: at most "
      f"{limits.max_objects} (what the round's update takes); nothing of it was pulled",
    )
  lock = threading.Lock()
  total = [0]

  def pull(object_id: str) -> bytes:
    try:
      content = pull_object_fn(object_id)
    except ObjectTooLarge as e:
      raise ObjectPullError(
        object_id, f"{e}; allowed: at most {limits.max_object_bytes} bytes an object"
      ) from None
    size = len(content)
    if limits.max_object_bytes is not None and size > limits.max_object_bytes:
      raise ObjectPullError(
        object_id, f"it holds {size} bytes; allowed: at most {limits.max_object_bytes}"
      )
    with lock:
      total[0] += size
      so_far = total[0]
    if limits.max_bytes is not None and so_far > limits.max_bytes:
      raise ObjectPullError(
        object_id,
        f"the message's objects pulled so far hold {so_far} bytes; allowed: at most "
        f"{limits.max_bytes} (what the round's update takes); the rest was not pulled",
      )
    return content

  left = None if limits.deadline is None else max(0.0, limits.deadline - time.monotonic())
  return pull, left


def quick_object_pulls(
  module: ModuleType, backoff: float = 0.05, cap: float = 1.0, limits: PullLimits | None = None
) -> None:
  """``module.pull_objects`` (Flower's) retrying after ``backoff`` s, doubling up to ``cap``,
  within ``limits`` (:func:`bounded`; read at each call).

  The caller has checked ``module`` (:func:`fedlap_flower.runtime.support.problems`).
  """
  pull = module.pull_objects
  if getattr(pull, "fedlap_quick", False):  # already replaced
    return

  def pull_objects(object_ids, pull_object_fn, **kwargs):
    kwargs.update(max_tries_per_object=None, initial_backoff=backoff, backoff_cap=cap)
    if limits is not None:
      pull_object_fn, left = bounded(list(object_ids), pull_object_fn, limits)
      if left is not None:
        kwargs["max_time"] = left
    return pull(object_ids, pull_object_fn, **kwargs)

  pull_objects.fedlap_quick = True  # type: ignore[attr-defined]
  module.pull_objects = pull_objects


def quick_grid_pulls(grid_module: ModuleType) -> bool:
  """:func:`quick_object_pulls` on the ServerApp Grid's module if it is Flower's HTTP Grid and
  :mod:`~fedlap_flower.runtime.support` finds it as tested; says so and leaves Flower's own
  retries otherwise. Returns whether it replaced them."""
  if grid_module.__name__ != GRID_MODULE:
    return False  # another Grid (the simulation's, a test's): no object pulls to speed up
  found = support.problems("grid")
  if found:
    log(
      WARNING,
      "[fedlap] Flower's own retries for replies' arrays (1, 2, 4 ... s), not 50 ms: %s",
      "; ".join(found),
    )
    return False
  quick_object_pulls(grid_module, limits=GRID_LIMITS)
  return True
