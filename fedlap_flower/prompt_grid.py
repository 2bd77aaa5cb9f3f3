"""A ``Grid`` that collects replies as soon as they arrive.

Flower's deployment Grid (1.42) pushes a round's messages, then pulls the
replies every 3 s until all arrived or the timeout passed, so a round that the
clients answer in 1 s still costs 3 s. :class:`PromptGrid` wraps any Grid and
implements ``send_and_receive`` with the wrapped Grid's own ``push_messages`` /
``pull_messages``, pulling every ``poll`` seconds (one small HTTP call to the
SuperLink on the same machine); everything else is the wrapped Grid's.

A message and its arrays travel separately (the message first, then one
request per array), so a reply can be listed before its arrays arrived; Flower
then retries each missing array after 1, 2, 4, ... s (up to 10 s).
:func:`quick_object_pulls` makes a module that pulls arrays (the Grid's, the
SuperNode's) retry after 50 ms, doubling up to 1 s.
"""

from __future__ import annotations

import functools
import sys
import time
from types import ModuleType
from typing import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


def quick_object_pulls(module: ModuleType, backoff: float = 0.05, cap: float = 1.0) -> None:
  """``module.pull_objects`` (Flower's) retrying after ``backoff`` s, doubling up to ``cap``."""
  pull = getattr(module, "pull_objects", None)
  if pull is None or isinstance(pull, functools.partial):
    return
  module.pull_objects = functools.partial(
    pull, max_tries_per_object=None, initial_backoff=backoff, backoff_cap=cap
  )


class PromptGrid(Grid):
  """``grid`` with ``send_and_receive`` polling every ``poll`` seconds (see the module docstring)."""

  def __init__(self, grid: Grid, poll: float = 0.1):
    if not poll > 0:
      raise ValueError(f"poll={poll!r}: the seconds between two pulls must be > 0")
    self.grid = grid
    self.poll = poll
    quick_object_pulls(sys.modules[type(grid).__module__])

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
    return self.grid.pull_messages(message_ids)

  def send_and_receive(
    self, messages: Iterable[Message], *, timeout: float | None = None
  ) -> Iterable[Message]:
    """Pushes ``messages``; returns the replies that arrived within ``timeout`` seconds
    (all of them, however long they take, when ``timeout`` is None)."""
    pending = set(self.push_messages(messages))
    end = None if timeout is None else time.time() + timeout
    replies: list[Message] = []
    while pending:
      got = list(self.pull_messages(pending))
      replies.extend(got)
      pending.difference_update(m.metadata.reply_to_message_id for m in got)
      if not pending or (end is not None and time.time() >= end):
        break
      time.sleep(self.poll if end is None else max(0.0, min(self.poll, end - time.time())))
    return replies
