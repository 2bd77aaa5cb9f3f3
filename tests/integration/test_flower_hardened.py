"""Real Flower processes in the default suite: the node's guard and one hardened deployment.

* A node hands its tasks only to its own worker: its Runtime API refuses
  ``AcquireTask`` from any other local process (SuperExec authentication).
* The hardened deployment of README.md on one machine, one round: TLS,
  SuperNode authentication, two nodes computing only runs signed by the
  operator's key (through the nginx front on ``127.0.0.2`` where nginx is
  installed, else straight to the SuperLink on ``127.0.0.1``). The same signed
  run config submitted again is refused by both nodes and charges no ledger.

The whole deployment with the front and the strangers' attempts:
``test_flower_deployment.py`` (``-m flower``).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from fedlap_flower import ledger as ledger_lib
from fedlap_flower import signed_runs
from flower_federation import PUBLIC_HOST, Federation
from local_network import loopback_up
from flower_harness import TINY, read_jsonl

pytestmark = [pytest.mark.slow]

K = 2


@pytest.fixture(autouse=True)
def _need_loopback():
  if not loopback_up():
    pytest.skip("loopback networking is down: SuperLink and SuperNodes cannot talk")


def _nginx() -> bool:
  return loopback_up(PUBLIC_HOST) and (
    shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists()
  )


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


def test_hardened_deployment_computes_a_signed_run_once(tmp_path, tmp_path_factory):
  """TLS, node authentication, two nodes, a signed DP run of one round; the same signed TOML
  submitted again (its run-dir removed, as a local process on the server could) is refused by
  every node before its ledger is touched."""
  cache = str(tmp_path_factory.mktemp("jax_cache"))
  run_dir = tmp_path / "run"
  run = {
    "config": "quickstart:dp",
    "overrides": f"{TINY.replace('rounds=2', 'rounds=1')} data.num_clients={K}",
    "round-timeout": 300.0,
    "run-dir": str(run_dir),
  }
  states = [tmp_path / f"client-{k}" for k in range(K)]
  with Federation(
    tmp_path / "fed", hardened=True, front=_nginx(), env={"JAX_COMPILATION_CACHE_DIR": cache}
  ) as fed:
    for k in range(K):
      fed.start_supernode(
        k,
        {"partition-id": k, "num-partitions": K, "state-dir": str(states[k]), "max-epsilon": 50.0},
      )
    run_id = fed.run(run)
    status = fed.wait(run_id, timeout=900, poll=1.0)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
    assert [r["clients_ok"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [[0, 1]]
    spent = [ledger_lib.ClientState(s).history() for s in states]
    assert [len(h) for h in spent] == [1] * K

    shutil.rmtree(run_dir)
    again = fed.submit(fed.last_run_config)
    assert fed.wait(again, timeout=600, poll=1.0) != "finished:completed"
  reports = json.loads((run_dir / "client_reports.json").read_text())
  reasons = [r.get("reason", "") for r in reports]
  assert len(reasons) == K and all(
    f"was computed by this client as Flower run {run_id}" in r for r in reasons
  ), reasons
  assert [ledger_lib.ClientState(s).history() for s in states] == spent  # nothing charged
  for s in states:
    assert [e["run_id"] for e in signed_runs.recorded(s).values()] == [run_id]


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
