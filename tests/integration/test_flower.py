"""The Flower app's protocol, in process: settings, ledgers, same numbers as experiments.run.

The ServerApp runs against the real ClientApp through
:class:`flower_harness.InProcessGrid` (no SuperLink, no Ray); the two engines
with real processes are in ``test_flower_engines.py``.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util
from flwr.app import Array, Context, RecordDict

from flower_harness import SMALL_MODEL, TINY, node_configs, read_jsonl, reference_run, run_inprocess
from fedlap_flower import ledger as ledger_lib
from fedlap_flower import settings, strategy
from fedlap_jax import accounting
from conftest import raises_field

DP_ALLOWED_METRICS = {"partition-id", "epsilon", "run-epsilon", "max-epsilon", "dp-steps"}


# A federated run's identity (fedlap_flower.federated_runs).
RUN = "0123456789abcdef0123456789abcdef"


def _federated_run(run_dir) -> str:
  """The identity of the federated run in ``run_dir`` (its clients keep their state under it)."""
  return json.loads((Path(run_dir) / "run_info.json").read_text())["federated_run"]


def _run_config(tmp_path, config, overrides=TINY, **extra):
  return {"config": config, "overrides": overrides, "run-dir": str(tmp_path / "run"), **extra}


@pytest.fixture(scope="module")
def shared_reference(tmp_path_factory):
  """``experiments.run``'s result (:func:`flower_harness.reference_result`) of ``(config,
  overrides)``, computed once for this file: the tests comparing a Flower run of the same
  config with it (its numbers, its epsilon) share one reference run."""
  from flower_harness import reference_result

  done = {}

  def result(config: str, overrides: str) -> dict:
    if (config, overrides) not in done:
      done[config, overrides] = reference_result(config, overrides, tmp_path_factory.mktemp("ref"))
    return done[config, overrides]

  return result


# ----------------------------------------------------------------------------
# Settings.
# ----------------------------------------------------------------------------


def test_settings_map_onto_the_named_configs(tmp_path):
  run = settings.run_settings(
    {
      "config": "quickstart:dp_loops",
      "overrides": "seed=3 client.batch_loop=2 data.source=sklearn "
      "snapshot_rounds=(1,2) plots=false",
    }
  )
  assert run.label == "quickstart_dp_loops" and run.dp and run.num_clients == 5
  assert run.cfg.seed == 3 and run.cfg.client.batch_loop == 2
  assert tuple(run.cfg.snapshot_rounds) == (1, 2) and run.cfg.plots is False
  assert run.min_clients == 5 and run.max_epsilon == math.inf
  node = settings.node_settings(
    {
      "partition-id": 2,
      "num-partitions": 5,
      "max-epsilon": 4.0,
      "state-dir": str(tmp_path / "mine"),
    },
    settings.run_settings({"config": "quickstart:dp_loops", "max-epsilon": 3.0}),
  )
  # The client keeps the smaller cap: a server can lower it, never raise it.
  assert node.max_epsilon == 3.0
  assert node.state_dir == tmp_path / "mine"


@pytest.mark.parametrize(
  "run_config, field",
  [
    ({"config": "quickstart"}, "config"),
    ({"config": "nosuch"}, "config"),
    ({"config": "quickstart:dp_loops", "overrides": "client.nosuch=1"}, "overrides"),
    ({"config": "quickstart:dp_loops", "overrides": "seed"}, "overrides"),
    ({"config": "quickstart:dp_loops", "overrides": "rounds=abc"}, "rounds"),
    ({"config": "quickstart:dp_loops", "min-clients": 6}, "min-clients"),
    ({"config": "quickstart:dp_loops", "round-timeout": 0.0}, "round-timeout"),
    ({"config": "quickstart:dp_loops", "max-epsilon": -1.0}, "max-epsilon"),
    ({"config": "quickstart:dp_loops", "colour": "red"}, "run config"),
    ({"config": "quickstart:dp:x"}, "config"),
  ],
)
def test_bad_run_config_is_refused_by_name(run_config, field):
  with raises_field(field, settings.SettingsError):
    settings.run_settings(run_config)


def test_the_hybrid_dp_recipe_is_a_flower_run_config():
  """quickstart:dp (the hybrid recipe: the clients also send model deltas) loads as it is."""
  run = settings.run_settings({"config": "quickstart:dp"})
  assert run.label == "quickstart_dp" and run.dp
  assert run.cfg.server.start == "fedavg_delta" and run.cfg.client.model_steps == "noisy_real"


def test_bad_config_values_fail_the_experiments_validation():

  with raises_field("client.ipc"):
    settings.run_settings({"config": "quickstart:dp_loops", "overrides": "client.ipc=0"})


@pytest.mark.parametrize(
  "node_config, field",
  [
    ({"num-partitions": 5}, "partition-id"),
    ({"partition-id": 5, "num-partitions": 5}, "partition-id"),
    ({"partition-id": 0, "num-partitions": 4}, "num-partitions"),
    ({"partition-id": 0, "num-partitions": 5, "data-path": "/no/such.npz"}, "data-path"),
    ({"partition-id": 0, "num-partitions": 5, "max-epsilon": 0}, "max-epsilon"),
    ({"partition-id": 0, "num-partitions": 5, "max-delta": 1.0}, "max-delta"),
    ({"partition-id": 0, "num-partitions": 5, "max-delta": "1e-6"}, "max-delta"),
    ({"partition-id": 0, "num-partitions": 5, "gpu": 1}, "node config"),
  ],
)
def test_bad_node_config_is_refused_by_name(node_config, field, tmp_path):
  run = settings.run_settings({"config": "quickstart:dp_loops"})
  with raises_field(field, settings.SettingsError):
    settings.node_settings({"state-dir": str(tmp_path), **node_config}, run)


# A user's model (tests/user_models.py), named as experiments.run names it.
USER_MODEL = "user_models:mlp"


def test_a_user_model_a_side_does_not_allow_is_refused_by_its_field_before_import(
  tmp_path, monkeypatch
):
  """model.name=MODULE:ATTR would import code the run's submitter chose: the server takes it
  only where its environment allows that exact string, a client only where its node config
  does (which takes the place of its environment's); else refused by model.name before the
  module is imported, though it imports."""
  import sys

  from fedlap_flower import client_app

  (tmp_path / "planted_model.py").write_text(
    (Path(__file__).parents[1] / "user_models.py").read_text()
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  planted = "planted_model:mlp"
  rc = {"config": "quickstart:nondp", "overrides": f"model.name={planted}"}
  monkeypatch.setenv(settings.MODELS_ENV, f"{USER_MODEL}, {planted}:other")
  with raises_field("model.name", settings.SettingsError):  # the server's environment
    settings.run_settings(rc, settings.allowed_models())
  monkeypatch.setenv(settings.MODELS_ENV, planted)  # a node's own node config decides
  node = {"partition-id": 0, "num-partitions": 5, "models": USER_MODEL}
  context = Context(run_id=7, node_id=101, node_config=node, state=RecordDict(), run_config=rc)
  for handler in (client_app.query, client_app.train):
    with raises_field("model.name", settings.SettingsError):
      handler(None, context)
  assert "planted_model" not in sys.modules
  assert settings.allowed_models() == (planted,)
  assert settings.run_settings({"config": "quickstart:nondp"}).cfg.model.name == "convnet"
  for bad in ("user_models", "", ":mlp", 3):
    with raises_field("models", settings.SettingsError):
      settings.allowed_models({"models": bad})
  monkeypatch.setenv(settings.MODELS_ENV, "user_models.mlp")
  with raises_field(settings.MODELS_ENV, settings.SettingsError):
    settings.allowed_models()


def test_a_client_takes_its_state_dir_from_itself_only(tmp_path, monkeypatch):
  """state-dir comes from the client (node config, or its own environment), never from the
  run config: under DP renaming the config cannot reset a ledger; without DP and without
  either, it is a fixed place in the client user's home."""
  monkeypatch.delenv(settings.STATE_ROOT_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  dp = settings.run_settings({"config": "quickstart:dp_loops"})
  with pytest.raises(settings.SettingsError) as err:
    settings.node_settings({"partition-id": 1, "num-partitions": 5}, dp)
  assert err.value.field == "state-dir" and "state-dir is missing" in str(err.value)
  monkeypatch.setenv(settings.STATE_ROOT_ENV, str(tmp_path / "own"))
  node = settings.node_settings({"partition-id": 1, "num-partitions": 5}, dp)
  assert node.state_dir == tmp_path / "own" / "client-1"
  # Without DP (a carried synthetic set only): ~/.fedlap_flower/<label>/client-<k>, each
  # directory the client creates 0700 and checks as any state-dir.
  monkeypatch.delenv(settings.STATE_ROOT_ENV)
  nondp = settings.run_settings({"config": "quickstart:nondp"})
  node = settings.node_settings({"partition-id": 1, "num-partitions": 5}, nondp)
  root = tmp_path / "home" / ".fedlap_flower"
  assert node.state_dir == root / "quickstart_nondp" / "client-1"
  ledger_lib.ClientState(node.state_dir)
  for d in (root, root / "quickstart_nondp", node.state_dir):
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
  # max-delta: the node's own, else min(1e-5, 1 / N_k).
  assert node.delta_bound(274) == 1e-5 and node.delta_bound(200_000) == 1 / 200_000
  own = settings.node_settings({"partition-id": 1, "num-partitions": 5, "max-delta": 1e-7}, nondp)
  assert own.delta_bound(274) == 1e-7


def test_a_run_config_naming_a_client_directory_is_refused(tmp_path, monkeypatch):
  """state-root once put a non-DP client's state where the run config said; a run config
  carrying it is refused, on the server and on every client, and nothing is created there."""
  monkeypatch.delenv(settings.STATE_ROOT_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  there = tmp_path / "named"
  rc = {**_run_config(tmp_path, "quickstart:nondp"), "state-root": str(there)}
  with pytest.raises(settings.SettingsError) as err:
    settings.run_settings(rc)
  assert err.value.field == "state-root"
  text = str(err.value)
  assert "\n" not in text and "'state-root' is not allowed" in text
  assert "state-dir" in text and settings.STATE_ROOT_ENV in text
  with raises_field("state-root", settings.SettingsError):
    run_inprocess(rc, node_configs())
  # A client asked directly (as if the server let it through) refuses it too.
  from flwr.app import ConfigRecord, Message, MessageType, RecordDict
  from flower_harness import InProcessGrid, task_identity
  from fedlap_flower import client_app

  grid = InProcessGrid(client_app.app, rc, node_configs())
  conf = {"server-round": 1, "keys": "server"}
  with task_identity():
    reply = grid.answer(
      Message(
        content=RecordDict({"config": ConfigRecord(conf)}),
        message_type=MessageType.TRAIN,
        dst_node_id=101,
      )
    )
  assert reply.has_error() and "'state-root' is not allowed" in reply.error.reason
  assert not there.exists() and not (tmp_path / "home").exists()


@pytest.mark.parametrize(
  "label", ["..", ".", "../x", "a/b", "/abs", "", ".hidden", "x\x00y", "caf\u00e9", "a" * 201]
)
def test_a_label_that_could_leave_the_default_state_root_is_refused(label, tmp_path, monkeypatch):
  """The default state-dir is ~/.fedlap_flower/<label>/client-<k>, and the label comes from
  the run config: it must be one plain name, else the client refuses (never rewrites) it."""
  import dataclasses

  monkeypatch.delenv(settings.STATE_ROOT_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  run = dataclasses.replace(settings.run_settings({"config": "quickstart:nondp"}), label=label)
  with raises_field("config", settings.SettingsError):
    settings.node_settings({"partition-id": 0, "num-partitions": 5}, run)
  assert settings.default_state_dir("quickstart_dp_loops", 3) == (
    tmp_path / ".fedlap_flower" / "quickstart_dp_loops" / "client-3"
  )
  assert not (tmp_path / ".fedlap_flower").exists()


def test_app_pyproject_lists_every_run_config_key():
  tomllib = pytest.importorskip("tomllib")
  from flower_federation import APP_DIR

  with open(APP_DIR / "pyproject.toml", "rb") as f:
    app = tomllib.load(f)["tool"]["flwr"]["app"]
  assert app["config"] == settings.RUN_CONFIG_DEFAULTS
  assert app["components"] == {
    "serverapp": "fedlap_flower.server_app:app",
    "clientapp": "fedlap_flower.client_app:app",
  }


# ----------------------------------------------------------------------------
# The client's state directory.
# ----------------------------------------------------------------------------

# T = 1: one RDP computation per round keeps these tests fast.
PRIVACY = dict(
  noise_multiplier=1.0, batch_size=64, min_client_size=274, steps_per_round=1, delta=1e-5
)
FINGERPRINT = {"data": "partition", "index": 0, "num_records": 274}


def test_ledger_is_spent_before_use_persisted_and_restored(tmp_path):
  state = ledger_lib.ClientState(tmp_path / "c0")
  led = state.ledger(FINGERPRINT, **PRIVACY)
  eps1 = state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 1})
  eps2 = state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 2})
  ref = accounting.PrivacyLedger(**PRIVACY)
  assert (eps1, eps2) == (ref.record_round(), ref.record_round())
  # A new process (a restarted SuperNode) finds the same ledger on disk.
  again = ledger_lib.ClientState(tmp_path / "c0").ledger(FINGERPRINT, **PRIVACY)
  assert again.rounds == 2 and again.epsilon == eps2
  assert [h["server_round"] for h in state.history()] == [1, 2]
  # Refused: the epsilon *after* the round would pass the cap; nothing is recorded.
  before = (tmp_path / "c0" / ledger_lib.LEDGER_FILE).read_text()
  with pytest.raises(ledger_lib.BudgetExceeded) as e:
    state.spend(again, FINGERPRINT, 1, 4.0, {"server_round": 3})  # 3.74 -> 4.25
  assert e.value.max_epsilon == 4.0 and e.value.epsilon_after > 4.0
  assert (tmp_path / "c0" / ledger_lib.LEDGER_FILE).read_text() == before
  assert again.rounds == 2


