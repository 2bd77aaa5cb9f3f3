"""Real Flower processes in the default suite: the node's guard and the server's.

* A node hands its tasks only to its own worker: its Runtime API refuses
  ``AcquireTask`` from any other local process (SuperExec authentication).
* The server runs only the installed ServerApp, never a bundle's.

The hardened deployment itself (TLS, node authentication, signed runs computed once,
the nginx front and the strangers' attempts): ``test_flower_deployment.py`` (``-m flower``).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from flower_federation import Federation
from local_network import loopback_up

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_loopback():
  if not loopback_up():
    pytest.skip("loopback networking is down: SuperLink and SuperNodes cannot talk")


def _answers(port: int) -> bool:
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
      return True
  except OSError:
    return False


def test_a_node_hands_its_tasks_only_to_its_own_worker(tmp_path):
  """Another local process that asks the node's Runtime API for a task, as flwr-clientapp or
  SuperExec would, is refused: AcquireTask needs the node's SuperExec secret."""
  from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
  from flwr.supercore.constant import TaskType
  from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
  from flwr.supercore.runtime import RuntimeHttpClient

  with Federation(tmp_path / "fed") as fed:
    fed.start_supernode(0, {"partition-id": 0, "num-partitions": 1})
    port = fed.runtime_ports[0]
    deadline = time.time() + 120
    while not _answers(port):
      assert time.time() < deadline, fed.log_tail("supernode-0.log")
      assert fed.supernodes[0].poll() is None, fed.log_tail("supernode-0.log")
      time.sleep(0.3)
    stranger = RuntimeHttpClient.from_server_address(
      server_address=f"127.0.0.1:{port}",
      insecure=True,
      root_certificates=None,
      interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")],
    )
    try:
      with pytest.raises(httpx.HTTPStatusError) as refused:
        stranger.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
    finally:
      stranger.close()
    assert refused.value.response.status_code in (401, 403), refused.value.response.text


def test_the_server_runs_no_serverapp_of_a_bundle(tmp_path):
  """A bundle naming other ServerApp code (submitted from the server machine, as any local
  account can): the run fails on the server, naming ``serverapp``, and that code never runs."""
  from flower_federation import APP_DIR  # pylint: disable=g-import-not-at-top

  evil, marker = tmp_path / "evil_app", tmp_path / "evil_code_ran"
  evil.mkdir()
  (evil / "pyproject.toml").write_text(
    (APP_DIR / "pyproject.toml")
    .read_text()
    .replace('serverapp = "fedlap_flower.server_app:app"', 'serverapp = "evilsrv:app"')
  )
  (evil / "evilsrv.py").write_text(
    f"open({str(marker)!r}, 'w').write('ran')\n"
    "from flwr.serverapp import ServerApp\napp = ServerApp()\n"
    "@app.main()\ndef main(grid, context):\n"
    f"  open({str(marker)!r}, 'w').write('ran')\n"
  )
  with Federation(tmp_path / "fed", hardened=True, front=False) as fed:
    run_id = fed.run({"config": "quickstart:dp", "run-dir": str(tmp_path / "run")}, app_dir=evil)
    assert fed.wait(run_id, timeout=120, poll=1.0) == "finished:failed"
    assert "serverapp is 'evilsrv:app'" in fed.log_tail("serverapp.log")
  assert not marker.exists()
