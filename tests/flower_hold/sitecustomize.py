"""Test-only: holds a client's reply after it has kept its state, so a test can crash it there.

A process started with this directory on ``PYTHONPATH`` and ``FEDLAP_TEST_HOLD_ROUND=N`` wraps
``fedlap_flower.client_app._keep_state`` once that module is imported: after the client has
charged its ledger for round ``N``, computed it and kept its carried state, it writes
``FEDLAP_TEST_HOLD_MARKER`` and sleeps instead of replying. The test waits for the marker and
kills the node (a crash between spending a round and delivering it) or stops the run, every
time, whatever the machine's speed (polling the ledger raced the reply on a fast round). It
holds once: a worker started again, or a later run, finds the marker and replies.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_TARGET = "fedlap_flower.client_app"


def _patch(module) -> None:
  hold_round = int(os.environ["FEDLAP_TEST_HOLD_ROUND"])
  marker = os.environ["FEDLAP_TEST_HOLD_MARKER"]
  keep = module._keep_state

  def keep_then_hold(state, run_key, server_round, start, arrays):
    keep(state, run_key, server_round, start, arrays)
    if int(server_round) == hold_round and not os.path.exists(marker):  # once per marker
      with open(marker, "w") as f:
        f.write(str(server_round))
      time.sleep(3600)  # the test kills this process

  module._keep_state = keep_then_hold


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != _TARGET:
      return None
    sys.meta_path.remove(self)
    try:
      spec = importlib.util.find_spec(name)
    finally:
      sys.meta_path.insert(0, self)
    if spec is None or spec.loader is None:
      return None
    exec_module = spec.loader.exec_module

    def exec_and_patch(module):
      exec_module(module)
      _patch(module)

    spec.loader.exec_module = exec_and_patch
    return spec


if os.environ.get("FEDLAP_TEST_HOLD_ROUND"):
  sys.meta_path.insert(0, _Finder())