def test_ledger_refuses_other_records_other_settings_and_tampering(tmp_path):
  state = ledger_lib.ClientState(tmp_path)
  led = state.ledger(FINGERPRINT, **PRIVACY)
  state.spend(led, FINGERPRINT, 1, 100.0, {})
  with raises_field("fingerprint", ledger_lib.LedgerError):  # other records
    state.ledger({**FINGERPRINT, "index": 1}, **PRIVACY)
  with raises_field("noise_multiplier", ledger_lib.LedgerError):
    state.ledger(FINGERPRINT, **{**PRIVACY, "noise_multiplier": 2.0})
  # Another T per round composes (the ledger stores T per round).
  assert state.ledger(FINGERPRINT, **{**PRIVACY, "steps_per_round": 2}).rounds == 1
  path = tmp_path / ledger_lib.LEDGER_FILE
  stored = json.loads(path.read_text())
  stored["ledger"]["epsilons"][0] /= 2
  path.write_text(json.dumps(stored))
  with raises_field(ledger_lib.LEDGER_FILE, ledger_lib.LedgerError):  # tampered
    state.ledger(FINGERPRINT, **PRIVACY)
  path.write_text("{not json")
  with raises_field(ledger_lib.LEDGER_FILE, ledger_lib.LedgerError):  # not JSON
    state.ledger(FINGERPRINT, **PRIVACY)


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "foreign-owned"])
def test_a_state_dir_another_user_could_change_is_refused(tmp_path, how):
  d = tmp_path / "state"
  d.mkdir(mode=0o700)
  if how == "foreign-owned":
    if os.geteuid() != 0:
      pytest.skip("chown to another user needs root")
    os.chown(d, 12345, -1)
  else:
    d.chmod(0o770 if how == "group-writable" else 0o707)
  with raises_field("state-dir", ledger_lib.LedgerError):
    ledger_lib.ClientState(d)
  # The node config's state-dir goes through the same check on the client.
  rc = {"config": "quickstart:dp_loops"}
  node = settings.node_settings(
    {"partition-id": 0, "num-partitions": 5, "state-dir": str(d)}, settings.run_settings(rc)
  )
  with pytest.raises(ledger_lib.LedgerError):
    ledger_lib.ClientState(node.state_dir)


def test_state_files_are_the_owners_alone_and_links_planted_there_are_not_followed(tmp_path):
  """A link planted where the ledger's temporary file was predictable, or where the journal
  goes, must not redirect a write; every file is 0600, every directory 0700."""
  d = tmp_path / "c0"
  state = ledger_lib.ClientState(d)
  target = tmp_path / "elsewhere.txt"
  target.write_text("not the ledger")
  for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old name: .privacy_ledger.json.tmpPID
    (d / f".{ledger_lib.LEDGER_FILE}.tmp{pid}").symlink_to(target)
  led = state.ledger(FINGERPRINT, **PRIVACY)
  state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 1})
  state.save_carried(RUN, 1, {"x": np.zeros((2, 8, 8, 1), np.float32)})
  with state.locked():
    pass
  assert target.read_text() == "not the ledger"
  ledger_file = d / ledger_lib.LEDGER_FILE
  assert ledger_file.is_file() and not ledger_file.is_symlink()
  assert json.loads(ledger_file.read_text())["ledger"]["rounds"] == 1
  files = [ledger_file, d / ledger_lib.JOURNAL_FILE, d / ".lock", state.carried_path(RUN, 1)]
  assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o600 for f in files}
  for sub in (d, d / "runs", d / "runs" / RUN):
    assert stat.S_IMODE(sub.stat().st_mode) == 0o700, sub
  # A link in the journal's place: the append refuses it (and writes nothing there).
  (d / ledger_lib.JOURNAL_FILE).unlink()
  (d / ledger_lib.JOURNAL_FILE).symlink_to(target)
  ledger_lib._HIGH_WATER.clear()
  with pytest.raises(OSError):
    state._append_journal(led)
  assert target.read_text() == "not the ledger"


def test_round_keys_hold_128_bits_of_os_entropy(monkeypatch):
  """Every DP round key is 16 fresh bytes of the operating system's entropy, all of them in
  the key (a threefry key would keep 64 bits), never a function of a count on disk."""
  import secrets

  import jax

  drawn = []

  def token_bytes(n):
    drawn.append(os.urandom(n))
    return drawn[-1]

  monkeypatch.setattr(secrets, "token_bytes", token_bytes)
  k1, k2 = ledger_lib.fresh_round_key(), ledger_lib.fresh_round_key()
  assert [len(b) for b in drawn] == [16, 16]
  for key, raw in zip((k1, k2), drawn):
    assert np.asarray(jax.random.key_data(key)).tobytes() == raw
  assert drawn[0] != drawn[1]
  assert jax.random.normal(k1, (3,)).shape == (3,)


def _spend_two_rounds(state):
  led = state.ledger(FINGERPRINT, **PRIVACY)
  state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 1})
  state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 2})
  return led


def test_a_ledger_rolled_back_alone_is_refused(tmp_path):
  """The journal's high-water mark (and this process's) outlives a restored ledger file."""
  state = ledger_lib.ClientState(tmp_path / "c")
  led = state.ledger(FINGERPRINT, **PRIVACY)
  state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 1})
  path = tmp_path / "c" / ledger_lib.LEDGER_FILE
  after_one = path.read_text()
  state.spend(led, FINGERPRINT, 1, 100.0, {"server_round": 2})
  path.write_text(after_one)  # a backup of round 1 put back
  with raises_field(ledger_lib.LEDGER_FILE, ledger_lib.LedgerError):  # spent went down
    state.ledger(FINGERPRINT, **PRIVACY)
  ledger_lib._HIGH_WATER.clear()  # a restarted process: the journal alone still refuses
  with raises_field(ledger_lib.LEDGER_FILE, ledger_lib.LedgerError):  # below the journal
    ledger_lib.ClientState(tmp_path / "c").ledger(FINGERPRINT, **PRIVACY)
  path.unlink()  # no ledger at all: not a fresh start while the journal holds rounds
  with raises_field(ledger_lib.LEDGER_FILE, ledger_lib.LedgerError):  # spent went down
    ledger_lib.ClientState(tmp_path / "c").ledger(FINGERPRINT, **PRIVACY)


def test_a_ledger_without_its_journal_is_refused_and_a_torn_append_is_not(tmp_path):
  state = ledger_lib.ClientState(tmp_path / "c")
  _spend_two_rounds(state)
  journal = tmp_path / "c" / ledger_lib.JOURNAL_FILE
  lines = journal.read_text().splitlines()
  assert [json.loads(l)["rounds"] for l in lines] == [1, 2]
  journal.write_text(journal.read_text() + '{"rounds": 3, "ste')  # a crash mid-append
  ledger_lib._HIGH_WATER.clear()
  assert ledger_lib.ClientState(tmp_path / "c").ledger(FINGERPRINT, **PRIVACY).rounds == 2
  journal.unlink()
  with raises_field(ledger_lib.JOURNAL_FILE, ledger_lib.LedgerError):  # missing
    ledger_lib.ClientState(tmp_path / "c").ledger(FINGERPRINT, **PRIVACY)


def test_ledger_file_and_directory_are_fsynced(tmp_path, monkeypatch):
  synced = []
  real = os.fsync

  def fsync(fd):
    synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
    return real(fd)

  monkeypatch.setattr(os, "fsync", fsync)
  state = ledger_lib.ClientState(tmp_path / "state")
  synced.clear()
  state.write_json("x.json", {"a": 1})
  assert synced == [False, True]  # the file, then its directory after os.replace


def test_a_ledger_of_the_other_adjacency_continues_with_this_one(tmp_path):
  state = ledger_lib.ClientState(tmp_path / "c")
  _spend_two_rounds(state)  # an add/remove ledger (PRIVACY)
  led = state.ledger(FINGERPRINT, **PRIVACY, adjacency="replace_one")
  assert led.adjacency == "replace_one" and led.steps == [1, 1]
  ref = accounting.PrivacyLedger(**PRIVACY, adjacency="replace_one")
  assert led.epsilons == [ref.record_round(), ref.record_round()]


# ----------------------------------------------------------------------------
# The protocol end to end, in process.
# ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_nondp_rounds_equal_experiments_run_bit_for_bit(tmp_path):
  """Without DP the server sends the round plan's keys (the FedLAP round's): every number is the
  same."""
  rc = _run_config(tmp_path, "quickstart:nondp")
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = reference_run("quickstart:nondp", TINY, tmp_path / "ref")
  assert [r["round"] for r in records] == [1, 2]
  for got, want in zip(records, ref):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["server_radius"] == want["server_radius"]
    assert got["client_radius"] == want["client_radius"]
    assert got["server_steps"] == want["server_steps"]
    assert got["epsilon"] is None and got["clients_ok"] == [0, 1, 2, 3, 4]
  # Bytes: 5 synthetic sets of 20 8x8x1 float32 images + labels + masks, and r_k, per round.
  assert records[0]["upload_bytes"] == 5 * (20 * 64 * 4 + 20 * 4 + 20 + 4)
  with np.load(tmp_path / "run" / "final_params.npz") as f:  # the model sent to each client
    assert records[0]["model_bytes"] == sum(a.nbytes for a in f.values())
  reply = grid.replies[0]
  assert reply.content["metrics"]["num-examples"] > 0  # non-DP clients report N_k


def _experiments_run(config: str, overrides: str, workdir) -> tuple[list[dict], dict]:
  """``experiments.run``'s way with a config (its one-run path, calibration included):
  ``(records, config.json)``."""
  from experiments import suite

  cfg, label = settings.load_config(config, overrides)
  cfg.unlock()
  cfg.plots = False
  cfg.progress_bar = False
  assert suite.run_config(cfg, str(workdir), label) == 0
  return read_jsonl(workdir / "metrics.jsonl"), json.loads((workdir / "config.json").read_text())


@pytest.mark.slow
def test_a_target_epsilon_calibrates_the_flower_run_as_experiments_run(tmp_path):
  """dp.target_epsilon: server and clients calibrate as experiments.run does (the sigma that
  meets the target at min_k N_k), so the noise, the ledgers and the epsilon are its own."""
  overrides = TINY.replace("rounds=2", "rounds=1") + " dp.target_epsilon=5.0"
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-epsilon": 50.0})
  records, _ = run_inprocess(rc, state_root=tmp_path / "state")
  ref, ref_cfg = _experiments_run("quickstart:dp_loops", overrides, tmp_path / "ref")
  sigma = ref_cfg["dp"]["noise_multiplier"]
  assert sigma != 1.0  # the config's own sigma: calibrated away
  info = json.loads((tmp_path / "run" / "run_info.json").read_text())
  assert info["config_values"]["dp"]["noise_multiplier"] == sigma
  assert info["calibration"].startswith("calibrated: dp.target_epsilon=5 -> ")
  for k in range(5):  # every client's noise and ledger: the same sigma
    stored = (tmp_path / "state" / f"client-{k}" / ledger_lib.LEDGER_FILE).read_text()
    assert json.loads(stored)["ledger"]["noise_multiplier"] == sigma
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4]
  assert records[-1]["epsilon"] == ref[-1]["epsilon"] <= 5.0


def _own_data_sites(tmp_path, num: int = 5) -> tuple[dict, str]:
  """Digits as 8x8 uint8 'mnist' in one npz per client (and the server's own npz): the node
  configs of clients holding their own records, and the server npz's path."""
  from fedlap_runs import data as data_lib

  digits = data_lib.load_digits()
  x_train, y_train, x_test, y_test = (
    (a * 255).round().astype(np.uint8) if a.ndim == 4 else a for a in digits
  )
  np.savez(tmp_path / "server.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  nodes = {}
  for k, idx in enumerate(
    data_lib.partition(y_train, num_clients=num, scheme="paper", num_classes=10)
  ):
    np.savez(tmp_path / f"site{k}.npz", x_train=x_train[idx], y_train=y_train[idx])
    nodes[101 + k] = {
      "partition-id": k,
      "num-partitions": num,
      "max-epsilon": 50.0,
      "data-path": str(tmp_path / f"site{k}.npz"),
      "state-dir": str(tmp_path / "state" / f"client-{k}"),
    }
  return nodes, str(tmp_path / "server.npz")


OWN_DATA = " data.name=mnist data.normalisation=published data.source=tfds"


@pytest.mark.slow
def test_a_party_without_the_client_sizes_refuses_a_target_epsilon(tmp_path, monkeypatch):
  """Calibrating dp.target_epsilon needs min_k N_k: a client holding its own records and a
  server reading its own data do not know it, and refuse the target by name (no guess)."""
  from flower_harness import InProcessGrid, serve_with, task_identity
  from flwr.app import Message, RecordDict

  from fedlap_flower import client_app

  nodes, server_npz = _own_data_sites(tmp_path)
  overrides = TINY.replace("rounds=2", "rounds=1") + OWN_DATA + " dp.target_epsilon=5.0"
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"min-clients": 1})
  why = "dp.target_epsilon=5.0 cannot be calibrated here: this party does not hold"
  grid = InProcessGrid(client_app.app, rc, nodes)
  with task_identity():  # a client, asked for a round
    reply = grid.answer(
      Message(content=RecordDict(), dst_node_id=101, message_type="train", group_id="1")
    )
  assert reply.has_error() and "ConfigError: " + why in reply.error.reason, reply.error.reason
  assert "min_k N_k" in reply.error.reason
  monkeypatch.setenv(settings.SERVER_DATA_ENV, server_npz)
  with raises_field("dp.target_epsilon", accounting.ConfigError) as err:  # the server, at its start
    serve_with(InProcessGrid(client_app.app, rc, nodes), rc)
  assert err.value.value == 5.0
  assert not (tmp_path / "state").exists()  # no client computed, nothing was charged


