"""The Flower app against a hostile client, a local account and an oversized or trickled
reply: each check in process, on the function that holds it."""

from __future__ import annotations

import logging
import os
import stat
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import raises_field
from flwr.cli.build import build_fab_from_disk
from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse  # pylint: disable=no-name-in-module

from fake_superlink import FakeSuperLink, prompt_grid_over, reply_objects
from fedlap_flower import ledger as ledger_lib
from fedlap_flower import records as records_lib
from fedlap_flower import settings, signed_runs
from fedlap_flower.runtime import object_pulls, warm_clientapp
from fedlap_jax import accounting
from fedlap_jax.methods.fedlap import radius
from flower_federation import APP_DIR

FINGERPRINT = {"records": "site0"}
PRIVACY = dict(
  noise_multiplier=1.0, batch_size=16, min_client_size=64, steps_per_round=2, delta=1e-5
)


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


def test_the_median_server_radius_needs_three_replies():
  """The median of two radii is their mean: one client at the floor would halve ``r_g``. A
  run that may aggregate two replies under the median is refused by ``min-clients``."""
  median = {"config": "quickstart:nondp", "overrides": "server.radius_strategy=median"}
  for min_clients in (1, 2):
    with pytest.raises(settings.SettingsError) as e:
      settings.run_settings({**median, "min-clients": min_clients})
    assert e.value.field == "min-clients" and e.value.value == min_clients
  assert settings.run_settings({**median, "min-clients": 3}).min_clients == 3
  assert settings.run_settings(median).min_clients == 5  # all five clients of a round
  assert settings.run_settings({"config": "quickstart:nondp", "min-clients": 2}).min_clients == 2
  # The library's median of two is their mean (the simulation, whose clients are its own).
  assert float(radius.server_radius(jnp.array([1e-3, 1.0]), "median", 0.0)) == pytest.approx(0.5005)


def test_the_epsilon_bound_holds_for_every_client_whatever_its_size():
  """What the server bounds a self-reported epsilon by: above both figures of every N_k."""
  m = accounting.DpMechanism(noise_multiplier=1.0, batch_size=16, steps_per_round=5, delta=1e-5)
  assert m.epsilon_bound(0) == 0.0
  for n in (16, 64, 1000):
    for adjacency in ("replace_one", "add_remove"):
      assert m.epsilon_after(3, n, adjacency=adjacency) <= m.epsilon_bound(3)
  assert m.epsilon_bound(3) < m.epsilon_bound(4) < 1e6


@pytest.mark.parametrize(
  "field, value, cap",
  [("client.ipc", 1_000_000, "max-ipc"), ("client.iterations", 10**8, "max-iterations")]
  + [("model.width", 100_000, "max-width")],
)
def test_a_node_refuses_a_run_above_its_compute_caps_before_any_work(
  field, value, cap, tmp_path, monkeypatch
):
  from flwr.app import Message, RecordDict

  from fedlap_flower import client_app
  from flower_harness import TINY, InProcessGrid, node_configs, task_identity

  def no_work(*args):
    raise AssertionError("the client loaded its data or built its model")

  monkeypatch.setattr(client_app, "_setup", no_work)
  rc = {"config": "quickstart:nondp", "overrides": f"{TINY} {field}={value}"}
  grid = InProcessGrid(client_app.app, rc, node_configs(state_root=tmp_path / "state"))
  with task_identity():
    reply = grid.answer(
      Message(content=RecordDict(), dst_node_id=101, message_type="train", group_id="1")
    )
  assert reply.has_error() and f"{field}={value}" in reply.error.reason, reply.error.reason
  assert cap in reply.error.reason
  # The node may allow more; its default admits the paper's largest configs.
  run = settings.run_settings(rc)
  nc = {"partition-id": 0, "num-partitions": 5, "state-dir": str(tmp_path / "s")}
  with pytest.raises(settings.SettingsError) as e:
    settings.node_settings(nc, run)
  assert e.value.field == field and e.value.value == value
  assert settings.node_settings({**nc, cap: value}, run).partition_id == 0
  with pytest.raises(settings.SettingsError) as e:
    settings.node_settings({**nc, cap: 0}, run)
  assert e.value.field == cap
  for name in ("cifar_ablation_ipc:200", "cifar_dp", "cifar_dp_tuned", "fmnist_dp_hybrid"):
    settings.node_settings(nc, settings.run_settings({"config": name}))


