"""Quicker retries of a message's arrays not yet on the SuperLink.

A message and its arrays travel separately (the message first, then one
request per array), so a message can be listed before its arrays arrived;
Flower 1.42 then retries each missing array after 1, 2, 4, ... s (up to
10 s). :func:`quick_object_pulls` makes a module that pulls arrays (the
ServerApp Grid's, the SuperNode's) retry after 50 ms, doubling up to 1 s, by
replacing that module's ``pull_objects`` (checked first:
:mod:`fedlap_flower.runtime.support`).
"""

from __future__ import annotations

import functools
from logging import WARNING
from types import ModuleType

from flwr.common.logger import log

from fedlap_flower.runtime import support

GRID_MODULE = "flwr.superlink.grid.http_grid"


def quick_object_pulls(module: ModuleType, backoff: float = 0.05, cap: float = 1.0) -> None:
  """``module.pull_objects`` (Flower's) retrying after ``backoff`` s, doubling up to ``cap``.

  The caller has checked ``module`` (:func:`fedlap_flower.runtime.support.problems`).
  """
  pull = module.pull_objects
  if isinstance(pull, functools.partial):  # already replaced
    return
  module.pull_objects = functools.partial(
    pull, max_tries_per_object=None, initial_backoff=backoff, backoff_cap=cap
  )


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
  quick_object_pulls(grid_module)
  return True