# The hybrid (quickstart:dp) at toy size: a 1-block ConvNet of width 8, T = 2 noisy accesses
# a round, 2 rounds, 1 server epoch; DSA as the recipe has it (matching and server on, real
# batches off), so the clients must draw the round's shared DSA family as experiments.run does.
HYBRID_TINY = (
  "rounds=2 model.width=8 model.depth=1 client.max_outer=2 client.boost_loop=2 "
  "server.max_epochs=1 eval_chunk_size=128"
)


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_hybrid_dp_rounds_equal_experiments_run_with_unsafe_server_keys(tmp_path, monkeypatch):
  """server.start='fedavg_delta': each client sends its model delta with its synthetic set;
  the server starts from w_g + the mean delta, as experiments.run does (bit for bit)."""
  monkeypatch.setenv(settings.UNSAFE_ENV, "1")
  rc = _run_config(
    tmp_path,
    "quickstart:dp",
    overrides=HYBRID_TINY,
    **{"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  )
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = reference_run("quickstart:dp", HYBRID_TINY, tmp_path / "ref")
  assert [r["round"] for r in records] == [1, 2]
  for got, want in zip(records, ref):
    assert got["clients_ok"] == [0, 1, 2, 3, 4]
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["epsilon"] == want["epsilon"]
  # Every reply's update carries the delta, one float32 array per parameter leaf of the
  # model's shapes, and nothing else beyond the synthetic set, r_k and the DP metrics.
  with np.load(tmp_path / "run" / "final_params.npz") as f:
    shapes = {f"model_delta.{k}": v.shape for k, v in f.items()}
  for reply in grid.replies:
    assert set(reply.content.keys()) == {"metrics", "status", "update"}
    update = reply.content["update"]
    delta = {k: a for k, a in update.items() if k.startswith("model_delta.")}
    assert {k: tuple(a.shape) for k, a in delta.items()} == shapes
    assert all(a.dtype == "float32" for a in delta.values())
    assert set(update) - set(delta) == {"synthetic.x", "synthetic.y", "synthetic.mask", "radius"}
    assert any(np.abs(a.numpy()).max() > 0 for a in delta.values())
    assert set(reply.content["metrics"]) <= DP_ALLOWED_METRICS
  model_bytes = records[0]["model_bytes"]
  assert records[0]["upload_bytes"] == 5 * (model_bytes + 20 * 64 * 4 + 20 * 4 + 20 + 4)


def test_parameters_travel_packed_into_one_array():
  """One float32 Array, the leaves raveled in sorted path order; unpacked with the template."""
  from fedlap_flower import records

  params = {
    "dense": {"bias": np.array([6.0, 7.0], np.float32)},
    "conv": {"kernel": np.arange(6, dtype=np.float32).reshape(3, 2, 1)},
  }
  record = records.params_to_record(params)
  assert list(record.keys()) == ["params"] and record["params"].dtype == "float32"
  np.testing.assert_array_equal(record["params"].numpy(), np.arange(8, dtype=np.float32))
  template = {
    "conv": {"kernel": np.zeros((3, 2, 1), np.float32)},
    "dense": {"bias": np.zeros(2, np.float32)},
  }
  back = records.record_to_params(record, template)
  np.testing.assert_array_equal(back["conv"]["kernel"], params["conv"]["kernel"])
  np.testing.assert_array_equal(back["dense"]["bias"], params["dense"]["bias"])
  with pytest.raises(ValueError, match=r"shape \(7,\)"):
    records.record_to_params(
      records.params_to_record(params), {**template, "dense": {"bias": np.zeros(1, np.float32)}}
    )
  with pytest.raises(ValueError, match=r"\{'dense/bias': 'float64'\} are not float32"):
    records.params_to_record({"dense": {"bias": np.zeros(2)}})


@pytest.mark.slow
def test_dp_clients_use_secret_keys_keep_ledgers_and_send_nothing_else(tmp_path, monkeypatch):
  monkeypatch.delenv(settings.UNSAFE_ENV, raising=False)
  rc = _run_config(tmp_path, "quickstart:dp_loops", **{"max-epsilon": 50.0})
  # experiments.run's debugging switch for raw statistics never reaches the wire.
  rc["overrides"] += " debug_nonprivate_stats=True"
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  # Secret keys: a second federation with fresh state directories (new secrets) differs.
  records2, _ = run_inprocess(
    {**rc, "run-dir": str(tmp_path / "run2")}, state_root=tmp_path / "state2"
  )
  assert all(r["clients_ok"] == [0, 1, 2, 3, 4] for r in records + records2)
  assert records[-1]["test_loss"] != records2[-1]["test_loss"]
  # No key reaches a DP client; replies carry only the allowed metrics.
  assert all("own" not in m.content for m in grid.sent)
  for reply in grid.replies:
    assert set(reply.content["metrics"]) <= DP_ALLOWED_METRICS, reply.content["metrics"]
    assert reply.content["status"]["keys"] == "client"
    # server.start='global': the synthetic set and r_k only, no model delta.
    assert set(reply.content.keys()) == {"metrics", "status", "update"}
    assert set(reply.content["update"]) == {
      "synthetic.x",
      "synthetic.y",
      "synthetic.mask",
      "radius",
    }
  # Each client's ledger: its own N_k, both rounds, the epsilons it reported.
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  for k in range(5):
    state = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}")
    hist = state.history()
    assert [h["server_round"] for h in hist] == [1, 2]
    mine = [r["metrics"]["epsilon"] for r in reports if r["partition_id"] == k]
    assert mine == [h["epsilon"] for h in hist]
  # Each client accounts with its own N_k; the largest epsilon (the smallest client's)
  # is experiments.run's, which accounts every client with q = B / min_k N_k.
  from fedlap_runs import data as data_lib

  cfg, _ = settings.load_config("quickstart:dp_loops", TINY)
  sizes = [len(i) for i in data_lib.client_split(data_lib.load_dataset(cfg.data), cfg.data)]
  steps = cfg.client.iterations * cfg.client.max_outer * cfg.client.batch_loop
  for k, n in enumerate(sizes):  # the replace-one epsilon: N_k is public
    own = accounting.PrivacyLedger(
      noise_multiplier=cfg.dp.noise_multiplier,
      batch_size=cfg.client.batch_size,
      min_client_size=n,
      steps_per_round=steps,
      delta=1e-5,
      adjacency="replace_one",
    )
    assert records[0]["epsilon_per_client"][str(k)] == own.record_round()
  assert records[0]["epsilon"] == max(records[0]["epsilon_per_client"].values())


@pytest.mark.slow
def test_budget_refusal_is_reported_and_stops_below_min_clients(tmp_path):
  rc = _run_config(tmp_path, "quickstart:dp_loops")
  # sigma 1 and B 64 pinned: the epsilons below do not move with the quickstart's DP recipe.
  rc["overrides"] = (
    TINY.replace("rounds=2", "rounds=3") + " dp.noise_multiplier=1.0 client.batch_size=64"
  )
  # Round 1 costs 2.84..2.89 (replace-one, T = 1 step); round 2 would reach 3.62..3.70: a cap
  # of 3.5 lets round 1 through and refuses round 2 on every client.
  nodes = node_configs(state_root=tmp_path / "state", **{"max-epsilon": 3.5})
  with pytest.raises(strategy.TooFewClients):  # every client refused round 2 (below)
    run_inprocess(rc, nodes)
  recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [r["round"] for r in recs] == [1, 2] and "stopped" in recs[1]
  assert recs[1]["clients_refused"] == [0, 1, 2, 3, 4]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  refused = [r for r in reports if r["round"] == 2]
  assert all(
    r["status"] == "refused" and "above the client's max-epsilon=3.5" in r["reason"]
    for r in refused
  )
  assert all(r["metrics"]["epsilon-after"] > 3.5 >= r["metrics"]["epsilon"] for r in refused)
  for k in range(5):  # the refused round was never recorded
    hist = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").history()
    assert [h["server_round"] for h in hist] == [1]


@pytest.mark.slow
def test_unsafe_server_keys_need_the_clients_consent(tmp_path, monkeypatch):
  monkeypatch.delenv(settings.UNSAFE_ENV, raising=False)
  rc = _run_config(
    tmp_path,
    "quickstart:dp_loops",
    **{"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0, "min-clients": 1},
  )
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(rc, state_root=tmp_path / "state")
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  assert {r["status"] for r in reports} == {"refused"}
  assert all(settings.UNSAFE_ENV in r["reason"] for r in reports)
  assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*.json"))


@pytest.mark.slow
def test_a_client_refuses_a_delta_above_its_own_max_delta(tmp_path):
  """The server chooses dp.delta; each client enforces its own max-delta (default
  min(1e-5, 1 / N_k)) and replies 'refused' with the reason, before spending anything."""
  rc = _run_config(
    tmp_path,
    "quickstart:dp_loops",
    overrides=TINY.replace("rounds=2", "rounds=1") + " dp.delta=1e-4",
    **{"max-epsilon": 50.0, "min-clients": 1},
  )
  nodes = node_configs(state_root=tmp_path / "state")
  nodes[101]["max-delta"] = 1e-3  # its own bound: 1e-4 passes it (and 1e-4 < 1 / N_k)
  records, _ = run_inprocess(rc, nodes)
  assert records[0]["clients_ok"] == [0] and records[0]["clients_refused"] == [1, 2, 3, 4]
  reports = {
    r["partition_id"]: r for r in json.loads((tmp_path / "run" / "client_reports.json").read_text())
  }
  assert reports[0]["status"] == "ok"
  for k in range(1, 5):
    assert reports[k]["status"] == "refused"
    assert "dp.delta=0.0001 is refused by this client" in reports[k]["reason"]
    assert "max-delta=1e-05" in reports[k]["reason"]
    assert not (tmp_path / "state" / f"client-{k}" / ledger_lib.LEDGER_FILE).exists()


@pytest.mark.slow
def test_missing_and_failing_clients_are_logged_and_the_rest_aggregate(tmp_path):
  rc = _run_config(tmp_path, "quickstart:nondp", **{"min-clients": 3})

  def hook(grid):
    grid.silent.add(105)  # partition 4: crashed
    grid.contexts[104].node_config["data-path"] = "/nope"  # partition 3: raises

  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert all(r["clients_ok"] == [0, 1, 2] for r in records)
  assert records[0]["clients_missing"] == ["node 105"]
  assert records[0]["clients_error"] == ["node 104"]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  err = [r for r in reports if r["status"] == "error"][0]
  assert "data-path='/nope' is invalid" in err["reason"]
  assert np.isfinite(records[-1]["test_accuracy"])


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_fedavg_baseline_equals_experiments_run_bit_for_bit(tmp_path):
  """method=fedavg: the clients run the library's FedAvg client step, the server its server
  step, with experiments.run's keys and learning rates: every number is the same."""
  overrides = f"method=fedavg rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}"
  rc = _run_config(tmp_path, "quickstart:nondp", overrides=overrides)
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = reference_run("quickstart:nondp", overrides, tmp_path / "ref")
  assert [r["round"] for r in records] == [1, 2]
  for got, want in zip(records, ref):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["clients_ok"] == [0, 1, 2, 3, 4]
  replies = grid.replies[-5:]  # round 2
  assert sorted(r.content["metrics"]["partition-id"] for r in replies) == [0, 1, 2, 3, 4]
  weights = np.array([r.content["metrics"]["num-examples"] for r in replies], np.float64)
  with np.load(tmp_path / "run" / "final_params.npz") as f:
    final = dict(f)
  template = traverse_util.unflatten_dict(
    {k.replace(".", "/"): v for k, v in final.items()}, sep="/"
  )
  from fedlap_flower import records as records_lib

  sent = [
    traverse_util.flatten_dict(
      records_lib.record_to_like(r.content["arrays"], template, "parameters"), sep="/"
    )
    for r in replies
  ]
  for name, value in final.items():
    arrays = [s[name.replace(".", "/")] for s in sent]
    # x + sum_k w_k (y_k - x) is the weighted mean of the clients' models.
    mean = sum(w * a for w, a in zip(weights / weights.sum(), arrays))
    np.testing.assert_allclose(value, mean, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(arrays[0], arrays[1])  # the clients trained on their own data
  assert records[0]["upload_bytes"] == 5 * records[0]["model_bytes"]
  assert records[-1]["test_accuracy"] > 0.2  # 10 classes: chance is 0.1


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_a_user_model_both_sides_allow_runs_as_in_experiments_run(tmp_path, monkeypatch):
  """model.name=MODULE:ATTR where the server's environment and every node's node config allow
  it: the app builds the user's model on both sides, and a round's numbers are
  experiments.run's with the same model."""
  monkeypatch.setenv(settings.MODELS_ENV, USER_MODEL)  # the server's
  overrides = (
    f"method=fedavg rounds=1 baseline.local_epochs=1 eval_chunk_size=128 model.name={USER_MODEL}"
  )
  rc = _run_config(tmp_path, "quickstart:nondp", overrides=overrides)
  nodes = node_configs(state_root=tmp_path / "state", models=USER_MODEL)
  records, _ = run_inprocess(rc, nodes)
  (ref,) = reference_run("quickstart:nondp", overrides, tmp_path / "ref", models=(USER_MODEL,))
  (got,) = records
  assert got["clients_ok"] == [0, 1, 2, 3, 4]
  assert (got["test_accuracy"], got["test_loss"]) == (ref["test_accuracy"], ref["test_loss"])
  with np.load(tmp_path / "run" / "final_params.npz") as f:  # the MLP's: 8x8x1 -> 16 -> 10
    assert sorted(a.shape for a in f.values()) == [(10,), (16,), (16, 10), (64, 16)]


# Every registry method of FedAvg's wire (the client's model) runs in the Flower app, generic
# over the registry.
FEDAVG_WIRE = {
  "fedsgd": ("quickstart:nondp", f"method=fedsgd rounds=2 eval_chunk_size=128 {SMALL_MODEL}"),
  "fedprox": (
    "quickstart:nondp",
    f"method=fedprox rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  ),
  "fedadam": (
    "quickstart:fedadam",
    f"rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  ),
}


def test_the_flower_methods_are_the_registrys_of_a_supported_wire():
  """settings.METHODS is derived from the registry, not a list of names."""
  from fedlap_flower import method_work
  from fedlap_jax.methods import REGISTRY

  assert settings.METHODS == method_work.METHODS
  assert settings.METHODS == tuple(n for n, m in REGISTRY.items() if method_work.supported(m))
  assert {"fedlap", "fedavg", *FEDAVG_WIRE, *DP_FEDAVG_WIRE, *CARRIED} <= set(settings.METHODS)
  # Every federated registry method; DSC centralized pools every client's records.
  assert set(settings.METHODS) == {n for n, m in REGISTRY.items() if m.federated}
  assert "dsc_centralized" not in settings.METHODS


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
@pytest.mark.parametrize("method", list(FEDAVG_WIRE))
def test_a_registry_method_of_fedavgs_wire_equals_experiments_run_bit_for_bit(tmp_path, method):
  """The generic strategy: the method's plan, client step and server step (FedAdam's Adam
  state carried on the server), with experiments.run's keys: every number is the same."""
  config, overrides = FEDAVG_WIRE[method]
  rc = _run_config(tmp_path, config, overrides=overrides)
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = reference_run(config, overrides, tmp_path / "ref")
  assert [r["round"] for r in records] == [1, 2] and len(ref) == 2
  for got, want in zip(records, ref):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["clients_ok"] == [0, 1, 2, 3, 4]
  info = json.loads((tmp_path / "run" / "run_info.json").read_text())
  assert info["method"] == method
  assert records[0]["upload_bytes"] == 5 * records[0]["model_bytes"]


FEDYOGI_OVERRIDES = (
  "method=fedavg baseline.server_optimizer.name=yogi baseline.server_lr=0.03 "
  "rounds=2 baseline.local_epochs=1 eval_chunk_size=128"
)


def test_overrides_choose_the_baselines_server_optimiser_and_a_bad_one_is_refused():
  """The optimisers are config fields the overrides may set (the ``baseline.`` section); the
  library's check names a bad one."""
  cfg, _ = settings.load_config("quickstart:fedadam", FEDYOGI_OVERRIDES)
  assert (cfg.method, cfg.baseline.server_optimizer.name, cfg.baseline.server_lr) == (
    "fedavg",
    "yogi",
    0.03,
  )
  with pytest.raises(settings.ConfigError) as err:
    settings.load_config("quickstart:fedadam", "method=fedavg baseline.server_optimizer.name=nadam")
  assert err.value.field == "baseline.server_optimizer.name"


def test_overrides_choose_feddms_and_dscs_image_optimiser_and_a_bad_one_is_refused():
  """``feddm.image_optimizer`` / ``condense.image_optimizer`` are config fields the overrides
  may set; the run's library config (what the server and every client build) holds the spec,
  and a second source of the SGD's momentum is refused by name."""
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  for method, section in (("feddm", "feddm"), ("dsc", "condense")):
    overrides = (
      f"method={method} server.radius_strategy=fixed rounds=1 condense.outer_loop=1 "
      f"condense.inner_loop=1 {section}.image_optimizer.name=adam {section}.image_momentum=0"
    )
    cfg, _ = settings.load_config("quickstart:nondp", overrides)
    built = library_configs.library_config(cfg)
    images = built if method == "feddm" else built.condensation
    assert images.image_optimizer.name == "adam" and images.image_momentum == 0.0
    with pytest.raises(settings.ConfigError) as err:
      settings.load_config("quickstart:nondp", overrides.replace(f"{section}.image_momentum=0", ""))
    assert err.value.field == f"{section}.image_momentum"


def test_server_carry_state_is_a_field_the_overrides_reach_for_fedlap_only():
  """``server.carry_state`` is a field the overrides reach: ``False`` (the default) and
  ``True`` load for FedLAP, a non-bool is refused by the config's type, and a method whose
  server does not carry an optimiser's state refuses ``True`` by name."""
  cfg, _ = settings.load_config("quickstart:nondp", "server.carry_state=False")
  assert cfg.server.carry_state is False
  cfg, _ = settings.load_config(
    "quickstart:nondp", "server.optimizer.name=adam server.carry_state=True"
  )
  assert cfg.server.carry_state is True
  with pytest.raises(settings.ConfigError) as err:
    settings.load_config("quickstart:nondp", "server.carry_state=maybe")
  assert err.value.field == "server.carry_state"
  with pytest.raises(settings.ConfigError) as err:  # the FedAvg family has no such server
    settings.load_config("quickstart:fedadam", "method=fedavg server.carry_state=True")
  assert err.value.field == "server.carry_state"


FEDLAP_ADAM_OVERRIDES = TINY.replace("client.max_outer=1", "client.max_outer=2") + (
  " client.inner_loop=1 server.optimizer.name=adam client.model_optimizer.name=adam"
  " client.image_optimizer.name=adam client.image_momentum=0.0 client.image_lr=0.1"
)


def _fedlap_rounds_equal_experiments_run(tmp_path, overrides: str):
  """``(records, experiments.run's records)`` of 2 quickstart:nondp rounds with ``overrides``,
  asserted equal in test accuracy, test loss and server steps."""
  rc = _run_config(tmp_path, "quickstart:nondp", overrides=overrides)
  records, _ = run_inprocess(rc, state_root=tmp_path / "state")
  ref = reference_run("quickstart:nondp", overrides, tmp_path / "ref")
  assert [r["round"] for r in records] == [1, 2] and len(ref) == 2
  for got, want in zip(records, ref):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["server_steps"] == want["server_steps"]
  return records, ref


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_fedlaps_optimisers_and_carried_state_in_the_overrides_run_as_experiments_run(tmp_path):
  """FedLAP with Adam as its server's descent and as its clients' model and image optimisers,
  chosen in the overrides, and ``server.carry_state=True``, without Flower code: the library
  config carries the specs to the server and to every client, and the server's descent starts
  each round from the last round's Adam state, as experiments.run's; every number is
  experiments.run's, and the state it saved after the last round holds that optimiser's state."""
  overrides = FEDLAP_ADAM_OVERRIDES + " server.carry_state=True"
  cfg, _ = settings.load_config("quickstart:nondp", overrides)
  assert (cfg.server.optimizer.name, cfg.client.model_optimizer.name) == ("adam", "adam")
  records, ref = _fedlap_rounds_equal_experiments_run(tmp_path, overrides)
  for got, want in zip(records, ref):
    assert got["client_radius"] == want["client_radius"]
  # Both rounds' descents take steps: round 2 starts from the Adam state round 1 moved, not a
  # fresh one (that carrying it changes experiments.run's round 2: test_carried_server_state.py).
  assert all(r["server_steps"] > 0 for r in ref)
  with np.load(tmp_path / "run" / "server_state.npz") as f:
    carried = [n for n in f.files if n.startswith("extra/")]
    assert carried and any(np.any(f[n] != 0) for n in carried)


DP_FEDAVG_WIRE = {
  "dp_fedavg": (
    f"method=dp_fedavg rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}"
  ),
  "dp_fedprox": (
    f"method=dp_fedprox rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}"
  ),
}


def _ledger_rounds(state_root, reports) -> None:
  """Every client's ledger holds both rounds, with the epsilons it reported."""
  for k in range(5):
    hist = ledger_lib.ClientState(state_root / f"client-{k}").history()
    assert [h["server_round"] for h in hist] == [1, 2]
    mine = [r["metrics"]["epsilon"] for r in reports if r["partition_id"] == k]
    assert mine == [h["epsilon"] for h in hist]


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
@pytest.mark.parametrize("method", list(DP_FEDAVG_WIRE))
def test_a_dp_registry_method_equals_experiments_run_with_unsafe_server_keys(
  tmp_path, monkeypatch, method, shared_reference
):
  """DP at the edge for DP-FedAvg / DP-FedProx: with the test-only server keys every number,
  the epsilon included, is experiments.run's; each client charged its own ledger."""
  monkeypatch.setenv(settings.UNSAFE_ENV, "1")
  overrides = DP_FEDAVG_WIRE[method]
  rc = _run_config(
    tmp_path,
    "quickstart:dp_loops",
    overrides=overrides,
    **{"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  )
  records, _ = run_inprocess(rc, state_root=tmp_path / "state")
  ref = shared_reference("quickstart:dp_loops", overrides)["records"]
  assert [r["round"] for r in records] == [1, 2] and len(ref) == 2
  for got, want in zip(records, ref):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["epsilon"] == want["epsilon"]  # the smallest client's: experiments.run's
    assert got["epsilon_kind"] == strategy.EPSILON_KIND
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  _ledger_rounds(tmp_path / "state", reports)


@pytest.mark.slow
def test_a_target_epsilon_calibrates_a_dp_fedavg_flower_run_as_experiments_run(tmp_path):
  """dp.target_epsilon for DP-FedAvg: the run builder calibrates sigma on the server and every
  client as experiments.run does, so the ledgers and the epsilon are its own (equal epsilon
  across methods)."""
  overrides = DP_FEDAVG_WIRE["dp_fedavg"].replace("rounds=2", "rounds=1") + " dp.target_epsilon=5.0"
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-epsilon": 50.0})
  records, _ = run_inprocess(rc, state_root=tmp_path / "state")
  ref, ref_cfg = _experiments_run("quickstart:dp_loops", overrides, tmp_path / "ref")
  sigma = ref_cfg["dp"]["noise_multiplier"]
  assert sigma != 1.0  # the config's own sigma: calibrated away
  info = json.loads((tmp_path / "run" / "run_info.json").read_text())
  assert info["config_values"]["dp"]["noise_multiplier"] == sigma
  for k in range(5):  # every client's noise and ledger: the same sigma
    stored = (tmp_path / "state" / f"client-{k}" / ledger_lib.LEDGER_FILE).read_text()
    assert json.loads(stored)["ledger"]["noise_multiplier"] == sigma
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4]
  assert records[-1]["epsilon"] == ref[-1]["epsilon"] <= 5.0


@pytest.mark.slow
def test_dp_fedavg_clients_draw_their_own_keys_and_send_nothing_else(
  tmp_path, monkeypatch, shared_reference
):
  """Without the unsafe mode no key reaches a DP-FedAvg client; its reply holds its model
  and the allowed metrics only (no record count); the epsilon is experiments.run's."""
  monkeypatch.delenv(settings.UNSAFE_ENV, raising=False)
  overrides = DP_FEDAVG_WIRE["dp_fedavg"]
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-epsilon": 50.0})
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = shared_reference("quickstart:dp_loops", overrides)["records"]
  assert [r["epsilon"] for r in records] == [r["epsilon"] for r in ref]
  assert all(r["clients_ok"] == [0, 1, 2, 3, 4] for r in records)
  assert all("own" not in m.content for m in grid.sent if m.metadata.message_type == "train")
  for reply in grid.replies:
    assert set(reply.content["metrics"]) <= DP_ALLOWED_METRICS, reply.content["metrics"]
    assert reply.content["status"]["keys"] == "client"
    assert set(reply.content.keys()) == {"arrays", "metrics", "status"}
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  _ledger_rounds(tmp_path / "state", reports)


@pytest.mark.slow
def test_a_dp_fedavg_run_dir_holds_only_dp_outputs_and_public_values(tmp_path, monkeypatch):
  """Read as an attacker: a DP-FedAvg server's run dir holds only the run's own files; its
  state is the global model (post-processing of the clients' noised models), the round and
  the server's own key (no client draws from it), with no other server state under SGD; its
  metrics and reports carry no record count and no per-record value."""
  monkeypatch.delenv(settings.UNSAFE_ENV, raising=False)
  overrides = DP_FEDAVG_WIRE["dp_fedavg"]
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-epsilon": 50.0})
  run_inprocess(rc, state_root=tmp_path / "state")
  run_dir = tmp_path / "run"
  assert {p.name for p in run_dir.iterdir()} <= set(strategy.OUTPUTS)
  with np.load(run_dir / "server_state.npz") as state:
    assert not [k for k in state.files if k.startswith(("extra/", "labels/"))], state.files
  records = read_jsonl(run_dir / "metrics.jsonl")
  assert records and all("num_examples" not in json.dumps(r) for r in records)
  for report in json.loads((run_dir / "client_reports.json").read_text()):
    assert set(report["metrics"]) <= DP_ALLOWED_METRICS, report


@pytest.mark.slow
def test_a_dp_fedavg_client_refuses_what_its_ledger_refuses(tmp_path):
  """A round past a client's max-epsilon is refused before any noise is drawn; the run stops
  below min-clients."""
  overrides = DP_FEDAVG_WIRE["dp_fedavg"]
  rc = _run_config(tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-epsilon": 5.5})
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(rc, state_root=tmp_path / "state")
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  assert {r["status"] for r in reports if r["round"] == 1} == {"ok"}
  refused = [r for r in reports if r["round"] == 2]
  assert len(refused) == 5 and {r["status"] for r in refused} == {"refused"}
  assert all("max-epsilon" in r["reason"] or "epsilon" in r["reason"] for r in refused)
  for k in range(5):  # the refused round is not charged
    hist = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").history()
    assert [h["server_round"] for h in hist] == [1]


# Methods whose clients carry state between rounds (SCAFFOLD's c_k, a synthetic set) or send
# another update than their model: the client keeps its own state, the server checks the
# update by the method's wire. Tiny loops (the protocol, not the learning).
SYNTHETIC_TINY = (
  "server.radius_strategy=fixed server.weighting=size server.max_epochs=1 "
  f"server.dsa_strategy='' client.ipc=1 eval_chunk_size=128 {SMALL_MODEL}"
)
CONDENSE_TINY = (
  "condense.networks=2 condense.outer_loop=2 condense.inner_loop=1 condense.dsa_strategy=''"
)
CARRIED = {
  "scaffold": (
    "quickstart:nondp",
    f"method=scaffold rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  ),
  "feddm": (
    "quickstart:nondp",
    f"method=feddm rounds=2 synthetic_init=noise feddm.image_updates=2 feddm.dsa_strategy='' "
    f"{SYNTHETIC_TINY}",
  ),
  "dsc": (  # one-shot: its one round
    "quickstart:nondp",
    f"method=dsc rounds=1 synthetic_init=real {CONDENSE_TINY} {SYNTHETIC_TINY}",
  ),
  "psg": (  # one-shot and DP (the test-only server keys: experiments.run's noise)
    "quickstart:dp_loops",
    f"method=psg rounds=1 {CONDENSE_TINY} {SYNTHETIC_TINY.replace(' server.weighting=size', '')}",
  ),
  "dp_scaffold": (  # DP (the test-only server keys: experiments.run's noise)
    "quickstart:dp_loops",
    f"method=dp_scaffold rounds=2 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  ),
}


def _final_params(run_dir) -> dict:
  with np.load(run_dir / "final_params.npz") as f:
    return dict(f)


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
@pytest.mark.parametrize("method", list(CARRIED))
def test_a_method_with_carried_client_state_equals_experiments_run_bit_for_bit(
  tmp_path, monkeypatch, method, shared_reference
):
  """SCAFFOLD, DP-SCAFFOLD, FedDM, DSC and PSG over Flower: each client starts its carried state from its
  own records and keeps it between rounds, the server checks the method's update; the logged
  metrics (the epsilon under DP), the final model and the clients' kept state are
  experiments.run's, bit for bit."""
  from flax import traverse_util as tu

  config, overrides = CARRIED[method]
  extra = {}
  if config == "quickstart:dp_loops":
    monkeypatch.setenv(settings.UNSAFE_ENV, "1")
    extra = {"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0}
  rc = _run_config(tmp_path, config, overrides=overrides, **extra)
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = shared_reference(config, overrides)
  assert [r["round"] for r in records] == [r["round"] for r in ref["records"]]
  for got, want in zip(records, ref["records"]):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["epsilon"] == want.get("epsilon")
    assert got["clients_ok"] == [0, 1, 2, 3, 4]
  want_params = tu.flatten_dict(jax.device_get(ref["state"].params), sep=".")
  got_params = _final_params(tmp_path / "run")
  assert sorted(got_params) == sorted(want_params)
  for name, value in got_params.items():
    np.testing.assert_array_equal(value, want_params[name], err_msg=name)
  # Every client kept its carried state after its last round: experiments.run's slot of it.
  from fedlap_flower import method_work
  from fedlap_jax.method import Wire

  m = method_work.method_of(settings.load_config(config, overrides)[0])
  state = ref["state"]
  for k in range(5):
    want_k = tuple(jax.tree.map(lambda a: np.asarray(a[k]), getattr(state, f)) for f in m.carried)
    wire = Wire.of(jax.tree.map(method_work.shape_of, want_k))
    kept = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").load_carried(
      _federated_run(tmp_path / "run"), records[-1]["round"], wire
    )
    assert kept is not None
    for name, value in method_work.tree_to_arrays(want_k).items():
      np.testing.assert_array_equal(kept[name], value, err_msg=f"client {k}: {name}")
  # No client state on the server: its saved state holds no client's field.
  with np.load(tmp_path / "run" / "server_state.npz") as saved:
    assert not [n for n in saved.files if any(f in n for f in m.carried)], saved.files
  info = json.loads((tmp_path / "run" / "run_info.json").read_text())
  assert info["method"] == method
  sent = grid.replies[0].content  # the method's update by its wire's names, not a model
  assert "update" in sent and "arrays" not in sent


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_sampled_scaffold_clients_keep_their_variates_across_the_rounds_they_skip(tmp_path):
  """20 clients, 5 a round: a client drawn in rounds 1 and 3 starts round 3 from the state it
  kept after round 1 (its last drawn round), as experiments.run's sampled round does."""
  from flower_harness import node_configs, reference_result
  from fedlap_flower import method_work, task
  from fedlap_jax.method import Wire

  config = "quickstart:nondp"
  overrides = (
    f"method=scaffold rounds=3 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL} "
    "data.num_clients=20 "
    "data.clients_per_round=5 data.partition=iid client.batch_size=16"
  )
  cfg = settings.load_config(config, overrides)[0]
  drawn = [set(task.participants(cfg, r).tolist()) for r in (1, 2, 3)]
  skipper = min((drawn[0] & drawn[2]) - drawn[1])  # drawn in rounds 1 and 3 only
  rc = _run_config(tmp_path, config, overrides=overrides)
  records, _ = run_inprocess(rc, nodes=node_configs(20, state_root=tmp_path / "state"))
  ref = reference_result(config, overrides, tmp_path / "ref")
  for got, want in zip(records, ref["records"], strict=True):
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["test_loss"] == want["test_loss"]
    assert got["clients_ok"] == sorted(drawn[got["round"] - 1])
  want_k = (jax.tree.map(lambda a: np.asarray(a[skipper]), ref["state"].client_controls),)
  wire = Wire.of(jax.tree.map(method_work.shape_of, want_k))
  state = ledger_lib.ClientState(tmp_path / "state" / f"client-{skipper}")
  run = _federated_run(tmp_path / "run")
  assert state.carried_rounds(run) == [1, 3]  # round 3's, and round 1's it started from
  kept = state.load_carried(run, 3, wire)
  for name, value in method_work.tree_to_arrays(want_k).items():
    np.testing.assert_array_equal(kept[name], value, err_msg=name)


@pytest.mark.slow
def test_psg_clients_draw_their_own_keys_and_send_their_set_and_epsilon_only(
  tmp_path, monkeypatch, shared_reference
):
  """PSG without the unsafe mode: no key reaches a client, each charges its own ledger, its
  reply holds its synthetic set and the allowed metrics only; the epsilon is experiments.run's
  (equal epsilon across the methods at the same config)."""
  monkeypatch.delenv(settings.UNSAFE_ENV, raising=False)
  config, overrides = CARRIED["psg"]
  rc = _run_config(tmp_path, config, overrides=overrides, **{"max-epsilon": 50.0})
  records, grid = run_inprocess(rc, state_root=tmp_path / "state")
  ref = shared_reference(config, overrides)["records"]
  assert [r["epsilon"] for r in records] == [r["epsilon"] for r in ref]
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4]
  assert all("own" not in m.content for m in grid.sent if m.metadata.message_type == "train")
  for reply in grid.replies:
    assert set(reply.content["metrics"]) <= DP_ALLOWED_METRICS, reply.content["metrics"]
    assert reply.content["status"]["keys"] == "client"
    assert set(reply.content.keys()) == {"update", "metrics", "status"}
  for k in range(5):
    hist = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").history()
    assert [h["server_round"] for h in hist] == [1]


def _tamper_before(server_round, changes):
  """A grid hook: before the train messages of ``server_round`` reach them, ``changes[node]``
  (``path -> None``) alters that node's carried-state file."""

  def hook(grid):
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
      messages = list(messages)
      if any(
        m.metadata.message_type == "train" and m.content["config"]["server-round"] == server_round
        for m in messages
      ):
        run = messages[0].content["config"]["federated-run"]
        for node, change in changes.items():
          state = ledger_lib.ClientState(grid.contexts[node].node_config["state-dir"])
          change(state.carried_path(run, server_round - 1))
      return real(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive

  return hook


@pytest.mark.slow
def test_a_clients_carried_state_missing_or_altered_is_refused_never_started_afresh(tmp_path):
  """SCAFFOLD's c_k stays with its client between rounds. Deleted, replaced by one of another
  shape, by a link, or by one of another round, the client refuses the round (a re-initialised
  variate would silently be another run's numbers), naming why; the others aggregate."""

  def delete(path):
    path.unlink()

  def reshape(path):
    with np.load(path) as f:
      arrays = dict(f)
    name = next(n for n in arrays if n != ledger_lib.CARRIED_ROUND)
    arrays[name] = np.zeros((3,), arrays[name].dtype)
    np.savez(path, **arrays)

  def link(path):
    other = path.with_name("elsewhere.npz")
    path.rename(other)
    path.symlink_to(other)

  def older(path):
    with np.load(path) as f:
      arrays = dict(f)
    np.savez(path, **{**arrays, ledger_lib.CARRIED_ROUND: np.asarray(0)})

  config, overrides = CARRIED["scaffold"]
  rc = _run_config(tmp_path, config, overrides=overrides, **{"min-clients": 1})
  hook = _tamper_before(2, {101: delete, 102: reshape, 103: link, 104: older})
  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4] and records[1]["clients_ok"] == [4]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  why = {r["partition_id"]: r.get("reason", "") for r in reports if r["round"] == 2}
  assert {r["status"] for r in reports if r["round"] == 2 and r["partition_id"] < 4} == {"refused"}
  assert "carried state" in why[0] and "missing" in why[0] and "afresh" in why[0]
  assert "carried-1.npz" in why[1] and "shape" in why[1] and "(3,)" in why[1]
  assert "link" in why[2]
  assert "round 1" in why[3] and "round 0" in why[3]


MISSED = {  # a method carrying client state: a variate, a synthetic set
  "scaffold": CARRIED["scaffold"][1].replace("rounds=2", "rounds=3"),
  "fedlap_noise": TINY.replace("rounds=2", "rounds=3") + " synthetic_init=noise",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MISSED))
def test_a_client_whose_reply_was_not_taken_continues_from_the_last_one_taken(
  tmp_path, kind, monkeypatch
):
  """The server's update of round 2 takes no reply of client 0 (its reply is lost after it
  kept its state), of client 3 (cut short before it kept its state) or of client 4 (the
  message never reaches it). In round 3 all three continue from what they kept after round 1,
  the last round whose update took their reply (the message says so), as clients not drawn
  for round 2; the run aggregates all five, and client 0's round-2 state, which no update
  took, is dropped. Client 2's round-2 state deleted is refused by name, never replaced by an
  older one."""
  from fedlap_flower import client_app, federated_runs

  starts, real_kept, real_keep = {}, client_app._kept_state, client_app._keep_state

  def kept_state(state, run_key, server_round, delivered, prev, wire, what):
    out = real_kept(state, run_key, server_round, delivered, prev, wire, what)
    starts[(state.directory.name, server_round)] = (prev, out[0], out[1])
    return out

  def keep_state(state, run_key, server_round, start, arrays):
    if (state.directory.name, server_round) == ("client-3", 2):
      raise RuntimeError("cut short before it kept its state")
    return real_keep(state, run_key, server_round, start, arrays)

  monkeypatch.setattr(client_app, "_kept_state", kept_state)
  monkeypatch.setattr(client_app, "_keep_state", keep_state)
  sent = {}

  def hook(grid):
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
      messages = list(messages)
      train = [m for m in messages if m.metadata.message_type == "train"]
      r = train[0].content["config"]["server-round"] if train else None
      for m in train:
        sent[(m.metadata.dst_node_id, r)] = m.content["config"][federated_runs.DELIVERED_KEY]
      if r == 2:  # the message to node 105 (client 4) is lost
        messages = [m for m in messages if m.metadata.dst_node_id != 105]
      if r == 3:
        run = train[0].content["config"]["federated-run"]
        ledger_lib.ClientState(grid.contexts[103].node_config["state-dir"]).carried_path(
          run, 2
        ).unlink()
      replies = real(messages, timeout=timeout)
      if r == 2:  # node 101's (client 0's) reply is lost after it kept its state
        replies = [m for m in replies if m.metadata.src_node_id != 101]
      return replies

    grid.send_and_receive = send_and_receive

  rc = _run_config(tmp_path, "quickstart:nondp", overrides=MISSED[kind], **{"min-clients": 2})
  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4], [1, 2], [0, 1, 3, 4]]
  assert [sent[(101 + k, 3)] for k in range(5)] == [1, 2, 2, 1, 1]
  assert {sent[(101 + k, r)] for k in range(5) for r in (1, 2)} == {0, 1}
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  third = {r["partition_id"]: r for r in reports if r["round"] == 3}
  why = third[2].get("reason", "")
  assert third[2]["status"] == "refused", third[2]
  assert "after round 2" in why and "missing" in why and "older state" in why, why
  run = _federated_run(tmp_path / "run")
  for k in (0, 3, 4):
    prev, start, kept = starts[(f"client-{k}", 3)]
    assert (prev, start) == (2, 1), (k, prev, start)
    state = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}")
    assert state.carried_rounds(run) == [1, 3]  # round 3's, and round 1's it started from
    with np.load(state.carried_path(run, 1)) as f:
      assert sorted(kept) == sorted(n for n in f.files if n != ledger_lib.CARRIED_ROUND)
      for name in kept:
        np.testing.assert_array_equal(kept[name], f[name], err_msg=f"client {k}: {name}")
    assert federated_runs.delivered(state, run) == 1
  assert starts[("client-1", 3)][:2] == (2, 2)  # the others start from round 2, as always


@pytest.mark.slow
def test_a_synthetic_update_gets_fedlaps_checks(tmp_path):
  """A FedDM reply is untrusted input as a FedLAP reply is: an array of another dtype than
  the method's wire declares, labels out of range, or labels other than the partition's
  earlier ones are refused by name; the other replies aggregate."""

  config, overrides = CARRIED["feddm"]

  def hook(grid):
    real = grid.answer

    def answer(msg):
      reply = real(msg)
      if msg.metadata.message_type != "train" or "update" not in reply.content:
        return reply
      node, r = msg.metadata.dst_node_id, msg.content["config"]["server-round"]
      update = reply.content["update"]
      if node == 101 and r == 1:
        update["mask"] = Array(np.asarray(update["mask"].numpy(), np.int32))
      if node == 102 and r == 1:
        y = update["y"].numpy().copy()
        y[0] = 99
        update["y"] = Array(y)
      if node == 103 and r == 2:
        y, mask = update["y"].numpy().copy(), update["mask"].numpy()
        y[: int(mask.sum())] = np.sort((y[: int(mask.sum())] + 1) % 10)
        update["y"] = Array(y)
      return reply

    grid.answer = answer

  rc = _run_config(tmp_path, config, overrides=overrides, **{"min-clients": 1})
  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert records[0]["clients_ok"] == [2, 3, 4] and records[1]["clients_ok"] == [0, 1, 3, 4]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  bad = {(r["round"], r["partition_id"]): r for r in reports if r["status"] == "invalid"}
  assert sorted(bad) == [(1, 0), (1, 1), (2, 2)]
  assert bad[(1, 0)]["field"] == "mask" and "bool" in bad[(1, 0)]["reason"]
  assert bad[(1, 1)]["field"] == "y" and "99" in bad[(1, 1)]["reason"]
  assert bad[(2, 2)]["field"] == "y" and "earlier replies" in bad[(2, 2)]["reason"]


def test_a_method_that_pools_every_clients_records_is_refused_by_name():
  """DSC centralized is one client pooling every client's records, not a federation: the
  Flower app refuses it, naming the method, the value and the methods it runs."""
  from fedlap_jax.checks import ConfigError

  with raises_field("config", ConfigError) as e:
    settings.load_config(
      "quickstart:nondp", "method=dsc_centralized rounds=1 server.radius_strategy=fixed"
    )
  assert "dsc" in str(e.value) and "psg" in str(e.value) and "scaffold" in str(e.value)
  assert "experiments.run" in str(e.value)


def test_a_server_reading_its_own_data_refuses_a_synthetic_set_method(tmp_path, monkeypatch):
  """A synthetic set's slots follow the client owning the most classes, a fact of the named
  partition: a server that reads its own data does not know it and refuses FedDM up front,
  saying why (the clients are never asked)."""
  from flower_harness import serve_with

  _, server_npz = _own_data_sites(tmp_path)
  monkeypatch.setenv(settings.SERVER_DATA_ENV, server_npz)
  config, overrides = CARRIED["feddm"]
  rc = _run_config(tmp_path, config, overrides=overrides + OWN_DATA)
  with raises_field("data") as e:
    serve_with(None, rc)
  assert e.value.field == "data" and "named data" in str(e.value)
  assert "max-classes-per-client" in str(e.value)


def _classes_per_site(nodes) -> list[int]:
  out = []
  for n in sorted(nodes):
    with np.load(nodes[n]["data-path"]) as f:
      out.append(int(np.unique(f["y_train"]).size))
  return out


@pytest.mark.slow
def test_an_own_data_federation_runs_a_synthetic_set_method_at_the_stated_max_classes(
  tmp_path, monkeypatch
):
  """Server and clients reading their own data: the run config's max-classes-per-client sizes
  FedDM's sets (ipc slots per class), and every client computes and keeps its set of that size.
  Stated below a client's classes, PSG's clients refuse by name before their ledgers are
  touched (nothing charged, nothing kept)."""
  nodes, server_npz = _own_data_sites(tmp_path)
  monkeypatch.setenv(settings.SERVER_DATA_ENV, server_npz)
  most = max(_classes_per_site(nodes))
  config, overrides = CARRIED["feddm"]
  rc = _run_config(
    tmp_path, config, overrides=overrides + OWN_DATA, **{"max-classes-per-client": most}
  )
  nondp = {n: {k: v for k, v in c.items() if k != "max-epsilon"} for n, c in nodes.items()}
  records, _ = run_inprocess(rc, nondp)
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4]] * 2
  assert all(0 < r["test_accuracy"] <= 1 for r in records)
  run = _federated_run(tmp_path / "run")
  for k in range(5):  # ipc = 1 slot for each of the stated classes
    state = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}")
    with np.load(state.carried_path(run, 2)) as f:
      assert f["0.y"].shape == (most,) and f["0.x"].shape == (most, 8, 8, 1)
  # Stated too low, under DP: refused by name, before the ledger.
  config, overrides = CARRIED["psg"]
  low = _run_config(
    tmp_path / "low",
    config,
    overrides=overrides + OWN_DATA,
    **{"max-classes-per-client": most - 1, "min-clients": 1},
  )
  for n in nodes.values():
    n["state-dir"] = str(tmp_path / "low" / "state" / f"client-{n['partition-id']}")
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(low, nodes)
  reports = json.loads((tmp_path / "low" / "run" / "client_reports.json").read_text())
  refused = [r for r in reports if r["status"] == "refused"]
  held = _classes_per_site(nodes)
  assert sorted(r["partition_id"] for r in refused) == [k for k in range(5) if held[k] == most]
  assert all(f"max-classes-per-client={most - 1} is invalid" in r["reason"] for r in refused)
  for r in refused:
    d = tmp_path / "low" / "state" / f"client-{r['partition_id']}"
    assert not (d / ledger_lib.LEDGER_FILE).exists() and not (d / "runs").exists()


def test_a_stated_max_classes_is_refused_where_it_would_size_nothing_or_contradict_the_data(
  tmp_path,
):
  """max-classes-per-client: with the config's named partition only its own value (or 0), FedLAP's
  as FedDM's; for a method without synthetic sets only 0; never a non-integer."""
  from flower_harness import serve_with

  config, overrides = CARRIED["feddm"]
  with raises_field("max-classes-per-client"):
    serve_with(None, _run_config(tmp_path, config, overrides, **{"max-classes-per-client": 3}))
  fedavg = "method=fedavg rounds=1 baseline.local_epochs=1"
  with raises_field("max-classes-per-client"):
    serve_with(None, _run_config(tmp_path / "b", config, fedavg, **{"max-classes-per-client": 2}))
  with raises_field("max-classes-per-client"):
    serve_with(
      None, _run_config(tmp_path / "c", "quickstart:nondp", TINY, **{"max-classes-per-client": 3})
    )
  for value in (-1, 1.5, "2"):
    rc = _run_config(tmp_path, "quickstart:nondp", **{"max-classes-per-client": value})
    with raises_field("max-classes-per-client", settings.SettingsError):
      settings.run_settings(rc)
  assert not (tmp_path / "run").exists()


def _alter_round_messages(server_round, changes):
  """A grid hook: ``changes[node](config)`` alters the config record of that node's train
  message of ``server_round`` (what a server sends is untrusted by its clients)."""

  def hook(grid):
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
      messages = list(messages)
      for m in messages:
        node = m.metadata.dst_node_id
        if m.metadata.message_type == "train" and node in changes:
          if m.content["config"]["server-round"] == server_round:
            changes[node](m.content["config"])
      return real(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive

  return hook


@pytest.mark.slow
def test_a_server_cannot_point_a_clients_carried_state_elsewhere(tmp_path):
  """The federated run's identity comes from the server, so a client takes it as untrusted:
  a path or a missing one, another identity in the same Flower run, or a round back before
  one the client computed are refused before anything runs, naming why; so is a run of another
  experiment (here another seed) sending a known identity. The other clients aggregate."""
  config, overrides = CARRIED["scaffold"]
  overrides = overrides.replace("rounds=2", "rounds=3")
  other = "f" * 32

  def path(conf):
    conf["federated-run"] = "../../elsewhere"

  def switch(conf):
    conf["federated-run"] = other

  def rewind(conf):
    conf["server-round"] = 1

  def drop(conf):
    del conf["federated-run"]

  rc = _run_config(tmp_path, config, overrides=overrides, **{"min-clients": 1})
  hook = _alter_round_messages(3, {101: path, 102: switch, 103: rewind, 104: drop})
  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4]] * 2 + [[4]]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  why = {r["partition_id"]: r.get("reason", "") for r in reports if r["round"] == 3}
  assert {r["status"] for r in reports if r["round"] == 3 and r["partition_id"] < 4} == {"refused"}
  run = _federated_run(tmp_path / "run")
  assert "federated-run='../../elsewhere' is invalid" in why[0] and "32 hex digits" in why[0]
  assert f"Flower run 7 as federated run {run}" in why[1] and "does not change" in why[1]
  assert "computed round 2" in why[2] and "round 1 would take" in why[2]
  assert "federated-run=None is invalid" in why[3]
  state = ledger_lib.ClientState(tmp_path / "state" / "client-1")
  assert not (state.directory / "runs" / other).exists()
  assert state.carried_rounds(run) == [1, 2]  # untouched by the refused round
  # Another experiment naming this run's identity: every client refuses its first round.
  rc2 = _run_config(tmp_path / "seed1", config, overrides=overrides + " seed=1")
  hook = _alter_round_messages(
    1, {n: lambda c: c.update({"federated-run": run}) for n in range(101, 106)}
  )
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(rc2, grid_hook=hook, state_root=tmp_path / "state", run_id=8)
  reports = json.loads((tmp_path / "seed1" / "run" / "client_reports.json").read_text())
  assert {r["status"] for r in reports} == {"refused"} and len(reports) == 5
  assert all("another experiment" in r["reason"] for r in reports)
  assert state.carried_rounds(run) == [1, 2]