def test_a_node_refuses_local_epochs_the_hybrid_would_not_run_before_its_ledger_moves(tmp_path):
  """``client.inner_loop=5`` over the hybrid recipe (``quickstart:dp``, whose model steps along
  the noisy gradients) is refused by that field: by the server's run settings, and by a node
  before it creates its state directory, so no ledger is charged."""
  from flwr.app import Message, RecordDict

  from fedlap_flower import client_app
  from flower_harness import TINY, InProcessGrid, node_configs, task_identity

  rc = {"config": "quickstart:dp", "overrides": f"{TINY} client.inner_loop=5"}
  with raises_field("client.inner_loop"):
    settings.run_settings(rc)
  settings.run_settings({**rc, "overrides": f"{TINY} client.inner_loop=0"})
  grid = InProcessGrid(client_app.app, rc, node_configs(state_root=tmp_path / "state"))
  with task_identity():
    reply = grid.answer(
      Message(content=RecordDict(), dst_node_id=101, message_type="train", group_id="1")
    )
  assert reply.has_error() and "client.inner_loop=5" in reply.error.reason, reply.error.reason
  assert not (tmp_path / "state").exists()


def test_a_node_refuses_a_model_it_does_not_allow_before_any_work(tmp_path, monkeypatch):
  """A node's ``models``: a run asking another ``model.name`` (a ScatterNet costs more per
  example than the ConvNet) is refused by that field, before the client loads its data or
  builds its model; an allowed one proceeds, and the default allows every catalog model."""
  from flwr.app import Message, RecordDict

  from fedlap_flower import client_app
  from fedlap_runs import catalog
  from flower_harness import TINY, InProcessGrid, node_configs, task_identity

  setups = []

  def no_work(*args):
    setups.append(args)
    raise AssertionError("the client loaded its data or built its model")

  monkeypatch.setattr(client_app, "_setup", no_work)
  monkeypatch.delenv(settings.MODELS_ENV, raising=False)
  rc = {"config": "quickstart:nondp", "overrides": f"{TINY} model.name=scatternet_cnn"}
  for allowed in ("convnet", "convnet,scatternet_cnn"):
    nodes = node_configs(state_root=tmp_path / "state", models=allowed)
    with task_identity():
      reply = InProcessGrid(client_app.app, rc, nodes).answer(
        Message(content=RecordDict(), dst_node_id=101, message_type="train", group_id="1")
      )
    assert reply.has_error()
    if allowed == "convnet":  # refused by field, before any work
      assert "model.name='scatternet_cnn'" in reply.error.reason, reply.error.reason
      assert "'models'" in reply.error.reason and not setups, reply.error.reason
  assert len(setups) == 1  # allowed: on to its data
  with raises_field("model.name", settings.SettingsError):
    settings.run_settings(rc, settings.allowed_models({"models": "convnet, scatternet_linear"}))
  for allowed in ("convnet,scatternet_cnn", " scatternet_cnn "):
    settings.run_settings(rc, settings.allowed_models({"models": allowed}))
  assert settings.allowed_models({}) == catalog.MODELS  # the default: every catalog model
  for name in catalog.MODELS:
    features = " data.features=scattering" * (name in catalog.SCATTERED)
    rc = {"config": "quickstart:nondp", "overrides": f"{TINY} model.name={name}{features}"}
    settings.run_settings(rc, settings.allowed_models({}))
  for bad in ("", " , ", "convnet,resnet", "pkg.mod", 3):
    with raises_field("models", settings.SettingsError):
      settings.allowed_models({"models": bad})


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "foreign-owned"])
def test_a_state_dir_whose_parent_another_user_could_change_is_refused(tmp_path, how):
  """Whoever may rename a parent's entries moves the ledger away and the node starts a new
  one: every parent must be root's or ours and written by them alone, or sticky."""
  shared = tmp_path / "shared"
  shared.mkdir(mode=0o700)
  state = ledger_lib.ClientState(shared / "site0")  # a private parent: accepted
  state.spend(state.ledger(FINGERPRINT, **PRIVACY), FINGERPRINT, 1, 100.0, {})
  if how == "foreign-owned":
    if os.geteuid() != 0:
      pytest.skip("chown to another user needs root")
    os.chown(shared, 65534, -1)
  else:
    shared.chmod(0o777 if how == "world-writable" else 0o770)
  with raises_field("state-dir", ledger_lib.LedgerError):  # its parent shared
    ledger_lib.ClientState(shared / "site0")
  with pytest.raises(ledger_lib.LedgerError):  # the record of signed runs lives there too
    signed_runs.admit(shared / "site0", "n" * 32, 1, check_new=lambda: None)
  if how != "foreign-owned":
    shared.chmod(0o1777)  # sticky, as /tmp: no one else may rename what is ours
    assert ledger_lib.ClientState(shared / "site0").history()


