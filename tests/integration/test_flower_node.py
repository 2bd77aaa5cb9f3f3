"""The client node's checks and the ServerApp's reply collection, without processes.

:mod:`fedlap_flower.runtime.run_signature` (what a client accepts), the node worker's
task check (:func:`fedlap_flower.runtime.warm_clientapp.check_task`) and
:class:`fedlap_flower.prompt_grid.PromptGrid`. The same paths with real
processes: ``tests/integration/test_flower_deployment.py`` (``-m flower``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import threading
import time
import types
import zipfile
from io import BytesIO
from pathlib import Path

import httpx
import pytest
from conftest import raises_field
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import flatten_dict, fuse_dicts, get_fab_config
from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse  # pylint: disable=no-name-in-module
from flwr.supercore.constant import TaskType
from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign, load_private_key

from fedlap_runs import termination
from fedlap_flower import signed_runs
from fedlap_flower.prompt_grid import PromptGrid
from fedlap_flower.runtime import run_signature, warm_clientapp
from flower_federation import APP_DIR, ssh_key_pair


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
  d = tmp_path_factory.mktemp("keys")
  operator, other = ssh_key_pair(d / "operator", "ed25519"), ssh_key_pair(d / "other", "ed25519")
  trusted = d / "trusted.yaml"
  trusted.write_text(f"operator: '{(d / 'operator.pub').read_text().strip()}'\n")
  return {"operator": operator, "other": other, "trusted": run_signature.load_trusted(trusted)}


def _fused(fab: bytes, overrides: dict) -> dict:
  """The run config a SuperNode gives the ClientApp (Flower's own fusion)."""
  defaults = flatten_dict(get_fab_config(fab)["tool"]["flwr"]["app"]["config"])
  return fuse_dicts(defaults, overrides)


def test_signed_run_verifies_and_any_change_is_refused(keys, tmp_path):
  fab = build_fab_from_disk(APP_DIR)
  assert build_fab_from_disk(APP_DIR) == fab  # deterministic: what the operator signs is sent
  fab_hash = hashlib.sha256(fab).hexdigest()
  toml = tmp_path / "run.toml"
  toml.write_text("config = 'quickstart:dp'\nmin-clients = 4\n")
  overrides = run_signature.signed_overrides(keys["operator"], APP_DIR, [str(toml)])
  assert overrides["signer"] == run_signature.fingerprint(
    load_private_key(keys["operator"]).public_key()
  )
  seen = _fused(fab, overrides)
  assert run_signature.verify(keys["trusted"], fab_hash, seen) == overrides["signer"]

  def refused(run_config, field, fab_sha=fab_hash):
    with raises_field(field, run_signature.UntrustedRun):
      run_signature.verify(keys["trusted"], fab_sha, run_config)

  refused({**seen, "min-clients": 3}, "signature")  # the server changed a value
  refused({**seen, "unsafe-dp-keys-from-server": True}, "signature")
  refused({**seen, "signed-at": seen["signed-at"] + 1}, "signature")
  refused(seen, "signature", fab_sha=hashlib.sha256(fab + b"x").hexdigest())
  refused({**seen, "signer": "", "signature": ""}, "signer")  # not signed
  other = run_signature.sign(load_private_key(keys["other"]), fab_hash, seen)
  refused({**seen, **other}, "signer")  # signed by a key the client does not trust
  with pytest.raises(ValueError, match="set by the signature"):
    run_signature.signed_overrides(keys["operator"], APP_DIR, ["signer='x'"])
  # Each signing draws its own nonce, which the signature covers.
  assert run_signature.NONCE_PATTERN.fullmatch(seen["run-nonce"])
  again = run_signature.signed_overrides(keys["operator"], APP_DIR, [str(toml)])
  assert again["run-nonce"] != seen["run-nonce"]
  refused({**seen, "run-nonce": again["run-nonce"]}, "signature")
  with pytest.raises(ValueError, match="set by the signature"):
    run_signature.signed_overrides(keys["operator"], APP_DIR, ["run-nonce='00'"])
  no_nonce = _fused(fab, {})
  no_nonce.update(run_signature.sign(load_private_key(keys["operator"]), fab_hash, no_nonce))
  refused(no_nonce, "run-nonce")  # signed, but without a nonce
  # The message layout is Flower's own (create_message_to_sign).
  digest = run_signature.digest(fab_hash, seen)
  assert run_signature._message(digest, 1234) == create_message_to_sign(digest, 1234)


def test_a_refusal_crosses_a_process_boundary_with_its_field():
  """The node's refusals are pickled whole (a ClientApp in another process, Ray's workers):
  the type, the field and the message survive."""
  import pickle

  from fedlap_flower import ledger as ledger_lib

  from fedlap_flower import replies

  refusals = (
    run_signature.UntrustedRun,
    signed_runs.ReplayedRun,
    ledger_lib.LedgerError,
    replies.InvalidReply,
  )
  for cls in refusals:
    e = pickle.loads(pickle.dumps(cls("run-nonce", "refused: run-nonce")))
    assert type(e) is cls and e.field == "run-nonce" and str(e) == "refused: run-nonce"
  over = ledger_lib.BudgetExceeded(3.5, 4.25, 4.0, at_least=True)
  back = pickle.loads(pickle.dumps(over))
  assert (back.epsilon, back.epsilon_after, back.max_epsilon, back.at_least) == (
    3.5,
    4.25,
    4.0,
    True,
  )
  assert str(back) == str(over)


def test_trusted_entities_must_be_ed25519(tmp_path):
  ecdsa = ssh_key_pair(tmp_path / "node", "ecdsa")
  bad = tmp_path / "bad.yaml"
  bad.write_text(f"node: '{(tmp_path / 'node.pub').read_text().strip()}'\n")
  with pytest.raises(ValueError, match="not an Ed25519 key"):
    run_signature.load_trusted(bad)
  bad.write_text("{}\n")
  with pytest.raises(ValueError, match="at least one key"):
    run_signature.load_trusted(bad)
  assert ecdsa.exists()


def _with_clientapp(fab: bytes, ref: str) -> bytes:
  out = BytesIO()
  with zipfile.ZipFile(BytesIO(fab)) as src, zipfile.ZipFile(out, "w") as dst:
    for item in src.infolist():
      data = src.read(item)
      if item.filename == "pyproject.toml":
        data = data.replace(
          b'clientapp = "fedlap_flower.client_app:app"', f'clientapp = "{ref}"'.encode()
        )
      dst.writestr(item, data)
  return out.getvalue()


def _signed(keys, fab: bytes, overrides: dict | None = None, signed_at=None) -> dict:
  """The run config a node sees for a run the operator signed (with a fresh nonce)."""
  seen = _fused(fab, {**(overrides or {}), "run-nonce": run_signature.new_nonce()})
  key = load_private_key(keys["operator"])
  return {**seen, **run_signature.sign(key, hashlib.sha256(fab).hexdigest(), seen, signed_at)}


def test_node_runs_only_the_installed_clientapp_of_signed_runs(keys, tmp_path):
  fab = build_fab_from_disk(APP_DIR)
  seen = _fused(fab, {})
  node = {"state-dir": str(tmp_path / "state")}
  signed_only = warm_clientapp.Policy(keys["trusted"])
  unsigned_too = warm_clientapp.Policy(None, allow_unsigned=True)
  warm_clientapp.check_task(fab, _signed(keys, fab), node, 1, signed_only)
  warm_clientapp.check_task(fab, seen, {}, 2, unsigned_too)
  with raises_field("signer", run_signature.UntrustedRun):  # not signed
    warm_clientapp.check_task(fab, seen, node, 3, signed_only)
  evil = _with_clientapp(fab, "evil:app")
  for run_config, policy in ((_signed(keys, evil), signed_only), (seen, unsigned_too)):
    with raises_field("clientapp", run_signature.UntrustedRun):
      warm_clientapp.check_task(evil, run_config, node, 4, policy)
  with pytest.raises(ValueError, match="no trusted entities"):
    warm_clientapp.serve("127.0.0.1:1", warm_clientapp.Policy(None))


class _Meta:
  def __init__(self, reply_to):
    self.reply_to_message_id = reply_to


class _Reply:
  def __init__(self, reply_to):
    self.metadata = _Meta(reply_to)


class _SlowGrid:
  """Replies to message ``i`` become pullable ``delays[i]`` seconds after the push."""

  def __init__(self, delays):
    self.delays = delays
    self.pulls = 0

  def push_messages(self, messages):
    self.t0 = time.time()
    return [str(i) for i, _ in enumerate(messages)]

  def pull_messages(self, ids):
    self.pulls += 1
    now = time.time() - self.t0
    return [_Reply(i) for i in ids if now >= self.delays[int(i)]]


def test_prompt_grid_returns_replies_as_they_arrive_within_the_timeout():
  grid = _SlowGrid([0.0, 0.3, 10.0])
  t0 = time.time()
  got = PromptGrid(grid, poll=0.05).send_and_receive(["a", "b", "c"], timeout=0.6)
  waited = time.time() - t0
  assert sorted(r.metadata.reply_to_message_id for r in got) == ["0", "1"]
  assert 0.6 <= waited < 1.5, waited  # waits for the timeout, not Flower's 3 s steps
  grid = _SlowGrid([0.0, 0.2])
  t0 = time.time()
  got = PromptGrid(grid, poll=0.05).send_and_receive(["a", "b"], timeout=30)
  assert len(got) == 2 and time.time() - t0 < 1.0  # all replies in: returns at once
  with pytest.raises(ValueError, match="poll"):
    PromptGrid(grid, poll=0)


def test_node_cli_help_names_the_flags_it_hands_to_flower_and_refuses_bad_ones(capsys):
  from fedlap_flower import node  # pylint: disable=g-import-not-at-top

  with pytest.raises(SystemExit) as exit_info:
    node.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--trusted-entities", "--allow-unsigned-runs", "--poll", "flower-supernode"):
    assert flag in out, flag
  # The README's node command hands these to flower-supernode; --help says so.
  for flag in (
    "--superlink",
    "--root-certificates",
    "--auth-supernode-private-key",
    "--node-config",
  ):
    assert flag in out.split("Every other flag goes to", 1)[1], flag
  for argv, message in (
    (["--allow-unsigned-runs", "--isolation", "subprocess"], "--isolation is set by this command"),
    (
      ["--allow-unsigned-runs", "--superexec-auth-secret-file", "s"],
      "--superexec-auth-secret-file is set by this command",
    ),
    (["--allow-unsigned-runs", "--max-run-age", "0"], "--max-run-age 0.0: allowed: seconds > 0"),
    ([], "--trusted-entities FILE is required"),
    (["--allow-unsigned-runs", "--poll", "0"], "--poll 0.0: allowed: seconds > 0"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      node.main(argv)
    assert exit_info.value.code == 2, argv
    assert message in capsys.readouterr().err, argv


def test_a_signed_run_is_computed_once_and_only_soon_after_its_signing(keys, tmp_path):
  """Each signature admits one Flower run: its later tasks go on however late, a resubmission
  of the same signed config (another run id) is refused, as are old and future signatures."""
  fab = build_fab_from_disk(APP_DIR)
  node = {"state-dir": str(tmp_path / "state")}
  policy = warm_clientapp.Policy(keys["trusted"], max_run_age=3600.0, clock_skew=300.0)
  t = 1_700_000_000
  run = _signed(keys, fab, signed_at=t)

  def check(run_config, run_id, now, node_config=node):
    warm_clientapp.check_task(fab, run_config, node_config, run_id, policy, now=now)

  def refused(run_config, run_id, now, field, node_config=node):
    with raises_field(field, run_signature.UntrustedRun):
      check(run_config, run_id, now, node_config)

  check(run, 7, now=t + 60)  # the run's first task: admitted and recorded
  check(run, 7, now=t + 10 * 3600)  # its later rounds, past max-run-age: the same run
  refused(run, 8, now=t + 120, field="run-nonce")  # computed by this client as run 7
  record = signed_runs.recorded(tmp_path / "state")
  assert list(record) == [run["run-nonce"]] and record[run["run-nonce"]]["run_id"] == 7
  # A signature too old, or from the future beyond the skew, when the run first arrives.
  refused(_signed(keys, fab, signed_at=t), 9, now=t + 3600 + 301, field="signed-at")  # old
  refused(_signed(keys, fab, signed_at=t + 301), 9, now=t, field="signed-at")  # future
  check(_signed(keys, fab, signed_at=t + 299), 10, now=t)  # within the clock skew
  check(_signed(keys, fab, signed_at=t - 3899), 11, now=t)
  # A refused run is not recorded: the same run id is refused again, not admitted.
  old = _signed(keys, fab, signed_at=t - 4000)
  refused(old, 12, now=t, field="signed-at")
  refused(old, 12, now=t, field="signed-at")
  assert old["run-nonce"] not in signed_runs.recorded(tmp_path / "state")
  refused(_signed(keys, fab), 13, now=None, field="state-dir", node_config={})
  # A record that cannot be read is refused, never reset.
  (tmp_path / "state" / signed_runs.RECORD_FILE).write_text("{not json")
  refused(run, 7, now=t, field="state-dir")


def test_node_accepts_only_a_loopback_runtime_api_host():
  from fedlap_flower import node  # pylint: disable=g-import-not-at-top

  for host in ("0", "0.0.0.0", "0:0:0:0:0:0:0:0", "::", "192.0.2.7", "[::1]", "no.such.host."):
    with pytest.raises(SystemExit, match=r"--host .*(not loopback only|cannot be resolved)"):
      node.loopback_address(host)
  assert node.loopback_address("127.0.0.1") == "127.0.0.1"
  assert node.loopback_address("127.1") == "127.0.0.1"  # what the system resolves it to
  assert node.loopback_address("::1") == "::1"
  assert ipaddress.ip_address(node.loopback_address("localhost")).is_loopback
  # Flower is given the address the check resolved, never the name again.
  flower, address, tls = node.runtime_api(["--insecure", "--host=127.1", "--port", "9100"])
  assert flower == ["--insecure", "--port", "9100", "--host", "127.0.0.1"]
  assert (address, tls) == ("127.0.0.1:9100", [])
  assert node.runtime_api(["--host", "::1"])[1] == "[::1]:9094"
  with pytest.raises(SystemExit, match="not loopback only"):
    node.main(["--allow-unsigned-runs", "--host", "0"])


def _sleeping(): ...


def test_runtime_support_checks_the_version_and_each_name_it_uses(monkeypatch):
  """On the tested Flower nothing is amiss; another version, a missing or changed name, or
  a refactor of the code that calls a replaced name is reported."""
  import flwr.supernode.start_client_internal as sci  # pylint: disable=g-import-not-at-top
  from flwr.superlink.grid import http_grid  # pylint: disable=g-import-not-at-top
  from flwr.supernode.runtime import run_clientapp  # pylint: disable=g-import-not-at-top

  from fedlap_flower.runtime import support  # pylint: disable=g-import-not-at-top

  assert support.flower_version() in support.TESTED_FLOWER_VERSIONS
  for part in support.PARTS:
    assert support.problems(part, cached=False) == (), part
  for version in ("1.41.0", "1.43.0.dev20261026"):
    (found,) = support.problems("worker", version)
    assert f"Flower {version} is not a version this code was tested with" in found

  def problems_with(part, target, name, value):
    with monkeypatch.context() as m:
      m.setattr(target, name, value)
      return " | ".join(support.problems(part, cached=False))

  assert "start_client_internal.time is not the time module" in problems_with(
    "supernode", sci, "time", types.SimpleNamespace(sleep=time.sleep)
  )
  assert "_pull_and_store_message takes" in problems_with(
    "supernode", sci, "_pull_and_store_message", lambda state, object_store: None
  )
  # `from time import sleep` in Flower's loop would make a replaced `time` a no-op.
  assert "start_client_internal no longer calls time.sleep" in problems_with(
    "supernode", sci, "start_client_internal", _sleeping
  )
  assert "http_grid.pull_objects is missing" in problems_with(
    "grid", http_grid, "pull_objects", None
  )
  assert "http_grid.pull_objects is not inflatable_utils.pull_objects" in problems_with(
    "grid", http_grid, "pull_objects", lambda *a, **k: {}
  )
  assert "pull_task_input changed" in problems_with(
    "worker", run_clientapp, "pull_task_input", lambda client: None
  )


def test_node_runs_stock_flower_supernode_where_the_check_fails(monkeypatch, tmp_path, caplog):
  """An untested Flower: the node says so and becomes Flower's own flower-supernode (subprocess
  isolation, Flower's own --trusted-entities check), replacing nothing."""
  from fedlap_flower import node  # pylint: disable=g-import-not-at-top
  from fedlap_flower.runtime import supernode  # pylint: disable=g-import-not-at-top

  class Execd(Exception):
    pass

  def execv(path, argv):
    raise Execd(path, argv)

  monkeypatch.setattr(
    node.support,
    "problems",
    lambda part: ("Flower 9.9.9 is not a version this code was tested with",),
  )
  monkeypatch.setattr(supernode.os, "execv", execv)
  trusted = tmp_path / "trusted.yaml"
  trusted.write_text(f"operator: '{Path(str(keys_pub(tmp_path))).read_text().strip()}'\n")
  with pytest.raises(Execd) as got:
    node.main(["--trusted-entities", str(trusted), "--insecure", "--superlink", "x:1"])
  path, argv = got.value.args
  assert Path(path).name == "flower-supernode" and argv[0] == path
  assert argv[1:] == ["--insecure", "--superlink", "x:1", "--host", "127.0.0.1",
                      "--trusted-entities", str(trusted)]  # fmt: skip
  err = caplog.text
  assert "Flower 9.9.9 is not a version" in err
  assert "running Flower's own flower-supernode" in err and "are refused" in err
  import flwr.supernode.start_client_internal as sci  # pylint: disable=g-import-not-at-top

  assert sci.time is time  # nothing of Flower's was replaced


def keys_pub(directory: Path) -> Path:
  ssh_key_pair(directory / "signer", "ed25519")
  return directory / "signer.pub"


class _Beats:
  """A Runtime API client whose task heartbeats answer ``alive`` (then False: stopped)."""

  def __init__(self, alive: int):
    self.alive = alive
    self.calls = 0

  def SendTaskHeartbeat(self, request):  # pylint: disable=invalid-name
    del request
    self.calls += 1
    return SendTaskHeartbeatResponse(success=self.calls <= self.alive)

  def close(self):
    pass


def test_a_stopped_task_is_abandoned_and_reported_stopped(monkeypatch):
  """The heartbeat says the task is no longer alive (flwr stop): run_task returns at once with
  status stopped, pushes no reply, and the ClientApp's computation is left to its thread."""
  fab = types.SimpleNamespace(content=build_fab_from_disk(APP_DIR))
  context = types.SimpleNamespace(run_config=_fused(fab.content, {}), node_config={}, run_id=5)
  client = _Beats(alive=0)
  pushed, outputs = [], []
  monkeypatch.setattr(warm_clientapp, "_client", lambda *a, **k: client)
  monkeypatch.setattr(warm_clientapp, "pull_task_input", lambda c: ("msg", context, None, fab))
  monkeypatch.setattr(warm_clientapp, "push_message", lambda *a: pushed.append(a))
  monkeypatch.setattr(
    warm_clientapp, "push_task_output", lambda **k: outputs.append((k["sub_status"], k["details"]))
  )
  release = threading.Event()

  def client_app(message, context):
    release.wait(60)  # a long round
    return "reply"

  t0 = time.monotonic()
  try:
    status = warm_clientapp.run_task(
      "x:1", "token", client_app, warm_clientapp.Policy(None, allow_unsigned=True),
      insecure=True, certificates=None,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert termination.computing()  # serve() then ends the process
  finally:
    release.set()
  assert status == "stopped" and took < 5, (status, took)
  assert outputs == [("stopped", warm_clientapp.STOPPED_DETAILS)] and not pushed
  stop = termination.TermSignal()
  beat = warm_clientapp.heartbeat_fn(_Beats(alive=1), stop)
  assert beat() and stop.received is None
  assert beat() and stop.received == "task-stopped"

  class Revoked:  # the SuperNode finished the task: its token no longer authenticates
    def SendTaskHeartbeat(self, request):  # pylint: disable=invalid-name
      response = httpx.Response(401, request=httpx.Request("POST", "http://x/heartbeat"))
      raise httpx.HTTPStatusError("401", request=response.request, response=response)

  stop = termination.TermSignal()
  assert not warm_clientapp.heartbeat_fn(Revoked(), stop)() and stop.received == "task-stopped"


class _FailedPushGrid(_SlowGrid):
  """Message 0's push failed (Flower 1.42: None), so did message 2's (later Flower: "")."""

  def push_messages(self, messages):
    super().push_messages(messages)
    return [None, "1", ""]


def test_prompt_grid_does_not_wait_for_messages_whose_push_failed():
  grid = _FailedPushGrid([0.0, 0.1, 0.0])
  t0 = time.time()
  got = PromptGrid(grid, poll=0.05).send_and_receive(["a", "b", "c"], timeout=10)
  assert [r.metadata.reply_to_message_id for r in got] == ["1"]
  assert time.time() - t0 < 2  # not the whole timeout


class _NodeState:
  """The NodeState calls of the run watch: tasks ``(task_id, run_id)``, all running."""

  def __init__(self, tasks):
    self.tasks = [
      types.SimpleNamespace(task_id=t, run_id=r, type=TaskType.CLIENT_APP) for t, r in tasks
    ]
    self.finished, self.replied = [], []

  def get_tasks(self, *, statuses):
    assert set(statuses) == {"starting", "running"}
    return list(self.tasks)

  def finish_task(self, task_id, sub_status, details):
    self.finished.append((task_id, sub_status, details))
    return True

  def _store_error_replies(self, run_ids, error):  # pylint: disable=invalid-name
    self.replied.append((set(run_ids), error.reason))


def test_the_node_stops_the_tasks_of_a_stopped_run():
  """flwr stop: the SuperLink says the run is not running; the node finishes its task there
  stopped and stores an error reply (else Flower's SuperNode would wait for one for ever)."""
  from flwr.supercore.run import RunNotRunningException  # pylint: disable=g-import-not-at-top

  from fedlap_flower.runtime import supernode  # pylint: disable=g-import-not-at-top

  def get_run(run_id):
    if run_id == 2:
      raise RunNotRunningException
    if run_id == 3:
      raise OSError("SuperLink unreachable")  # unknown: left alone, asked again later
    return object()

  state = _NodeState([(10, 1), (20, 2), (30, 3)])
  assert supernode.stop_stopped_runs(state, get_run) == [2]
  assert state.finished == [(20, "stopped", supernode.STOPPED_REASON)]
  assert state.replied == [({2}, supernode.STOPPED_REASON)]