@pytest.mark.slow
def test_a_client_refuses_a_round_outside_its_run(tmp_path):
  """``server-round`` is untrusted too: 0, a round beyond the run's ``rounds`` (which would
  carry a client's state past every real round), a string or a bool is refused by name before
  anything runs; the client takes the run's next real round."""
  config, overrides = CARRIED["scaffold"]
  overrides = overrides.replace("rounds=2", "rounds=3")
  bad = {101: 0, 102: 4, 103: "2", 104: True}
  changes = {n: (lambda v: lambda c: c.update({"server-round": v}))(v) for n, v in bad.items()}
  rc = _run_config(tmp_path, config, overrides=overrides, **{"min-clients": 1})
  records, _ = run_inprocess(
    rc, grid_hook=_alter_round_messages(2, changes), state_root=tmp_path / "state"
  )
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4], [4], [0, 1, 2, 3, 4]]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  why = {r["partition_id"]: r.get("reason", "") for r in reports if r["round"] == 2}
  for k, value in enumerate(bad.values()):
    assert f"server-round={value!r} is invalid" in why[k], why[k]
    assert "1 to 3" in why[k], why[k]
  run = _federated_run(tmp_path / "run")
  for k in range(4):  # untouched by the refused round; round 3 started from round 1's state
    assert ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").carried_rounds(run) == [1, 3]