# ----------------------------------------------------------------------------
# The ServerApp Grid's pulls of a reply: Flower's HTTP Grid against a fake SuperLink.
# ----------------------------------------------------------------------------


@pytest.fixture
def grid_limits(monkeypatch):
  """The round's pull limits, reset after the test; Flower's HTTP Grid module gets its own
  ``pull_objects`` back (the PromptGrid replaces it for its process, as a ServerApp's does)."""
  from flwr.superlink.grid import http_grid  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
  limits = getattr(object_pulls, "GRID_LIMITS", None)
  yield limits
  if limits is not None:
    limits.__init__()


def test_a_trickled_reply_is_dropped_at_the_deadline_and_the_others_are_taken(grid_limits):
  """The hostile reply (listed first) makes one of its 40 objects available every 0.2 s; the
  honest one is complete. The round's deadline (1 s) bounds the pulls: the trickled reply is
  an error reply, the honest one is taken, the round ends within a second of its deadline."""
  rng = np.random.default_rng(0)
  trickled = reply_objects("m0", {f"a{i}": rng.normal(size=8) for i in range(20)}, node=0)
  honest = reply_objects("m1", {"a": np.ones(100, np.float32)}, node=1)
  order = {i: n for n, i in enumerate(trickled[2])}
  superlink = FakeSuperLink(
    [trickled, honest], available=lambda i, t: i not in order or t >= 0.2 * order[i]
  )
  grid = prompt_grid_over(superlink)
  t0 = time.monotonic()
  got = grid.send_and_receive(["a", "b"], timeout=1.0)
  took = time.monotonic() - t0
  by_id = {m.metadata.reply_to_message_id: m for m in got}
  assert sorted(by_id) == ["m0", "m1"]
  assert by_id["m0"].has_error() and not by_id["m1"].has_error()
  np.testing.assert_array_equal(by_id["m1"].content["update"]["a"].numpy(), np.ones(100))
  assert took < 2.5, took  # Flower's own limit: every object, up to 2 hours
  assert grid_limits.deadline is None  # the deadline is the round's only
  # The honest reply listed only while the trickled one is pulled (pushed at 0.3 s): taken.
  superlink = FakeSuperLink(
    [trickled, honest],
    available=lambda i, t: i not in order or t >= 0.2 * order[i],
    listed=(0, 0.3),
  )
  got = prompt_grid_over(superlink).send_and_receive(["a", "b"], timeout=1.0)
  by_id = {m.metadata.reply_to_message_id: m for m in got}
  assert sorted(by_id) == ["m0", "m1"] and not by_id["m1"].has_error()


def test_a_reply_larger_than_the_update_is_refused_without_being_pulled_whole(grid_limits):
  """The round's update is 400 bytes in 1 array: a reply of 200 arrays is refused before any
  of it is pulled (its tree's object count), one of 3 MB once its bytes pass the bound; the
  honest reply is taken either way."""
  honest = reply_objects("m1", {"a": np.ones(100, np.float32)}, node=1)
  many = reply_objects("m0", {f"a{i}": np.full(2, i, np.float32) for i in range(200)}, node=0)
  big = reply_objects("m0", {"a": np.arange(750_000, dtype=np.float32)}, node=0)
  for hostile, pulled_at_most in ((many, 0), (big, object_pulls.GRID_LIMITS.max_bytes)):
    superlink = FakeSuperLink([hostile, honest])
    grid = prompt_grid_over(superlink)
    grid.limit_replies(400, 1)
    got = {m.metadata.reply_to_message_id: m for m in grid.send_and_receive(["a", "b"], timeout=5)}
    assert got["m0"].has_error() and not got["m1"].has_error()
    assert "allowed: at most" in got["m0"].error.reason, got["m0"].error.reason
    hostile_bytes = sum(n for i, n in superlink.pulled.items() if i in hostile[2])
    limit = pulled_at_most if pulled_at_most is not None else grid_limits.max_bytes
    assert hostile_bytes <= limit + grid_limits.max_object_bytes, hostile_bytes
  assert grid_limits.max_bytes < 3_000_000


