"""The Flower app against a hostile client, a local account and an oversized or trickled
reply: each check in process, on the function that holds it."""

from __future__ import annotations

import logging
import os
import stat
import types

from flwr.cli.build import build_fab_from_disk
from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse  # pylint: disable=no-name-in-module

from fedlap_flower import signed_runs
from fedlap_flower.runtime import warm_clientapp
from flower_federation import APP_DIR


def test_the_record_of_signed_runs_is_the_owners_alone(tmp_path):
  old = os.umask(0o022)
  try:
    signed_runs.admit(tmp_path / "state", "nonce-1", 7, check_new=lambda: None)
  finally:
    os.umask(old)
  path = tmp_path / "state" / signed_runs.RECORD_FILE
  assert stat.S_IMODE(path.stat().st_mode) == 0o600


class _Alive:
  """A Runtime API client whose task heartbeats say the task is alive."""

  def SendTaskHeartbeat(self, request):  # pylint: disable=invalid-name
    return SendTaskHeartbeatResponse(success=True)

  def close(self):
    pass


def test_a_runs_signer_cannot_forge_the_nodes_log_lines(monkeypatch, caplog):
  """The signer is the run's to choose: the node logs its refusal on one line, the newline
  and the ANSI escape written out."""
  fab = types.SimpleNamespace(content=build_fab_from_disk(APP_DIR))
  forged = "x\nINFO :      [fedlap node] task completed: 1.00 s\x1b[0m"
  run_config = {"signer": forged, "signature": "AAAA"}
  context = types.SimpleNamespace(run_config=run_config, node_config={}, run_id=5)
  monkeypatch.setattr(warm_clientapp, "_client", lambda *a, **k: _Alive())
  monkeypatch.setattr(warm_clientapp, "pull_task_input", lambda c: (None, context, None, fab))
  monkeypatch.setattr(warm_clientapp, "push_message", lambda *a: None)
  monkeypatch.setattr(warm_clientapp, "push_task_output", lambda **k: None)
  monkeypatch.setattr(warm_clientapp, "Message", lambda *a, **k: "reply")
  with caplog.at_level(logging.INFO, logger="flwr"):
    warm_clientapp.run_task(
      "x:1", "token", None, warm_clientapp.Policy({}), insecure=True, certificates=None
    )
  refused = [r.getMessage() for r in caplog.records if "refused run" in r.getMessage()]
  assert len(refused) == 1, refused
  assert "\n" not in refused[0] and "\x1b" not in refused[0], refused
  assert "x\\nINFO" in refused[0] and "\\x1b[0m" in refused[0], refused