@pytest.mark.slow
def test_a_client_takes_the_delivered_round_as_untrusted(tmp_path):
  """``delivered-round`` comes from the server: not before this round, a string, or before the
  round an earlier message named (0 after round 1's update took the reply: a fresh start) is
  refused by name before anything runs. An older round the client still keeps is taken:
  that changes the method's numbers, not what the client reveals (docs/flower.md)."""
  from fedlap_flower import federated_runs

  config, overrides = CARRIED["scaffold"]
  overrides = overrides.replace("rounds=2", "rounds=3")
  bad = {101: 3, 102: 0, 103: "../1", 104: 1}
  key = federated_runs.DELIVERED_KEY
  changes = {n: (lambda v: lambda c: c.update({key: v}))(v) for n, v in bad.items()}
  rc = _run_config(tmp_path, config, overrides=overrides, **{"min-clients": 1})
  records, _ = run_inprocess(
    rc, grid_hook=_alter_round_messages(3, changes), state_root=tmp_path / "state"
  )
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4]] * 2 + [[3, 4]]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  why = {r["partition_id"]: r.get("reason", "") for r in reports if r["round"] == 3}
  assert f"{key}=3 is invalid" in why[0] and "0 to 2" in why[0], why[0]
  assert f"{key}=0 is refused" in why[1] and "round 1 took" in why[1], why[1]
  assert f"{key}='../1' is invalid" in why[2], why[2]
  run = _federated_run(tmp_path / "run")
  for k in range(3):  # untouched by the refused round
    assert ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").carried_rounds(run) == [1, 2]
  # Client 3 started round 3 from round 1's state, which it still kept, and dropped round 2's.
  assert ledger_lib.ClientState(tmp_path / "state" / "client-3").carried_rounds(run) == [1, 3]