@pytest.mark.slow
def test_the_round_bounds_each_reply_by_its_update(tmp_path, grid_limits):
  """The strategy tells the grid what a reply may hold: its update's bytes and arrays (FedLAP's
  wire on the digits: a synthetic set and a radius), and every honest reply fits."""
  from flower_harness import TINY, run_inprocess

  limited = []
  rc = {"config": "quickstart:nondp", "overrides": TINY.replace("rounds=2", "rounds=1")}
  rc["run-dir"] = str(tmp_path / "run")

  def hook(grid):
    grid.limit_replies = lambda update_bytes, arrays: limited.append((update_bytes, arrays))

  records, grid = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  ((update_bytes, arrays),) = limited
  sizes = [records_lib.wire_bytes(r.content["update"]) for r in grid.replies]
  assert arrays == 4 and max(sizes) <= update_bytes + 4 * 256 < 2 * min(sizes), (sizes, limited)


def test_a_state_dir_moved_or_replaced_after_its_check_is_refused(tmp_path):
  """Files are opened relative to the directory's descriptor, opened without following a link
  and checked to be the directory checked first: a state directory renamed away and replaced
  by a fresh one (or by a link to one) is refused, never read as a new ledger."""
  d = tmp_path / "site0"
  state = ledger_lib.ClientState(d)
  state.spend(state.ledger(FINGERPRINT, **PRIVACY), FINGERPRINT, 1, 100.0, {})
  d.rename(tmp_path / "moved")
  d.mkdir(mode=0o700)
  with raises_field("state-dir", ledger_lib.LedgerError):  # moved away
    state.ledger(FINGERPRINT, **PRIVACY)
  with pytest.raises(ledger_lib.LedgerError):
    state.locked().__enter__()
  d.rmdir()
  d.symlink_to(tmp_path / "moved")
  with pytest.raises(OSError):  # O_NOFOLLOW: a link in the directory's place
    state.ledger(FINGERPRINT, **PRIVACY)


@pytest.mark.slow
def test_without_max_epsilon_a_ledger_holding_an_earlier_run_is_accepted(tmp_path):
  """Without the run's max-epsilon the server bounds what this run charged a client (its
  ``run-epsilon``) by what the run's rounds can give any client, not the ledger's total: a
  second run's clients, whose ledgers hold a first run's charges above that bound, are
  accepted and their totals published."""
  import json

  from flower_harness import TINY, node_configs, run_inprocess

  from fedlap_flower import task

  nodes = node_configs(state_root=tmp_path / "state", **{"max-epsilon": 50.0})
  one = TINY.replace("rounds=2", "rounds=1")

  def run(name, run_id):
    rc = {"config": "quickstart:dp", "overrides": one, "run-dir": str(tmp_path / name)}
    return run_inprocess(rc, nodes, run_id=run_id), rc

  run("first", 7)
  for node in nodes.values():  # the first run also charged a long round (60 of these rounds)
    state = ledger_lib.ClientState(node["state-dir"])
    stored = json.loads((state.directory / ledger_lib.LEDGER_FILE).read_text())
    privacy = accounting.PrivacyLedger.from_dict(stored["ledger"]).privacy_fields()
    with state.locked():
      ledger = state.ledger(stored["fingerprint"], **privacy)
      steps = 60 * ledger.steps[0]
      state.spend(ledger, stored["fingerprint"], steps, 50.0, {"run_id": 7, "server_round": 2})
  (records, grid), rc = run("second", 8)
  plan = task.server_run(settings.run_settings(rc).cfg)[0]
  mechanism = accounting.DpMechanism.from_config(plan.config)
  bound = mechanism.epsilon_bound(1)
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4], records[0]
  totals = records[0]["epsilon_per_client"]
  assert bound < min(totals.values()) and max(totals.values()) < 50.0, (bound, totals)
  for reply in grid.replies:  # this run's part: one round of a fresh ledger
    got = reply.content["metrics"]
    size = ledger_lib.ClientState(nodes[reply.metadata.src_node_id]["state-dir"])
    n = json.loads((size.directory / ledger_lib.LEDGER_FILE).read_text())["ledger"]
    fresh = mechanism.epsilon_after(1, n["min_client_size"])
    assert got["run-epsilon"] == fresh < bound < got["epsilon"] == totals[str(got["partition-id"])]


