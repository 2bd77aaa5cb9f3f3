"""README.md's hardened Flower deployment, on one machine with real processes.

The SuperLink (TLS, SuperNode authentication) listens on ``127.0.0.1``; its
nginx front listens on ``127.0.0.2``, the stand-in for the server's public
address: what reaches ``127.0.0.2`` is what a stranger on the network reaches.
Two client nodes (:mod:`fedlap_flower.node`) connect through the front with
keys the operator registered, and trust only the operator's signing key. A signed
run is computed once: submitted again, every node refuses it before its ledger moves.
Needs loopback networking; without nginx (Debian: ``nginx-light``) the front's
checks are left out and the nodes connect to the SuperLink on ``127.0.0.1``.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fedlap_flower import ledger as ledger_lib
from fedlap_flower import signed_runs
from flower_harness import TINY, read_jsonl
from flower_federation import APP_DIR, PUBLIC_HOST, Federation, nginx_path, ssh_key_pair
from local_network import loopback_up

pytestmark = [pytest.mark.flower, pytest.mark.slow]

K = 2
RUN = {
  "config": "quickstart:dp",
  "overrides": f"{TINY.replace('rounds=2', 'rounds=1')} data.num_clients={K}",
  "round-timeout": 300.0,
}


def _reachable(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=2):
      return True
  except OSError:
    return False


@pytest.fixture(autouse=True)
def _need_loopback():
  if not loopback_up():
    pytest.skip("loopback networking is down: SuperLink and SuperNodes cannot talk")


def _nginx() -> bool:
  return loopback_up(PUBLIC_HOST) and nginx_path() is not None


def _post_status(url: str, ca: Path, body: bytes = b"", headers: dict | None = None) -> int:
  req = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
  try:
    with urllib.request.urlopen(
      req, context=ssl.create_default_context(cafile=str(ca)), timeout=10
    ) as r:
      return r.status
  except urllib.error.HTTPError as e:
    return e.code


def _signed_fleet_status(url: str, ca: Path, request, key_path: Path) -> int:
  """POSTs ``request`` to a Fleet route signed with the node key ``key_path``, as a SuperNode
  signs its calls (public key, timestamp, signature headers)."""
  from cryptography.hazmat.primitives import serialization
  from flwr.supercore.date import now
  from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

  key = serialization.load_ssh_private_key(key_path.read_bytes(), password=None)
  stamp = now().isoformat()
  headers = {
    "Content-Type": "application/protobuf",
    "flwr-public-key": base64.b64encode(public_key_to_bytes(key.public_key())).decode(),
    "flwr-timestamp": stamp,
    "flwr-signature": base64.b64encode(sign_message(key, stamp.encode())).decode(),
  }
  return _post_status(url, ca, request.SerializeToString(), headers)


def _json(res) -> dict:
  return json.loads(res.stdout[res.stdout.index("{") :])


def _nodes(fed: Federation) -> list[dict]:
  return _json(fed._flwr("supernode", "list", "test", "--format", "json"))["nodes"]


def _refusals(run_dir: Path) -> list[str]:
  reports = json.loads((run_dir / "client_reports.json").read_text())
  return [f"{r['status']}: {r.get('reason', '')}" for r in reports]


def _strangers_are_kept_out(fed: Federation, tmp_path: Path) -> None:
  """At the front: a stranger's key cannot be registered, Control and runtime are not
  served, and the SuperLink's own port is not on the public address."""
  ca = fed.certs["ca"]
  front = f"https://{PUBLIC_HOST}:{fed.public_port}"

  # A stranger's key cannot be registered from the network; the SuperLink's own
  # port is not served on the public address at all.
  stranger = ssh_key_pair(tmp_path / "stranger" / "node", "ecdsa")
  res = _json(fed.register(Path(f"{stranger}.pub"), "front"))
  assert res["success"] is False and "403" in res["error-message"], res
  assert not _reachable(PUBLIC_HOST, fed.port)
  # Control, runtime (ServerApp <-> SuperLink) and every other path: refused,
  # also when the path only looks like the Fleet API before normalisation.
  for path in (
    "/v1/control/start-run",
    "/v1/control/register-node",
    "/v1/runtime/pull-messages",
    "/v1/runtime/acquire-task",
    "/v1/fleet/../control/register-node",
    "/v1/fleet/%2e%2e/control/list-runs",
    "/health",
    "/docs",
  ):
    assert _post_status(front + path, ca) == 403, path
  # The Fleet API passes the front, but a key the operator did not register can neither
  # register itself there (412: registration disabled under SuperNode authentication)
  # nor join (activation of an unknown key fails).
  from flwr.supercore.primitives.asymmetric import public_key_to_bytes
  from flwr.proto.fleet_pb2 import ActivateNodeRequest, RegisterNodeFleetRequest
  from cryptography.hazmat.primitives import serialization

  pub = public_key_to_bytes(
    serialization.load_ssh_private_key(stranger.read_bytes(), password=None).public_key()
  )
  assert (
    _signed_fleet_status(
      front + "/v1/fleet/register-node", ca, RegisterNodeFleetRequest(public_key=pub), stranger
    )
    == 412
  )
  activate = _signed_fleet_status(
    front + "/v1/fleet/activate-node",
    ca,
    ActivateNodeRequest(public_key=pub, heartbeat_interval=30),
    stranger,
  )
  assert 400 <= activate < 500, activate