@pytest.mark.slow
def test_a_dp_client_refusing_a_bad_round_or_delivered_round_charges_nothing(tmp_path):
  """Under DP (FedLAP-DP, its images carried between rounds) a ``server-round`` outside the
  run or a ``delivered-round`` not before the round is refused before the ledger: the client
  is charged round 1 only, and takes part again in round 3 (from round 1's images, the last
  round whose update took its reply)."""
  from fedlap_flower import federated_runs

  overrides = TINY.replace("rounds=2", "rounds=3")
  changes = {
    101: lambda c: c.update({"server-round": 99}),
    102: lambda c: c.update({federated_runs.DELIVERED_KEY: 2}),
  }
  rc = _run_config(
    tmp_path, "quickstart:dp_loops", overrides=overrides, **{"min-clients": 1, "max-epsilon": 50.0}
  )
  records, _ = run_inprocess(
    rc, grid_hook=_alter_round_messages(2, changes), state_root=tmp_path / "state"
  )
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4], [2, 3, 4], [0, 1, 2, 3, 4]]
  for k in range(5):
    hist = ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").history()
    assert [h["server_round"] for h in hist] == ([1, 3] if k < 2 else [1, 2, 3]), (k, hist)
  run = _federated_run(tmp_path / "run")
  for k in range(2):
    assert ledger_lib.ClientState(tmp_path / "state" / f"client-{k}").carried_rounds(run) == [1, 3]