@pytest.mark.parametrize("where", ["runs", "run"])
def test_a_link_planted_at_a_carried_states_directory_is_refused_not_followed(tmp_path, where):
  """The carried states' ``runs/<run>`` directories are opened relative to the state
  directory's descriptor without following a link: a link planted at ``runs`` or at
  ``runs/<run>`` is refused naming state-dir, and nothing is written or read through it."""
  from fedlap_jax.checks import ConfigError
  from fedlap_jax.method import Wire

  run = "0123456789abcdef0123456789abcdef"
  state = ledger_lib.ClientState(tmp_path / "c0")
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / run).mkdir(parents=True)
  x = np.ones((2, 3), np.float32)
  np.savez(elsewhere / run / "carried-1.npz", x=x, __round__=np.asarray(1, np.int64))
  link = state.directory / "runs" if where == "runs" else state.directory / "runs" / run
  if where == "run":
    link.parent.mkdir(mode=0o700)
  link.symlink_to(elsewhere if where == "runs" else elsewhere / run)
  before = sorted(p.name for p in (elsewhere / run).iterdir())
  wire = Wire.of({"x": x})
  for touch in (
    lambda: state.save_carried(run, 2, {"x": x}),
    lambda: state.load_carried(run, 1, wire),
    lambda: state.carried_rounds(run),
    lambda: state.drop_carried(run, [1]),
  ):
    with pytest.raises(ConfigError) as e:
      touch()
    assert e.value.field == "state-dir", e.value
  assert sorted(p.name for p in (elsewhere / run).iterdir()) == before == ["carried-1.npz"]
  # Without the link the same calls work, the directories made 0700.
  link.unlink()
  state.save_carried(run, 2, {"x": x})
  assert state.carried_rounds(run) == [2]
  np.testing.assert_array_equal(state.load_carried(run, 2, wire)["x"], x)
  state.drop_carried(run, [2])
  assert state.carried_rounds(run) == []
  assert stat.S_IMODE((state.directory / "runs" / run).stat().st_mode) == 0o700


@pytest.mark.parametrize("declare_length", [False, True])
def test_one_oversized_object_is_refused_before_it_is_read_whole(grid_limits, declare_length):
  """One object of a reply is 20 MB where the round allows one 5 MiB chunk and its header:
  Flower's HTTP Grid (its Runtime API client over HTTP) stops reading its response at the
  bound, or reads none of it when the response declares its length; the reply is Flower's
  error reply for it and the honest one is taken."""
  from fake_superlink import over_http

  honest = reply_objects("m1", {"a": np.ones(100, np.float32)}, node=1)
  hostile = reply_objects("m0", {"a": np.full(100, 2.0, np.float32)}, node=0)
  first = max(hostile[2], key=lambda i: len(hostile[2][i]))  # its array's one chunk
  hostile[2][first] = b"\0" * 20_000_000
  superlink = FakeSuperLink([hostile, honest])
  grid = prompt_grid_over(superlink)
  grid.grid._client = http = over_http(superlink, declare_length=declare_length)
  grid.limit_replies(400, 1)
  got = {m.metadata.reply_to_message_id: m for m in grid.send_and_receive(["a", "b"], timeout=5)}
  assert got["m0"].has_error() and not got["m1"].has_error()
  assert "allowed: at most" in got["m0"].error.reason, got["m0"].error.reason
  cap = grid_limits.max_object_bytes + object_pulls.RESPONSE_OVERHEAD
  sent = http.sent.get(first, 0)  # what the transport had sent of its 20 MB when refused
  assert sent == 0 if declare_length else cap < sent <= cap + 2**16, (sent, cap)
  np.testing.assert_array_equal(got["m1"].content["update"]["a"].numpy(), np.ones(100))