def test_hardened_deployment_lets_no_stranger_in(tmp_path, tmp_path_factory):
  """A stranger cannot register a key or reach Control / runtime (with the front); nodes
  compute only runs of the installed ClientApp signed by the operator's key, each once: the
  same signed TOML submitted again (its run-dir removed, as a local process on the server
  could) is refused by every node before its ledger moves."""
  cache = str(tmp_path_factory.mktemp("jax_cache"))
  states = [tmp_path / f"client-{k}" for k in range(K)]
  with Federation(
    tmp_path / "fed", hardened=True, front=_nginx(), env={"JAX_COMPILATION_CACHE_DIR": cache}
  ) as fed:
    if fed.use_front:
      _strangers_are_kept_out(fed, tmp_path)

    for k in range(K):
      fed.start_supernode(
        k,
        {"partition-id": k, "num-partitions": K, "state-dir": str(states[k]), "max-epsilon": 50.0},
      )
    assert len(_nodes(fed)) == K, _nodes(fed)  # the operator's two, not the stranger's

    # A run signed by a key the nodes do not trust: every node refuses it.
    outsider = ssh_key_pair(tmp_path / "stranger" / "signer", "ed25519")
    run_dir = tmp_path / "run_untrusted"
    run_id = fed.run({**RUN, "run-dir": str(run_dir)}, signing_key=outsider)
    assert fed.wait(run_id, timeout=600, poll=1.0) != "finished:completed"
    refusals = _refusals(run_dir)
    assert len(refusals) == K and all(
      r.startswith("error: refused:") and "not among this client's trusted entities" in r
      for r in refusals
    ), refusals

    # A bundle naming other ClientApp code, even signed by the operator: refused, and
    # that code never runs on a client.
    evil = tmp_path / "evil_app"
    evil.mkdir()
    marker = tmp_path / "evil_code_ran"
    (evil / "pyproject.toml").write_text(
      (APP_DIR / "pyproject.toml")
      .read_text()
      .replace('clientapp = "fedlap_flower.client_app:app"', 'clientapp = "evil:app"')
    )
    (evil / "evil.py").write_text(
      "from flwr.clientapp import ClientApp\n"
      "app = ClientApp()\n"
      "@app.train()\n"
      "def train(msg, context):\n"
      f"  open({str(marker)!r}, 'w').write('ran')  # a client would leak its records here\n"
      "  raise RuntimeError('ran')\n"
    )
    run_dir = tmp_path / "run_evil"
    run_id = fed.run({**RUN, "run-dir": str(run_dir)}, app_dir=evil)
    assert fed.wait(run_id, timeout=600, poll=1.0) != "finished:completed"
    refusals = _refusals(run_dir)
    assert len(refusals) == K and all("this client runs only" in r for r in refusals), refusals
    assert not marker.exists()

    # The operator's signed run (through the front, where there is one) completes, charged
    # once on each node: the refused runs above charged nothing.
    run_dir = tmp_path / "run_signed"
    run_id = fed.run({**RUN, "run-dir": str(run_dir)})
    status = fed.wait(run_id, timeout=900, poll=1.0)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
    assert [r["clients_ok"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [[0, 1]]
    spent = [ledger_lib.ClientState(s).history() for s in states]
    assert [len(h) for h in spent] == [1] * K

    # The same signed TOML submitted again, its run-dir removed: refused by every node.
    shutil.rmtree(run_dir)
    again = fed.submit(fed.last_run_config)
    assert fed.wait(again, timeout=600, poll=1.0) != "finished:completed"
  reasons = _refusals(run_dir)
  assert len(reasons) == K and all(
    f"was computed by this client as Flower run {run_id}" in r for r in reasons
  ), reasons
  assert [ledger_lib.ClientState(s).history() for s in states] == spent  # nothing charged
  for s in states:
    assert [e["run_id"] for e in signed_runs.recorded(s).values()] == [run_id]