def test_a_client_records_which_federated_run_and_experiment_its_state_belongs_to(tmp_path):
  """federated_runs.admit: 32 hex digits only; an identity stays with its experiment and a
  Flower run with its identity; a record it cannot read is refused, never reset."""
  from fedlap_flower import federated_runs

  state = ledger_lib.ClientState(tmp_path / "c0")
  digest = federated_runs.config_digest({"seed": 0, "rounds": 3})
  assert federated_runs.config_digest({"rounds": 3, "seed": 0}) == digest
  assert federated_runs.admit(state, RUN, 7, digest) == RUN
  assert federated_runs.admit(state, RUN, 8, digest) == RUN  # a resumed run: a new Flower run
  assert federated_runs.recorded(state)[RUN]["flower_runs"] == [7, 8]
  for bad in ("../" + RUN[3:], RUN.upper(), RUN + "0", 7, None):
    with pytest.raises(federated_runs.RefusedRun, match="32 hex digits"):
      federated_runs.admit(state, bad, 9, digest)
  with pytest.raises(federated_runs.RefusedRun, match="another experiment"):
    federated_runs.admit(state, RUN, 9, federated_runs.config_digest({"seed": 1, "rounds": 3}))
  with pytest.raises(federated_runs.RefusedRun, match=f"Flower run 8 as federated run {RUN}"):
    federated_runs.admit(state, "e" * 32, 8, digest)
  assert sorted(federated_runs.recorded(state)) == [RUN]
  assert stat.S_IMODE((state.directory / federated_runs.RECORD_FILE).stat().st_mode) == 0o600
  (state.directory / federated_runs.RECORD_FILE).write_text("{}")
  with pytest.raises(federated_runs.RefusedRun, match="cannot be read"):
    federated_runs.admit(state, RUN, 7, digest)
  # A state is one of a federated run's (a path component) and of its round.
  with pytest.raises(ValueError, match="32 hex digits"):
    state.save_carried("../x", 1, {"x": np.zeros(2, np.float32)})
  state.save_carried(RUN, 2, {"x": np.zeros(2, np.float32)})
  path = state.carried_path(RUN, 2)
  path.rename(state.carried_path(RUN, 3))
  from fedlap_jax.method import Wire

  wire = Wire.of({"x": jax.ShapeDtypeStruct((2,), np.float32)})
  with raises_field("state-dir"):
    state.load_carried(RUN, 3, wire)
  assert state.load_carried(RUN, 2, wire) is None and state.carried_rounds(RUN) == [3]


# The run-dir: a new run never overwrites one; resume = true continues it.
RESUMABLE = {
  "nondp": TINY.replace("rounds=2", "rounds=3"),
  "nondp_noise": TINY.replace("rounds=2", "rounds=3") + " synthetic_init=noise",  # carried images
  "fedavg": f"method=fedavg rounds=3 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  "fedadam": f"method=fedadam rounds=3 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
  "scaffold": CARRIED["scaffold"][1].replace("rounds=2", "rounds=3"),  # carried c_k
  "feddm": CARRIED["feddm"][1].replace("rounds=2", "rounds=3"),  # a carried synthetic set
  # FedLAP whose server carries its Adam state across rounds (saved in server_state.npz).
  "nondp_carry": TINY.replace("rounds=2", "rounds=3")
  + " server.optimizer.name=adam server.carry_state=True",
}


def _stop_at_round(server_round):
  """A grid hook: no node answers the train messages of ``server_round`` (the run stops)."""

  def hook(grid):
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
      messages = list(messages)
      if any(
        m.metadata.message_type == "train" and m.content["config"]["server-round"] == server_round
        for m in messages
      ):
        return []
      return real(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive

  return hook


def _lose_replies_of_round(server_round):
  """A grid hook: the nodes compute ``server_round`` (and keep their state after it), but the
  server receives none of their replies (it stopped after they answered)."""

  def hook(grid):
    real = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
      messages = list(messages)
      got = real(messages, timeout=timeout)
      if any(
        m.metadata.message_type == "train" and m.content["config"]["server-round"] == server_round
        for m in messages
      ):
        return []
      return got

    grid.send_and_receive = send_and_receive

  return hook


STOPS = {"unanswered": _stop_at_round, "replies lost": _lose_replies_of_round}


def _kept_states(state_root, run_dir) -> dict:
  """``{(client, file): arrays}`` of every carried state the clients keep for the run."""
  run = _federated_run(run_dir)
  out = {}
  for k in range(5):
    for f in sorted((Path(state_root) / f"client-{k}" / "runs" / run).glob("carried-*.npz")):
      with np.load(f) as z:
        out[(k, f.name)] = dict(z)
  return out


@pytest.mark.slow
def test_a_stopped_run_without_a_federated_identity_resumes_only_without_carried_state(tmp_path):
  """A run-dir written before runs had an identity: its clients kept their carried state under
  the Flower run id, which a resumed run cannot name, so resume = true is refused by name for
  SCAFFOLD (nothing is written); FedAvg's clients carry nothing, and it resumes under a new one."""
  for kind in ("scaffold", "fedavg"):
    rc = _run_config(tmp_path / kind, "quickstart:nondp", overrides=RESUMABLE[kind])
    with pytest.raises(strategy.TooFewClients):
      run_inprocess(rc, grid_hook=_stop_at_round(2), state_root=tmp_path / kind / "state")
    path = tmp_path / kind / "run" / "run_info.json"
    info = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in info.items() if k != "federated_run"}))
    before = path.read_text()
    resumed = {**rc, "resume": True}
    if kind == "scaffold":
      with raises_field("resume", settings.SettingsError) as e:
        run_inprocess(resumed, state_root=tmp_path / kind / "state", run_id=8)
      assert e.value.field == "resume" and path.read_text() == before
    else:
      records, _ = run_inprocess(resumed, state_root=tmp_path / kind / "state", run_id=8)
      assert (
        records[-1]["round"] == 3
        and _federated_run(tmp_path / kind / "run") != info["federated_run"]
      )


def test_the_server_state_round_trips(tmp_path):
  import jax

  from fedlap_runs import build
  from fedlap_flower import server_state, task

  run = settings.run_settings({"config": "quickstart:dp_loops"})
  params = build.init_model(run.cfg.model, (8, 8, 1), 10, jax.random.key(0)).params
  params = jax.tree.map(lambda p: p + 1.5, params)
  chain = jax.random.split(jax.random.key(3))[0]
  labels = {2: (np.arange(4, dtype=np.int32), np.array([True, True, False, False]))}
  state = server_state.ServerState(
    4, params, chain, labels, {0: 2.5, 3: 1.25}, {"num-examples": {"1": 283}}
  )
  server_state.save(tmp_path, state)
  back = server_state.load(tmp_path, params)
  assert (back.round, back.epsilon, back.pins) == (4, {0: 2.5, 3: 1.25}, state.pins)
  assert task.key_to_words(back.chain) == task.key_to_words(chain)
  np.testing.assert_array_equal(back.labels[2][0], labels[2][0])
  np.testing.assert_array_equal(back.labels[2][1], labels[2][1])
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert server_state.load(tmp_path / "none", params) is None


@pytest.mark.slow
def test_a_new_run_refuses_a_run_dir_holding_a_run(tmp_path):
  """A resubmitted run once reused the run-dir and truncated its metrics.jsonl."""
  rc = _run_config(tmp_path, "quickstart:nondp", overrides=TINY.replace("rounds=2", "rounds=1"))
  run_inprocess(rc, state_root=tmp_path / "state")
  before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
  with raises_field("run-dir", settings.SettingsError):
    run_inprocess(rc, state_root=tmp_path / "state")
  assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
  # resume = true is not a way around it: the run there is finished, or another experiment's.
  with raises_field("resume", settings.SettingsError):
    run_inprocess({**rc, "resume": True}, state_root=tmp_path / "state")
  (tmp_path / "run" / "done").unlink()
  with raises_field("resume", settings.SettingsError):
    run_inprocess(
      {**rc, "resume": True, "overrides": rc["overrides"] + " seed=1"},
      state_root=tmp_path / "state",
    )
  with raises_field("resume", settings.SettingsError):
    run_inprocess(
      {**rc, "resume": True, "run-dir": str(tmp_path / "empty")}, state_root=tmp_path / "state"
    )
  assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.name != "done"} == {
    k: v for k, v in before.items() if k != "done"
  }


@pytest.mark.slow
@pytest.mark.parametrize(
  "kind, stop",
  [(k, "unanswered") for k in RESUMABLE]
  + [("scaffold", "replies lost"), ("nondp_noise", "replies lost")],
)
def test_a_stopped_run_resumes_to_the_uninterrupted_runs_numbers(tmp_path, kind, stop):
  """Round 3 gets no replies and the run stops (its clients never asked, or they computed it
  and the server lost their replies); resume = true, a new Flower run, redoes round 3 from the
  state after round 2 (parameters, key chain, pins; each client's carried state, kept under
  the federated run's identity: SCAFFOLD's c_k, FedDM's set, FedLAP's images) and ends where
  the uninterrupted run ends: metrics, final model and each client's kept state."""
  straight = _run_config(tmp_path / "a", "quickstart:nondp", overrides=RESUMABLE[kind])
  want, _ = run_inprocess(straight, state_root=tmp_path / "a" / "state")
  rc = _run_config(tmp_path / "b", "quickstart:nondp", overrides=RESUMABLE[kind])
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(rc, grid_hook=STOPS[stop](3), state_root=tmp_path / "b" / "state")
  # The stopped round is logged; the run stops with the state after round 2.
  stopped = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
  assert [r["round"] for r in stopped] == [1, 2, 3] and "stopped" in stopped[2]
  run = _federated_run(tmp_path / "b" / "run")
  run_inprocess({**rc, "resume": True}, state_root=tmp_path / "b" / "state", run_id=8)
  assert _federated_run(tmp_path / "b" / "run") == run  # the resumed run keeps its identity
  got = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
  keys = ("round", "test_accuracy", "test_loss", "clients_ok", "server_radius", "client_radius")
  assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in want]
  # Timing is kept apart from the releasable metrics.jsonl, one record per round, and the
  # resume dropped the stopped round's.
  assert not any(k in r for r in got for k in strategy.TIMING_FIELDS)
  timing = read_jsonl(tmp_path / "b" / "run" / strategy.TIMING_FILE)
  assert [t["round"] for t in timing] == [1, 2, 3]
  assert all(t["round_seconds"] > 0 and t["wall_seconds"] > 0 for t in timing)
  with np.load(tmp_path / "a" / "run" / "final_params.npz") as a:
    with np.load(tmp_path / "b" / "run" / "final_params.npz") as b:
      assert sorted(a.files) == sorted(b.files)
      for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  info = json.loads((tmp_path / "b" / "run" / "run_info.json").read_text())
  assert info["resumed"] == [2]
  reports = json.loads((tmp_path / "b" / "run" / "client_reports.json").read_text())
  assert sorted({r["round"] for r in reports}) == [1, 2, 3]
  assert all(r["status"] == "ok" for r in reports if r["round"] == 3)
  kept = _kept_states(tmp_path / "b" / "state", tmp_path / "b" / "run")
  want_kept = _kept_states(tmp_path / "a" / "state", tmp_path / "a" / "run")
  assert sorted(kept) == sorted(want_kept)
  assert bool(kept) == (kind in ("nondp_noise", "scaffold", "feddm"))
  for where, arrays in want_kept.items():  # rounds 2 and 3's (a redo of 3 starts from 2's)
    assert sorted(kept[where]) == sorted(arrays), where
    for name, value in arrays.items():
      np.testing.assert_array_equal(kept[where][name], value, err_msg=f"{where}: {name}")


