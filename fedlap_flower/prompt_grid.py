"""A ``Grid`` that collects replies as soon as they arrive.

Flower's deployment Grid (1.42) pushes a round's messages, then pulls the
replies every 3 s until all arrived or the timeout passed, so a round that the
clients answer in 1 s still costs 3 s. :class:`PromptGrid` wraps any Grid and
implements ``send_and_receive`` with the wrapped Grid's own ``push_messages`` /
``pull_messages``, pulling every ``poll`` seconds (one small HTTP call to the
SuperLink on the same machine); everything else is the wrapped Grid's.

A message that could not be pushed has no id (Flower 1.42 lists ``None`` for
it, later versions ``""``): it gets no reply, so it is not waited for.

A reply can be listed before its arrays arrived; with Flower's HTTP Grid its
missing arrays are retried after 50 ms rather than 1, 2, 4 s
(:func:`fedlap_flower.runtime.object_pulls.quick_grid_pulls`, where the
installed Flower is one it was tested with).
"""

from __future__ import annotations

import sys
import time
from typing import Iterable

import httpx
from flwr.app import Message
from flwr.serverapp import Grid

from fedlap_flower.runtime import object_pulls
from fedlap_flower.runtime.object_pulls import quick_grid_pulls


class PromptGrid(Grid):
  """``grid`` with ``send_and_receive`` polling every ``poll`` seconds (see the module docstring)."""

  def __init__(self, grid: Grid, poll: float = 0.1):
    if not poll > 0:
      raise ValueError(f"poll={poll!r}: the seconds between two pulls must be > 0")
    self.grid = grid
    self.poll = poll
    self._bounded = quick_grid_pulls(sys.modules[type(grid).__module__])

  def set_run(self, run) -> None:
    self.grid.set_run(run)

  @property
  def run(self):
    return self.grid.run

  def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
    return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

  def get_node_ids(self) -> Iterable[int]:
    return self.grid.get_node_ids()

  def get_nodes(self):
    return self.grid.get_nodes()

  def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
    return self.grid.push_messages(messages)

  def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
    # Flower's HTTP Grid, as tested: its Runtime API client (connected by the push) bounds
    # each object's response before reading it whole.
    client = getattr(getattr(self.grid, "_client", None), "_client", None)
    if self._bounded and isinstance(client, httpx.Client):
      object_pulls.cap_object_responses(client, object_pulls.GRID_LIMITS)
    return self.grid.pull_messages(message_ids)

  def limit_replies(self, update_bytes: int, arrays: int) -> None:
    """Bounds the bytes and objects of each reply pulled from now on by what an update of
    ``arrays`` arrays of ``update_bytes`` bytes takes
    (:func:`fedlap_flower.runtime.object_pulls.limit_replies`; Flower's HTTP Grid only)."""
    object_pulls.limit_replies(object_pulls.GRID_LIMITS, update_bytes, arrays)

  def send_and_receive(
    self, messages: Iterable[Message], *, timeout: float | None = None
  ) -> Iterable[Message]:
    """Pushes ``messages``; returns the replies that arrived within ``timeout`` seconds
    (all of them, however long they take, when ``timeout`` is None). A message whose push
    failed (no id) is not waited for. The deadline bounds the pulls of the replies' objects
    too (Flower's HTTP Grid): a reply still incomplete then is Flower's error reply for it;
    a pull that ends past the deadline is followed by one more, which takes every reply
    complete by then (one listed behind a slow one included)."""
    pending = {i for i in self.push_messages(messages) if i}
    end = None if timeout is None else time.time() + timeout
    limits = object_pulls.GRID_LIMITS
    limits.deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    try:
      while pending:
        last = end is not None and time.time() >= end  # then: whatever is complete
        got = list(self.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or last:
          break
        time.sleep(self.poll if end is None else max(0.0, min(self.poll, end - time.time())))
    finally:
      limits.deadline = None
    return replies