@pytest.mark.slow
def test_a_client_with_its_own_max_epsilon_refuses_a_run_without_dp(tmp_path):
  """The server cannot switch DP off for a client that set its own budget."""
  rc = _run_config(tmp_path, "quickstart:nondp", **{"min-clients": 1})
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(rc, node_configs(state_root=tmp_path / "state", **{"max-epsilon": 8.0}))
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  assert {r["status"] for r in reports} == {"refused"}
  assert all("takes part in DP runs only" in r["reason"] for r in reports)


@pytest.mark.slow
def test_clients_with_their_own_data_files(tmp_path, monkeypatch):
  """data-path: each client holds only its own records (here digits as 8x8 uint8 'mnist')."""
  from fedlap_runs import data as data_lib

  digits = data_lib.load_digits()
  x_train, y_train, x_test, y_test = (
    (a * 255).round().astype(np.uint8) if a.ndim == 4 else a for a in digits
  )
  np.savez(tmp_path / "server.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  parts = data_lib.partition(y_train, num_clients=5, scheme="paper", num_classes=10)
  nodes = {}
  most = 0  # the most classes a site holds: what sizes a synthetic set when no party knows
  for k, idx in enumerate(parts):
    # 283 records each (the smaller clients repeat some): the shapes of the padded
    # partitions, so the compiled round of the other DP tests serves these clients too.
    idx = np.resize(idx, 283)
    most = max(most, int(np.unique(y_train[idx]).size))
    np.savez(tmp_path / f"site{k}.npz", x_train=x_train[idx], y_train=y_train[idx])
    nodes[101 + k] = {
      "partition-id": k,
      "num-partitions": 5,
      "max-epsilon": 50.0,
      "data-path": str(tmp_path / f"site{k}.npz"),
      "state-dir": str(tmp_path / "state" / f"client-{k}"),
    }
  # The run names no file: the server's test split is the npz its own environment names.
  monkeypatch.setenv(settings.SERVER_DATA_ENV, str(tmp_path / "server.npz"))
  overrides = (
    TINY.replace("rounds=2", "rounds=1") + " data.name=mnist "
    "data.normalisation=published data.source=tfds"
  )
  rc = _run_config(
    tmp_path, "quickstart:dp_loops", overrides=overrides, **{"max-classes-per-client": most}
  )
  records, _ = run_inprocess(rc, nodes)
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4] and records[0]["test_accuracy"] > 0
  stored = json.loads((tmp_path / "state" / "client-3" / ledger_lib.LEDGER_FILE).read_text())
  assert stored["fingerprint"]["data"] == "own" and stored["fingerprint"]["num_records"] == 283
  assert len(stored["fingerprint"]["sha256"]) == 64
  # Statistics of a split (here quickstart:dp's test_split) are not the client's to compute:
  # it would normalise differently from the server's test split.
  bad = _run_config(
    tmp_path / "bad",
    "quickstart:dp_loops",
    overrides=overrides.replace("normalisation=published", "normalisation=test_split"),
    **{"min-clients": 1, "max-classes-per-client": most},
  )
  with pytest.raises(strategy.TooFewClients):
    run_inprocess(bad, nodes)
  reasons = [
    r["reason"] for r in json.loads((tmp_path / "bad" / "run" / "client_reports.json").read_text())
  ]
  assert len(reasons) == 5 and all(
    "data-path needs a fixed normalisation; data.normalisation='test_split' is invalid" in r
    for r in reasons
  ), reasons


# Run-config overrides and experiments.run's --config.FIELD=VALUE: ints, floats, bools, strings,
# tuples, and None for None-able fields (placeholders of fedlap_runs/configs/default.py).
SAME_OVERRIDES = (
  "seed=3 rounds=4 dp.noise_multiplier=2 dp.delta=1e-4 plots=false "
  "progress_bar=False data.source=sklearn client.dsa_strategy='' "
  "data.normalisation=given data.mean='(0.5,)' data.std=(0.25,) "
  "snapshot_rounds=(1,2) server.weighting=None dp.target_epsilon=none "
  "eval_chunk_size=None data.clients_per_round=None client.poisson_capacity=96"
)


def _cli_config(monkeypatch, name, items):
  """The config experiments.run's command line hands to its run (nothing is trained)."""
  from experiments import run, suite

  got = []
  monkeypatch.setattr(suite, "run_config", lambda config, workdir, label: got.append(config) or 0)
  rc = run.main(["prog", f"--config={name}", *(f"--config.{item}" for item in items)])
  return rc, (got[0] if got else None)


def test_override_strings_give_the_cli_config(monkeypatch):
  import shlex

  from fedlap_runs import flags

  items = shlex.split(SAME_OVERRIDES)
  rc, cli = _cli_config(monkeypatch, "quickstart:dp_loops", items)
  flower, label = settings.load_config("quickstart:dp_loops", SAME_OVERRIDES)
  assert rc == 0 and label == "quickstart_dp_loops"
  assert (
    cli.to_dict()
    == flower.to_dict()
    == flags.load_config("quickstart:dp_loops", items)[0].to_dict()
  )
  assert (flower.seed, flower.rounds, flower.dp.noise_multiplier, flower.dp.delta) == (
    3,
    4,
    2.0,
    1e-4,
  )
  assert flower.plots is False and flower.progress_bar is False
  assert (flower.data.source, flower.client.dsa_strategy) == ("sklearn", "")
  assert (flower.data.mean, flower.data.std, flower.snapshot_rounds) == ((0.5,), (0.25,), (1, 2))
  assert flower.server.weighting is None and flower.dp.target_epsilon is None
  assert flower.eval_chunk_size is None and flower.data.clients_per_round is None
  assert flower.client.poisson_capacity == 96


@pytest.mark.parametrize(
  "item, field",
  [
    ("client.nosuch=1", "client.nosuch"),
    ("nosection.x=1", "nosection.x"),
    ("rounds=abc", "rounds"),
    ("client.ipc=x", "client.ipc"),
    ("dp.delta=tiny", "dp.delta"),
    ("rounds=None", "rounds"),  # not None-able: no value of its type (seed is: None draws it)
    ("dp.target_epsilon=abc", "dp.target_epsilon"),
    ("plots=maybe", "plots"),
  ],
)
def test_a_bad_override_is_refused_by_both_naming_the_field(monkeypatch, capsys, item, field):
  from fedlap_runs import flags, library_configs

  rc, cli = _cli_config(monkeypatch, "quickstart:dp_loops", [item])
  assert rc == 2 and cli is None and field.split(".")[-1] in capsys.readouterr().err
  with pytest.raises(library_configs.ConfigError) as err:
    flags.load_config("quickstart:dp_loops", [item])
  assert err.value.field == field and str(err.value) in capsys.readouterr().err + str(err.value)
  with pytest.raises(settings.SettingsError) as err:
    settings.load_config("quickstart:dp_loops", item)
  assert field in str(err.value) and str(err.value).startswith("overrides: ")


def test_a_config_file_that_does_not_load_is_exit_2(monkeypatch, capsys, tmp_path):
  rc, _ = _cli_config(monkeypatch, str(tmp_path / "no_such.py"), [])
  assert rc == 2 and "no_such.py" in capsys.readouterr().err


def _tool(tmp_path):
  """A config file that, executed, leaves a mark (and then raises)."""
  tool = tmp_path / "tool.py"
  mark = tmp_path / "executed"
  tool.write_text(f"open({str(mark)!r}, 'w').write('ran')\nraise ValueError('a secret line')\n")
  return tool, mark


@pytest.mark.parametrize("config", ["tool.py", "tool.py:arg", "sub/tool", "x.py"])
def test_a_flower_run_names_configs_never_paths(tmp_path, monkeypatch, config):
  """A run config is another party's: a path would execute a file of the node's disk. It is
  refused before the disk is looked at: the message is the same whether the file exists."""
  tool, mark = _tool(tmp_path)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "tool").write_text(tool.read_text())
  messages = []
  for where in (tmp_path, tmp_path / "nothing_here"):
    for name in (config, str(where / config)):
      with pytest.raises(settings.SettingsError) as err:
        settings.run_settings({"config": name})
      assert err.value.field == "config", name
      messages.append(str(err.value).replace(name, "NAME"))
  assert not mark.exists()
  assert len(set(messages)) == 1, messages
  assert "is invalid: a path; allowed: NAME[:ARG] with NAME one of" in messages[0]
  assert "secret" not in messages[0] and "No such file" not in messages[0]


def test_experiments_run_still_runs_the_config_file_its_user_names(tmp_path, monkeypatch, capsys):
  """The command line is its user's own: a config path is executed there (and its error shown)."""
  tool, mark = _tool(tmp_path)
  rc, _ = _cli_config(monkeypatch, str(tool), [])
  assert rc == 2 and mark.read_text() == "ran"


@pytest.mark.slow
def test_a_run_naming_a_client_file_is_refused_alike_by_server_and_clients(tmp_path):
  """Through the app: the ServerApp and every ClientApp refuse config=PATH without running
  it, and a client's error reply is the same for a file that exists and one that does not."""
  from flwr.app import ConfigRecord, Message, MessageType, RecordDict
  from flower_harness import InProcessGrid, task_identity
  from fedlap_flower import client_app

  tool, mark = _tool(tmp_path)
  reasons = []
  for path in (tool, tmp_path / "missing.py"):
    rc = _run_config(tmp_path, str(path))
    with raises_field("config", settings.SettingsError):
      run_inprocess(rc, state_root=tmp_path / "state")
    grid = InProcessGrid(client_app.app, rc, node_configs(state_root=tmp_path / "state"))
    with task_identity():
      for kind, conf in (
        (MessageType.TRAIN, {"server-round": 1, "keys": "client"}),
        (MessageType.QUERY, {"server-round": 1, "ask": "partition-id"}),
      ):
        msg = Message(
          content=RecordDict({"config": ConfigRecord(conf)}), message_type=kind, dst_node_id=101
        )
        reply = grid.answer(msg)
        assert reply.has_error()
        reasons.append(reply.error.reason.replace(str(path), "PATH"))
  assert not mark.exists()
  assert reasons[:2] == reasons[2:] and "is invalid: a path" in reasons[0], reasons


@pytest.mark.parametrize(
  "item, field",
  [
    ("data.source=npz:/etc/any.npz", "data.source"),
    ("data.source='npz:~/x.npz'", "data.source"),
    ("data.data_dir=/tmp", "overrides"),
    ("data.cache_dir=/tmp", "overrides"),
    ("checkpoint_every=1", "overrides"),
    ("label=x", "overrides"),
    ("nosection.x=1", "overrides"),
  ],
)
def test_a_flower_run_overrides_only_allowed_fields(tmp_path, item, field):
  """An allow-list: nothing that names a file, a directory or code, checked before any read
  (no file at /etc/any.npz needed for the same refusal)."""
  with pytest.raises(settings.SettingsError) as err:
    settings.load_config("quickstart:dp_loops", item)
  assert err.value.field == field and str(err.value).startswith("overrides: "), str(err.value)
  assert "No such file" not in str(err.value) and "existing" not in str(err.value)
  # experiments.run (its user's own command line) takes every field.
  from fedlap_runs import flags

  if not item.startswith(("data.source", "nosection")):
    flags.load_config("quickstart:dp_loops", [item])


def test_the_allowed_overrides_are_sections_and_fields_of_the_algorithm():
  assert settings.overridable("client.ipc") and settings.overridable("dp.noise_multiplier")
  assert settings.overridable("data.num_clients") and not settings.overridable("data.cache_dir")
  assert not settings.overridable("client.") and not settings.overridable("data")
  assert not settings.overridable("client_backend.x") and not settings.overridable("seeds")
  cfg, _ = settings.load_config("quickstart:dp_loops", "data.source=sklearn")
  assert cfg.data.source == "sklearn"


def test_settings_errors_are_config_errors_naming_the_key():
  import fedlap_jax

  run = settings.run_settings({"config": "quickstart:dp_loops"})
  with pytest.raises(fedlap_jax.ConfigError) as err:
    settings.node_settings({"partition-id": 9, "num-partitions": 5}, run)
  assert (err.value.field, err.value.value) == ("partition-id", 9)
  with pytest.raises(fedlap_jax.ConfigError) as err:
    settings.run_settings({"config": "quickstart:dp_loops", "overrides": "client.ipc=x"})
  assert err.value.field == "client.ipc"
  # An unknown config name is the run config's 'config' key, not experiments.run's --config.
  with pytest.raises(fedlap_jax.ConfigError) as err:
    settings.run_settings({"config": "nosuch"})
  assert (err.value.field, err.value.value) == ("config", "nosuch")
  assert "config='nosuch' is invalid: no fedlap_runs/configs/nosuch.py" in str(err.value)


def test_dp_runs_never_weight_by_the_clients_record_counts():
  """A DP client does not release N_k: the settings refuse size weighting under DP."""
  from fedlap_runs import library_configs

  run = settings.run_settings(
    {"config": "quickstart:dp_loops", "overrides": "server.weighting=None"}
  )
  assert library_configs.library_config(run.cfg).server.weighting == "uniform"
  with pytest.raises(library_configs.ConfigError) as err:
    settings.run_settings({"config": "quickstart:dp_loops", "overrides": "server.weighting=size"})
  assert err.value.field == "server.weighting"
