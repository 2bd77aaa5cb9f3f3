"""The server against hostile clients, partition binding, client sampling, a client's own data.

Hostile replies go to the real strategies through the real ServerApp
(:func:`flower_harness.serve_with`): a :class:`flower_harness.ReplayGrid`
answers each train message with a reply the real ClientApp computed for the
same round (the server's keys make round 1 deterministic), one of them
tampered with. A bad reply must be dropped with a reason naming its field,
and the round must end with exactly the parameters the well-formed replies
alone give (the same run with the bad client silent).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
import types

import jax
import numpy as np
import pytest
from flax import traverse_util
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from flower_harness import (
  SAMPLED,
  SMALL_MODEL,
  TINY,
  InProcessGrid,
  ReplayGrid,
  node_configs,
  reference_run,
  run_inprocess,
  serve_with,
)
from fedlap_flower import binding, method_work, replies, settings, strategy, task
from fedlap_flower import ledger as ledger_lib
from fedlap_jax import accounting, update_bounds
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.method import Wire
from conftest import raises_field

ONE_ROUND = TINY.replace("rounds=2", "rounds=1")
# quickstart:dp (the hybrid: clients also send model deltas) at toy size, one round.
HYBRID_ONE = (
  "rounds=1 model.width=8 model.depth=1 client.max_outer=2 client.boost_loop=2 "
  "server.max_epochs=1 eval_chunk_size=128"
)
KINDS = {
  "nondp": ("quickstart:nondp", ONE_ROUND, {}),
  "hybrid": (
    "quickstart:dp",
    HYBRID_ONE,
    {"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  ),
  # The hybrid without the server's cap (replayed with the hybrid's replies).
  "hybrid_uncapped": ("quickstart:dp", HYBRID_ONE, {"unsafe-dp-keys-from-server": True}),
  "fedavg": (
    "quickstart:nondp",
    f"method=fedavg rounds=1 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
    {},
  ),
  "fedadam": (
    "quickstart:fedadam",
    f"rounds=1 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
    {},
  ),
  # FedLAP whose server carries its Adam state across rounds (kept in server_state.npz).
  "carry": (
    "quickstart:nondp",
    ONE_ROUND + " server.optimizer.name=adam server.carry_state=True",
    {},
  ),
  "dp_fedavg": (
    "quickstart:dp_loops",
    f"method=dp_fedavg rounds=1 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL}",
    {"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  ),
  # DP-FedAvg whose clients step with Adam (a bound per coordinate, not SGD's).
  "dp_fedavg_adam": (
    "quickstart:dp_loops",
    f"method=dp_fedavg rounds=1 baseline.local_epochs=1 eval_chunk_size=128 {SMALL_MODEL} "
    "baseline.client_optimizer.name=adam",
    {"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  ),
  "dp_scaffold": (
    "quickstart:dp_loops",
    "method=dp_scaffold rounds=1 baseline.local_epochs=1 eval_chunk_size=128",
    {"unsafe-dp-keys-from-server": True, "max-epsilon": 50.0},
  ),
}


def _rc(path, kind):
  config, overrides, extra = KINDS[kind]
  return {
    "config": config,
    "overrides": overrides,
    "run-dir": str(path / "run"),
    "min-clients": 3,
    **extra,
  }


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
  """``kind -> {node: RecordDict}``: round 1's replies of the real ClientApp (built once)."""
  cache = {}

  def get(kind):
    if kind not in cache:
      with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.UNSAFE_ENV, "1")
        path = tmp_path_factory.mktemp(f"genuine_{kind}")
        _, grid = run_inprocess(_rc(path, kind), state_root=path / "state")
      cache[kind] = {int(r.metadata.src_node_id): r.content for r in grid.replies}
      assert sorted(cache[kind]) == [101, 102, 103, 104, 105]
    return cache[kind]

  return get


@pytest.fixture(scope="module")
def replay(genuine, tmp_path_factory):
  """``(kind, script, first=None, silent=()) -> (records, reports, final params)``."""
  from fedlap_flower import client_app

  def run(kind, script, first=None, silent=()):
    path = tmp_path_factory.mktemp(kind)
    rc = _rc(path, kind)
    grid = ReplayGrid(client_app.app, rc, node_configs(state_root=path / "state"), script, first)
    grid.silent.update(silent)
    with pytest.MonkeyPatch.context() as mp:
      mp.setenv(settings.UNSAFE_ENV, "1")
      records = serve_with(grid, rc)
    reports = json.loads((path / "run" / "client_reports.json").read_text())
    with np.load(path / "run" / "final_params.npz") as f:
      final = dict(f)
    run.last_run_dir = path / "run"
    return records, reports, final

  return run


def _swap(content, **new_records):
  return RecordDict({**dict(content.items()), **new_records})


def _metrics(content, **values):
  return _swap(content, metrics=MetricRecord({**dict(content["metrics"]), **values}))


def _update(content, **arrays):
  """``content`` with these arrays of its ``"update"`` record (by the method's wire names)."""
  old = {k: a.numpy() for k, a in content["update"].items()}
  return _swap(content, update=ArrayRecord({k: Array(v) for k, v in {**old, **arrays}.items()}))


def _synthetic(content, **arrays):
  return _update(content, **{f"synthetic.{k}": v for k, v in arrays.items()})


def _first_leaf(content, record, fn):
  leaves = {k: a.numpy() for k, a in content[record].items()}
  first = sorted(leaves)[0]
  leaves[first] = fn(leaves[first])
  return _swap(content, **{record: ArrayRecord({k: Array(v) for k, v in leaves.items()})})


def _first_delta(content, fn):
  first = sorted(k for k in content["update"] if k.startswith("model_delta."))[0]
  return _update(content, **{first: fn(content["update"][first].numpy())})


def _x(c):
  return c["update"]["synthetic.x"].numpy()


def _y(c):
  return c["update"]["synthetic.y"].numpy()


def _slots(c, n):
  return _synthetic(
    c, x=np.resize(_x(c), (n, *_x(c).shape[1:])), y=np.resize(_y(c), n), mask=np.ones(n, bool)
  )


def _label(c, value):
  y = _y(c).copy()
  y[0] = value
  return _synthetic(c, y=y)


# (kind, node sending the bad reply, field its reason names, tamper(content) -> content)
HOSTILE = {
  "images_9x9": (
    "nondp",
    101,
    "synthetic.x",
    lambda c: _synthetic(c, x=np.zeros((len(_x(c)), 9, 9, 1), np.float32)),
  ),
  "radius_list": ("nondp", 101, "radius", lambda c: _update(c, radius=np.ones(1, np.float32))),
  "string_array": (
    "nondp",
    101,
    "synthetic.x",
    lambda c: _synthetic(c, x=np.full(_x(c).shape, "a")),
  ),
  "delta_3e38": (
    "hybrid",
    101,
    "delta",
    lambda c: _first_delta(c, lambda a: np.full_like(a, 3e38)),
  ),
  "images_3e38": ("nondp", 101, "x", lambda c: _synthetic(c, x=np.full_like(_x(c), 3e38))),
  # The same under a carried server state: the dropped reply reaches neither model nor state.
  "carried_images_3e38": ("carry", 101, "x", lambda c: _synthetic(c, x=np.full_like(_x(c), 3e38))),
  "num_examples_nan": (
    "nondp",
    101,
    "num-examples",
    lambda c: _metrics(c, **{"num-examples": math.nan}),
  ),
  # The wire's shapes are refused by name before any value is read (here the first one named).
  "slots_20000": ("nondp", 101, "synthetic.mask", lambda c: _slots(c, 20_000)),
  "label_10": ("nondp", 101, "y", lambda c: _label(c, 10)),
  # Past the int32 the counts are aggregated in (the server once died of it).
  "num_examples_2**40": (
    "nondp",
    101,
    "num-examples",
    lambda c: _metrics(c, **{"num-examples": 2**40}),
  ),
  # Below the floor: with radius_strategy='min' the server would take one step.
  "radius_1e-30": (
    "nondp",
    101,
    "radius",
    lambda c: _update(c, radius=np.array(1e-30, np.float32)),
  ),
  # Above the run's max-epsilon=50, which every client keeps.
  "epsilon_above_the_cap": ("hybrid", 101, "epsilon", lambda c: _metrics(c, epsilon=1e6)),
  # Node 102 holds partition 1 and answers first, claiming partition 0.
  "other_partition": ("nondp", 102, "partition-id", lambda c: _metrics(c, **{"partition-id": 0})),
  "well_formed": ("nondp", None, None, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_bad_reply_is_dropped_and_the_round_equals_the_good_replies_alone(case, genuine, replay):
  kind, node, field, tamper = HOSTILE[case]
  good = genuine(kind)
  script = dict(good)
  if tamper is not None:
    script[node] = tamper(good[node])
  records, reports, final = replay(kind, script, first=node)
  got_dir = replay.last_run_dir
  want_records, _, want_final = replay(kind, good, silent=[node] if node else [])
  if kind == "carry":  # the carried Adam state too is the good replies' alone
    got, want = _carried_server_state(got_dir), _carried_server_state(replay.last_run_dir)
    assert got and sorted(got) == sorted(want)
    for name in got:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"]
  assert "update_refused" not in records[0]
  assert set(final) == set(want_final)
  for name in final:
    assert np.isfinite(final[name]).all(), name
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  assert (records[0]["test_accuracy"], records[0]["test_loss"]) == (
    want_records[0]["test_accuracy"],
    want_records[0]["test_loss"],
  )
  bad = [r for r in reports if r["status"] != "ok"]
  if node is None:
    assert not bad and records[0]["clients_ok"] == [0, 1, 2, 3, 4]
    return
  assert len(bad) == 1 and bad[0]["node_id"] == node and bad[0]["status"] == "invalid", bad
  assert bad[0]["field"] == field and field in bad[0]["reason"], bad[0]


# FedAvg: the replies are model parameters.
FEDAVG_HOSTILE = {
  "arrays_wrong_shape": (
    101,
    "arrays/",
    lambda c: _first_leaf(
      c, "arrays", lambda a: np.zeros((*a.shape[:-1], a.shape[-1] + 1), a.dtype)
    ),
  ),
  "string_array": (
    101,
    "arrays/",
    lambda c: _first_leaf(c, "arrays", lambda a: np.full(a.shape, "a")),
  ),
  "nan_parameter": (
    101,
    "arrays/",
    lambda c: _first_leaf(c, "arrays", lambda a: np.full_like(a, np.nan)),
  ),
  "num_examples_nan": (101, "num-examples", lambda c: _metrics(c, **{"num-examples": math.nan})),
  "num_examples_list": (101, "num-examples", lambda c: _metrics(c, **{"num-examples": [1, 2]})),
  "num_examples_2**40": (101, "num-examples", lambda c: _metrics(c, **{"num-examples": 2**40})),
  "other_partition": (102, "partition-id", lambda c: _metrics(c, **{"partition-id": 0})),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FEDAVG_HOSTILE))
def test_fedavg_drops_a_bad_reply(case, genuine, replay):
  node, field, tamper = FEDAVG_HOSTILE[case]
  good = genuine("fedavg")
  records, reports, final = replay("fedavg", {**good, node: tamper(good[node])}, first=node)
  want_records, _, want_final = replay("fedavg", good, silent=[node])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  bad = [r for r in reports if r["status"] != "ok"]
  assert len(bad) == 1 and bad[0]["node_id"] == node and bad[0]["status"] == "invalid", bad
  assert bad[0]["field"].startswith(field) and field.rstrip("/") in bad[0]["reason"], bad[0]


@pytest.mark.slow
@pytest.mark.parametrize(
  "case", ["nan_parameter", "arrays_wrong_shape", "num_examples_nan", "other_partition"]
)
def test_a_registry_method_of_fedavgs_wire_drops_a_bad_reply_naming_the_field(
  case, genuine, replay
):
  """FedAdam through the generic strategy: the same reply checks, the round equals the good
  replies alone (its server step on them)."""
  node, field, tamper = FEDAVG_HOSTILE[case]
  good = genuine("fedadam")
  records, reports, final = replay("fedadam", {**good, node: tamper(good[node])}, first=node)
  want_records, _, want_final = replay("fedadam", good, silent=[node])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  bad = [r for r in reports if r["status"] != "ok"]
  assert len(bad) == 1 and bad[0]["node_id"] == node and bad[0]["status"] == "invalid", bad
  assert bad[0]["field"].startswith(field) and field.rstrip("/") in bad[0]["reason"], bad[0]


DP_FEDAVG_HOSTILE = {
  "nan_parameter": FEDAVG_HOSTILE["nan_parameter"],
  "epsilon_above_the_cap": (101, "epsilon", lambda c: _metrics(c, epsilon=1e6)),
  "epsilon_missing": (
    101,
    "epsilon",
    lambda c: _swap(
      c, metrics=MetricRecord({k: v for k, v in dict(c["metrics"]).items() if k != "epsilon"})
    ),
  ),
  "a_record_count_under_dp": (101, "metrics", lambda c: _metrics(c, **{"num-examples": 283})),
  "status_odd": (101, "status", lambda c: _swap(c, status=ConfigRecord({"status": "fine"}))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DP_FEDAVG_HOSTILE))
def test_a_dp_registry_method_drops_a_bad_reply_naming_the_field(case, genuine, replay):
  """DP-FedAvg through the generic strategy: a reply without its epsilon, above the cap, with
  a record count (nothing but the model and the DP figures leaves a DP client) is dropped."""
  node, field, tamper = DP_FEDAVG_HOSTILE[case]
  good = genuine("dp_fedavg")
  records, reports, final = replay("dp_fedavg", {**good, node: tamper(good[node])}, first=node)
  want_records, _, want_final = replay("dp_fedavg", good, silent=[node])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"] == [1, 2, 3, 4]
  assert records[0]["epsilon"] == want_records[0]["epsilon"]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  bad = [r for r in reports if r["status"] != "ok"]
  assert len(bad) == 1 and bad[0]["node_id"] == node and bad[0]["status"] == "invalid", bad
  assert bad[0]["field"].startswith(field) and field.rstrip("/") in bad[0]["reason"], bad[0]


@pytest.mark.slow
@pytest.mark.parametrize("part", ["control_delta", "params"])
def test_a_dp_scaffold_reply_beyond_its_bounds_is_refused_by_field(part, genuine, replay):
  """A hostile DP-SCAFFOLD client adds 1e3 / sqrt(d) to every entry of its control delta (or
  its model): refused naming that part, the round equals the run without that client."""
  good = genuine("dp_scaffold")
  old = {k: a.numpy() for k, a in good[101]["update"].items() if k.startswith(part + ".")}
  size = sum(a.size for a in old.values())
  pushed = {k: a + np.float32(1e3 / math.sqrt(size)) for k, a in old.items()}
  records, reports, final = replay(
    "dp_scaffold", {**good, 101: _update(good[101], **pushed)}, first=101
  )
  want_records, _, want_final = replay("dp_scaffold", good, silent=[101])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"] == [1, 2, 3, 4]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  (bad,) = [r for r in reports if r["status"] != "ok"]
  assert bad["node_id"] == 101 and bad["status"] == "invalid" and bad["field"] == part, bad
  assert part in bad["reason"] and "allowed: at most" in bad["reason"], bad["reason"]


def _pushed(content, scale: float = 1e3):
  """The reply's model ``w_k + scale * u`` (``u`` a unit direction): ``||w_k - w_g||`` about
  ``scale``, whatever the honest update was."""
  (name,) = content["arrays"].keys()  # the parameters travel packed into one array
  w = content["arrays"][name].numpy()
  w = w + np.float32(scale / math.sqrt(w.size))
  return _swap(content, arrays=ArrayRecord({name: Array(w)}))


@pytest.mark.slow
def test_a_dp_fedavg_reply_beyond_the_update_bound_is_refused_with_its_norm(genuine, replay):
  """A hostile DP-FedAvg client sends w_g + 1e3 u: it would move the uniform mean by 200. The
  server refuses it by name, logging the norm and the bound (never clipping it), and the
  round equals the run without that client; every honest reply is inside its bound."""
  good = genuine("dp_fedavg")
  records, reports, final = replay("dp_fedavg", {**good, 101: _pushed(good[101])}, first=101)
  want_records, _, want_final = replay("dp_fedavg", good, silent=[101])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"] == [1, 2, 3, 4]
  assert records[0]["clients_invalid"] == [0]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  (bad,) = [r for r in reports if r["status"] != "ok"]
  assert bad["node_id"] == 101 and bad["status"] == "invalid" and bad["field"] == "update-norm"
  assert "update-norm" in bad["reason"] and "max-update-norm" in bad["reason"]
  assert bad["update_norm"] > 900 and bad["update_norm"] > bad["max_update_norm"] > 0
  ok = [r for r in reports if r["status"] == "ok"]
  ratios = [r["update_norm"] / r["max_update_norm"] for r in ok]
  assert len(ok) == 4 and all(0.2 < q < 1 for q in ratios), ratios


@pytest.mark.slow
def test_an_adam_dp_fedavg_reply_beyond_its_derived_bound_is_refused(genuine, replay):
  """DP-FedAvg with Adam clients: the server derives eta_m sqrt(d) sum_t A_t (Adam moves each
  coordinate by at most about eta_m a step) and refuses w_g + 1e3 u by name; the round equals
  the run without that client, and every honest reply is inside the bound."""
  good = genuine("dp_fedavg_adam")
  records, reports, final = replay("dp_fedavg_adam", {**good, 101: _pushed(good[101])}, first=101)
  want_records, _, want_final = replay("dp_fedavg_adam", good, silent=[101])
  assert records[0]["clients_ok"] == want_records[0]["clients_ok"] == [1, 2, 3, 4]
  for name in final:
    np.testing.assert_array_equal(final[name], want_final[name], err_msg=name)
  (bad,) = [r for r in reports if r["status"] != "ok"]
  assert bad["node_id"] == 101 and bad["field"] == "update-norm", bad
  assert bad["update_norm"] > 900 and bad["update_norm"] > bad["max_update_norm"] > 0
  ok = [r for r in reports if r["status"] == "ok"]
  assert len(ok) == 4 and all(0 < r["update_norm"] < r["max_update_norm"] for r in ok), ok


# b2 = 0: Adam's second moment forgets what its first remembers; no step bound follows.
FORGETS = "baseline.client_optimizer.name=adam baseline.client_optimizer.b2=0.0"


@pytest.mark.parametrize("value", ["", "auto"])
def test_a_dp_run_whose_client_optimiser_has_no_bound_needs_a_stated_max_update_norm(
  tmp_path, monkeypatch, value
):
  """A DP-FedAvg run whose clients' steps have no bound: the default would accept any reply,
  so the server refuses the run config by max-update-norm before the run-dir is written; a
  number (or an explicit 'none') is what it runs with. (Plain SGD derives its bound as before:
  test_a_dp_fedavg_reply_beyond_the_update_bound_is_refused_with_its_norm.)"""
  rc = {**_rc(tmp_path, "dp_fedavg"), "max-update-norm": value}
  rc["overrides"] += f" {FORGETS}"
  monkeypatch.setenv(settings.UNSAFE_ENV, "1")
  with raises_field("max-update-norm"):
    run_inprocess(rc, state_root=tmp_path / "state")
  assert not (tmp_path / "run").exists()
  from fedlap_runs import library_configs

  cfg = settings.run_settings(rc).cfg
  method = method_work.method_of(cfg)
  config = library_configs.library_config(cfg, max_client_size=100)
  assert replies.update_norm_rule(2.5, method, config, None)(None) == 2.5
  assert replies.update_norm_rule(None, method, config, None)(None) is None


@pytest.mark.slow
def test_the_update_bound_follows_the_run_config(genuine, replay, tmp_path):
  """max-update-norm='none' accepts the hostile reply (what the bound prevents: the round
  differs from the run without it); a number is that bound for every reply."""
  from fedlap_flower import client_app

  good = genuine("dp_fedavg")
  script = {**good, 101: _pushed(good[101])}

  def run(path, value):
    rc = {**_rc(path, "dp_fedavg"), "max-update-norm": value}
    grid = ReplayGrid(client_app.app, rc, node_configs(state_root=path / "state"), script, 101)
    with pytest.MonkeyPatch.context() as mp:
      mp.setenv(settings.UNSAFE_ENV, "1")
      try:
        records = serve_with(grid, rc)
      except strategy.TooFewClients:
        records = None
    return records, json.loads((path / "run" / "client_reports.json").read_text())

  records, reports = run(tmp_path / "none", "none")
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4]
  assert all("max_update_norm" not in r for r in reports)
  records, reports = run(tmp_path / "tight", 1e-9)  # every reply refused: below min-clients
  assert records is None and len(reports) == 5
  assert {r["field"] for r in reports if r["status"] == "invalid"} == {"update-norm"}
  assert all(r["max_update_norm"] == 1e-9 for r in reports)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, "tight", True])
def test_a_bad_max_update_norm_is_refused_by_name(value):
  with raises_field("max-update-norm", settings.SettingsError):
    settings.run_settings({"config": "quickstart:nondp", "max-update-norm": value})


def test_max_update_norm_values_and_what_auto_needs():
  """'' and 'auto' derive the bound where the method has one; 'auto' without DP is a
  ConfigError naming the field (a number for a method whose update is not a model, FedLAP's
  included, is refused when the server starts:
  test_a_number_for_max_update_norm_is_refused_for_an_update_that_is_not_a_model)."""
  from fedlap_flower import method_work

  rc = {"config": "quickstart:nondp", "overrides": "method=fedavg"}
  assert settings.run_settings(rc).max_update_norm == ""
  assert settings.run_settings({**rc, "max-update-norm": "none"}).max_update_norm is None
  assert settings.run_settings({**rc, "max-update-norm": 5}).max_update_norm == 5.0
  from fedlap_runs import library_configs

  cfg = settings.run_settings(rc).cfg
  fedavg, config = method_work.method_of(cfg), library_configs.library_config(cfg)
  with raises_field("max-update-norm"):
    replies.update_norm_rule("auto", fedavg, config, None)
  assert replies.update_norm_rule("", fedavg, config, None)(None) is None
  assert replies.update_norm_rule(2.5, fedavg, config, None)(None) == 2.5


def _tamper_round(grid, node: int, server_round: int, tamper) -> None:
  """Makes ``node``'s real reply to round ``server_round``'s train message ``tamper(content)``."""
  from flwr.app import Message

  real = grid.answer

  def answer(msg):
    reply = real(msg)
    if (
      msg.metadata.dst_node_id == node
      and msg.metadata.message_type == "train"
      and msg.content["config"]["server-round"] == server_round
    ):
      return Message(content=tamper(reply.content), reply_to=msg)
    return reply

  grid.answer = answer


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nondp", "fedavg"])
def test_a_partitions_num_examples_is_pinned_at_its_first_accepted_reply(kind, tmp_path):
  """Round 1 pins N_k; node 101 claiming one record more in round 2 is dropped."""
  config, overrides, extra = KINDS[kind]
  rc = {**_rc(tmp_path, kind), "overrides": overrides.replace("rounds=1", "rounds=2")}
  hook = functools.partial(
    _tamper_round,
    node=101,
    server_round=2,
    tamper=lambda c: _metrics(c, **{"num-examples": int(c["metrics"]["num-examples"]) + 1}),
  )
  records, _ = run_inprocess(rc, grid_hook=hook, state_root=tmp_path / "state")
  assert [r["clients_ok"] for r in records] == [[0, 1, 2, 3, 4], [1, 2, 3, 4]]
  reports = json.loads((tmp_path / "run" / "client_reports.json").read_text())
  bad = [r for r in reports if r["status"] != "ok"]
  assert [(r["round"], r["node_id"], r["field"]) for r in bad] == [(2, 101, "num-examples")]
  assert "first accepted reply said" in bad[0]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nondp", "fedavg"])
def test_an_aggregation_that_raises_keeps_the_model_and_the_run(
  kind, genuine, replay, tmp_path, monkeypatch
):
  """Whatever slips past the reply checks and makes the aggregation raise (here: the real
  clients' replies, replayed) costs the round's update, never the run."""
  from fedlap_flower import server_work

  def boom(*args, **kwargs):
    raise OverflowError("Python int too large to convert to C long")

  good = genuine(kind)
  monkeypatch.setattr(server_work, "method_update", boom)  # every strategy's server step
  records, _, final = replay(kind, good)
  assert len(records) == 1 and records[0]["clients_ok"] == [0, 1, 2, 3, 4]
  assert records[0]["update_refused"] == (
    "the aggregate raised OverflowError: Python int too large to convert to C long; the "
    "previous global model is kept"
  )
  assert math.isfinite(records[0]["test_loss"])
  initial = _initial_params(tmp_path, kind)
  assert set(final) == set(initial)
  for name, value in initial.items():
    np.testing.assert_array_equal(final[name], value, err_msg=name)


@pytest.mark.slow
def test_the_published_epsilon_is_the_accepted_clients_self_reports(genuine, replay):
  """A refusal's epsilon (here an absurd 1e9 of node 101) is reported, never published."""
  good = genuine("hybrid")
  refusal = RecordDict(
    {
      "metrics": MetricRecord({"partition-id": 0, "epsilon": 1e9}),
      "status": ConfigRecord({"status": "refused", "reason": "budget", "keys": "server"}),
    }
  )
  records, reports, _ = replay("hybrid", {**good, 101: refusal})
  rec = records[0]
  assert rec["clients_ok"] == [1, 2, 3, 4] and rec["clients_refused"] == [0]
  assert sorted(rec["epsilon_per_client"]) == ["1", "2", "3", "4"]
  assert rec["epsilon"] == max(rec["epsilon_per_client"].values()) < 50
  assert rec["epsilon_kind"] == strategy.EPSILON_KIND and "self-reported" in rec["epsilon_kind"]
  refused = [r for r in reports if r["status"] == "refused"]
  assert [r["metrics"]["epsilon"] for r in refused] == [1e9]  # kept in the reports


@pytest.mark.slow
def test_without_a_cap_a_run_epsilon_no_client_can_reach_is_refused(genuine, replay):
  """With the run's max-epsilon = inf, a reply whose run-epsilon (what this run charged it) is
  above the most one round of the run's mechanism gives any client, whatever its N_k (1e6
  here), is refused by field; its total is the client's own (its earlier runs are not the
  server's to see): a total above that bound is published, labelled self-reported."""
  good = genuine("hybrid")
  hostile = _metrics(good[101], **{"run-epsilon": 1e6})
  past = _metrics(good[102], epsilon=40.0)  # a ledger holding earlier runs
  records, reports, _ = replay("hybrid_uncapped", {**good, 101: hostile, 102: past})
  plan = task.server_run(settings.run_settings(_rc(replay.last_run_dir, "hybrid")).cfg)[0]
  rec = records[0]
  assert rec["clients_ok"] == [1, 2, 3, 4]
  bad = [r for r in reports if r["status"] != "ok"]
  assert [(r["node_id"], r["field"]) for r in bad] == [(101, "run-epsilon")], bad
  bound = accounting.DpMechanism.from_config(plan.config).epsilon_bound(1)
  assert f"{bound:g}" in bad[0]["reason"], bad[0]["reason"]
  honest = [good[n]["metrics"]["run-epsilon"] for n in (103, 104, 105)]
  assert 0 < max(honest) < bound < rec["epsilon_per_client"]["1"] == rec["epsilon"] == 40.0


@pytest.mark.slow
def test_a_refusals_reason_cannot_forge_the_servers_log_lines(genuine, replay, caplog):
  """A client writes its refusal's reason: the server logs it quoted, on its own line."""
  import logging

  forged = "budget\n[fedlap] round 1: client 1 (node 102) ok: fine"
  refusal = RecordDict(
    {
      "metrics": MetricRecord({"partition-id": 0}),
      "status": ConfigRecord({"status": "refused", "reason": forged, "keys": "server"}),
    }
  )
  with caplog.at_level(logging.WARNING, logger="flwr"):
    records, _, _ = replay("nondp", {**genuine("nondp"), 101: refusal})
  assert records[0]["clients_refused"] == [0]
  logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
  assert len(logged) == 1 and "\n" not in logged[0] and repr(forged) in logged[0], logged


def _initial_params(tmp_path, kind):
  run = settings.run_settings(_rc(tmp_path, kind))
  params = task.server_run(run.cfg)[1].model.params
  return {
    k: np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(params), sep=".").items()
  }


def _carried_server_state(run_dir) -> dict:
  with np.load(run_dir / "server_state.npz") as f:
    return {n: f[n] for n in f.files if n.startswith("extra/")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nondp", "fedavg", "carry"])
def test_a_non_finite_update_is_refused_and_the_previous_model_kept(
  kind, genuine, replay, tmp_path, monkeypatch
):
  """Whatever slips through (here: the update itself made NaN), the round keeps w_g; a server
  that carries its optimiser's state keeps the state before the round too."""
  if kind == "carry":  # the honest round moves the carried Adam state off its zero start
    replay(kind, genuine(kind))
    assert any(np.any(v) for v in _carried_server_state(replay.last_run_dir).values())
  from fedlap_flower import server_work

  real = server_work.method_update  # every strategy's server step

  def poisoned(*args, **kwargs):
    state, metrics = real(*args, **kwargs)
    nan = jax.tree.map(lambda p: np.full_like(np.asarray(p), np.nan), state.params)
    return state._replace(params=nan), metrics

  monkeypatch.setattr(server_work, "method_update", poisoned)
  records, reports, final = replay(kind, genuine(kind))
  assert "NaN or Inf" in records[0]["update_refused"]
  assert "previous global model is kept" in records[0]["update_refused"]
  assert records[0]["clients_ok"] == [0, 1, 2, 3, 4] and math.isfinite(records[0]["test_loss"])
  initial = _initial_params(tmp_path, kind)
  assert set(final) == set(initial)
  for name, value in initial.items():
    np.testing.assert_array_equal(final[name], value, err_msg=name)
  if kind == "carry":  # Adam's start (zero moments, count 0), not the refused round's state
    carried = _carried_server_state(replay.last_run_dir)
    assert carried and not any(np.any(v) for v in carried.values()), carried


@pytest.mark.slow
def test_honest_model_deltas_stay_far_inside_the_bound(genuine):
  """The hybrid's deltas, as the real clients send them, against max_delta_norm."""
  from fedlap_runs import library_configs

  run = settings.run_settings({"config": "quickstart:dp", "overrides": HYBRID_ONE})
  fc = library_configs.library_config(run.cfg)
  eta = float(np.float32(federated.round_learning_rates(1, fc).client))
  for content in genuine("hybrid").values():
    update = content["update"]
    leaves = {k: a.numpy() for k, a in update.items() if k.startswith("model_delta.")}
    bound = update_bounds.matching_delta_bound(fc.client, eta, sum(v.size for v in leaves.values()))
    norm = replies.check_delta_norm(leaves, bound)
    assert 0 < norm < bound / 2, (norm, bound)


# ----------------------------------------------------------------------------
# Reply checks, one at a time (no server).
# ----------------------------------------------------------------------------

LIMITS = replies.SyntheticLimits((8, 8, 1), 10, 2, 100.0)


def _set(classes=(3, 5), pad=2):
  y = np.concatenate([np.repeat(np.asarray(classes, np.int32), 2), np.zeros(pad, np.int32)])
  mask = np.arange(len(y)) < 2 * len(classes)
  return np.zeros((len(y), 8, 8, 1), np.float32), y, mask


@pytest.mark.parametrize(
  "change, field",
  [
    (lambda x, y, m: (x[:, :7], y, m), "x"),
    (
      lambda x, y, m: (
        np.zeros((21, 8, 8, 1), np.float32),
        np.zeros(21, np.int32),
        np.ones(21, bool),
      ),
      "x",
    ),
    (lambda x, y, m: (x.astype(np.float64), y, m), "x"),
    (lambda x, y, m: (x, y.astype(np.int64), m), "y"),
    (lambda x, y, m: (np.full_like(x, np.inf), y, m), "x"),
    (lambda x, y, m: (np.full_like(x, 101.0), y, m), "x"),
    (lambda x, y, m: (x, np.where(np.arange(6) == 0, -1, y).astype(np.int32), m), "y"),
    (lambda x, y, m: (x, y[[0, 2, 1, 3, 4, 5]], m), "y"),
    (lambda x, y, m: (x, np.asarray([5, 5, 3, 3, 0, 0], np.int32), m), "y"),
    (lambda x, y, m: (x, y, m[[4, 0, 1, 2, 3, 5]]), "mask"),
    (lambda x, y, m: (x, y, np.arange(6) < 3), "mask"),
    (lambda x, y, m: (x, np.asarray([3, 3, 5, 5, 1, 0], np.int32), m), "y"),
  ],
)
def test_synthetic_set_checks_name_the_field(change, field):
  x, y, mask = _set()
  replies.check_synthetic(x, y, mask, LIMITS)  # the well-formed set passes
  with raises_field(field, replies.InvalidReply):
    replies.check_synthetic(*change(x, y, mask), LIMITS)


@pytest.mark.parametrize(
  "metrics, check, field",
  [
    ({"num-examples": math.nan}, lambda m: replies.check_num_examples(m, True), "num-examples"),
    ({"num-examples": 2.0}, lambda m: replies.check_num_examples(m, True), "num-examples"),
    ({"num-examples": 0}, lambda m: replies.check_num_examples(m, True), "num-examples"),
    # Beyond the bound: the int32 counts of the aggregation would overflow.
    ({"num-examples": 2**40}, lambda m: replies.check_num_examples(m, True), "num-examples"),
    ({"num-examples": 2**24 + 1}, lambda m: replies.check_num_examples(m, True), "num-examples"),
    ({"epsilon": -1.0}, lambda m: replies.check_epsilon(m, True), "epsilon"),
    ({"epsilon": 3.5}, lambda m: replies.check_epsilon(m, True, max_epsilon=3.0), "epsilon"),
    ({"epsilon": 10**400}, lambda m: replies.check_epsilon(m, True), "epsilon"),
    (
      {"run-epsilon": 4.0},
      lambda m: replies.check_epsilon(m, True, 3.08, "the most 1 rounds", key="run-epsilon"),
      "run-epsilon",
    ),
    ({"partition-id": 7}, lambda m: replies.check_partition(m, 5), "partition-id"),
    ({"partition-id": 1}, lambda m: replies.check_partition(m, 5, bound=2), "partition-id"),
  ],
)
def test_metric_checks_name_the_field(metrics, check, field):
  with raises_field(field, replies.InvalidReply):
    check(metrics)


def test_the_delta_bound_follows_the_config():
  """DP hybrid: min(r + eta G, max_outer eta G); without DP (no clip) no bound."""
  from fedlap_runs import library_configs

  run = settings.run_settings({"config": "quickstart:dp"})
  c = library_configs.library_config(run.cfg).client
  d = 10_000
  bound = update_bounds.matching_delta_bound(c, 0.1, d)
  t = update_bounds.TAIL_LOG / 3 + math.sqrt(
    update_bounds.TAIL_LOG**2 / 9 + 2 * update_bounds.TAIL_LOG * c.batch_size
  )
  g = c.dp.l2_clip_norm * (
    c.batch_size + t
  ) / c.batch_size + c.dp.noise_multiplier * c.dp.l2_clip_norm * (math.sqrt(d) + math.sqrt(160)) / (
    c.batch_size * math.sqrt(c.batch_loop)
  )
  assert bound == pytest.approx(1.001 * min(c.radius + 0.1 * g, c.max_outer * 0.1 * g))
  assert update_bounds.matching_delta_bound(c, 0.2, d) > bound  # grows with eta_m
  nondp = library_configs.library_config(
    settings.run_settings({"config": "quickstart:nondp"}).cfg
  ).client
  assert update_bounds.matching_delta_bound(nondp, 0.1, d) is None
  leaves = {"a": np.full(4, 3e38, np.float32)}
  with raises_field("delta", replies.InvalidReply):
    replies.check_delta_norm(leaves, bound)


def test_fedlaps_method_value_holds_its_update_bounds_and_round_numbers():
  """FedLAP's Method.check_update (what the Flower strategy applies to an update): r_k in
  [radius_floor(eta_m), r] and, under DP with noisy_real model steps, ||model_delta|| at most
  the delta bound at eta_m; each refusal names the field. Method.round_record: the server's
  numbers of a round, the clients' r_k in their updates' order, r_g None when not finite."""
  from fedlap_runs import library_configs
  from fedlap_jax.methods.fedlap import state as federated
  from fedlap_jax.methods.fedlap import server
  from fedlap_jax.methods.fedlap.client import ClientUpdate
  from fedlap_jax.method import RunFacts
  from fedlap_jax.methods import fedlap

  d = 10_000
  facts = RunFacts((8, 8, 1), 5, d, 2)
  dp = library_configs.library_config(settings.run_settings({"config": "quickstart:dp"}).cfg)
  nondp = library_configs.library_config(settings.run_settings({"config": "quickstart:nondp"}).cfg)
  eta = np.float32(0.1)
  message = fedlap.Message(None, federated.RoundRates(eta, np.float32(1.0)), None)
  bound = update_bounds.matching_delta_bound(dp.client, float(eta), d)
  r = float(np.float32(dp.client.radius))

  def update(radius, delta_norm=None):
    delta = None if delta_norm is None else {"w": np.full(d, delta_norm / 100, np.float32)}
    return ClientUpdate(None, np.float32(radius), delta)

  def refused(config, u, field):
    with raises_field(field):
      fedlap.METHOD.check_update(config, facts)(message, u)

  check = fedlap.METHOD.check_update(dp, facts)
  check(message, update(r, 0.99 * bound))  # honest: passes
  check(message, update(update_bounds.radius_floor(float(eta))))
  refused(dp, update(r, 1.01 * bound), "delta")
  refused(dp, update(1.01 * r), "radius")  # above the radius the config allows
  refused(dp, update(1e-30), "radius")  # below the round's radius floor
  fedlap.METHOD.check_update(nondp, facts)(message, update(1.0, 1e30))  # no clip: no bound

  metrics = federated.RoundMetrics(
    (), np.ones(5, np.float32), server.ServerMetrics(3, 7, np.float32(0.5), np.float32(2.5)), eta
  )
  assert fedlap.METHOD.round_record(metrics) == {
    "client_radius": [1.0] * 5,
    "server_radius": 2.5,
    "server_epochs": 3,
    "server_steps": 7,
    "server_distance": 0.5,
    "learning_rate": float(eta),
  }
  fixed = metrics._replace(server=metrics.server._replace(radius=np.float32(np.inf)))
  assert fedlap.METHOD.round_record(fixed)["server_radius"] is None


# ----------------------------------------------------------------------------
# Partition binding.
# ----------------------------------------------------------------------------


def _ec_key():
  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric import ec

  key = ec.generate_private_key(ec.SECP384R1())
  pem = key.public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
  )
  ssh = key.public_key().public_bytes(
    serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
  )
  return pem, ssh


def test_key_fingerprint_is_what_ssh_keygen_prints(tmp_path):
  pem, ssh = _ec_key()
  fingerprint = binding.key_fingerprint(pem)
  assert binding.FINGERPRINT.match(fingerprint)
  if shutil.which("ssh-keygen") is None:
    pytest.skip("ssh-keygen is not installed")
  (tmp_path / "k.pub").write_bytes(ssh + b"\n")
  out = subprocess.run(
    ["ssh-keygen", "-l", "-f", str(tmp_path / "k.pub")], capture_output=True, text=True, check=True
  ).stdout
  assert out.split()[1] == fingerprint


def test_first_come_binding():
  b = binding.PartitionBinding(3)
  early, late = (
    binding.NodeFacts(7, "", "2024-01-01T00:00:01"),
    binding.NodeFacts(8, "", "2024-01-01T00:00:02"),
  )
  # Two claims for one free partition: the node that connected first gets it.
  refused = b.claim([(late, 0), (early, 0)])
  assert b.node_of(0) == 7 and set(refused) == {8} and "connected first" in refused[8]
  # A later claim for a held partition is refused; a free one is bound.
  refused = b.claim([(binding.NodeFacts(9), 0), (binding.NodeFacts(10), 1)])
  assert "held by node 7" in refused[9] and b.partition_of(10) == 1
  # Equal (or unknown) connection times bind nobody.
  refused = b.claim([(binding.NodeFacts(11), 2), (binding.NodeFacts(12), 2)])
  assert set(refused) == {11, 12} and b.node_of(2) is None
  # A node the SuperLink no longer lists frees its partition.
  assert b.release_absent([7, 9]) == [10] and b.node_of(1) is None
  with pytest.raises(ValueError, match="partition-keys decides"):
    binding.PartitionBinding(3, {"SHA256:" + "A" * 43: 0}).claim([])


def test_a_pin_keeps_a_partitions_first_value_past_its_nodes_binding():
  b = binding.PartitionBinding(3)
  b.claim([(binding.NodeFacts(7, "", "t1"), 0)])
  b.pin(0, "num-examples", 283)
  b.pin(0, "num-examples", 283)  # the same value again is fine
  with raises_field("num-examples") as err:
    b.check_pinned(0, "num-examples", 284)
  assert err.value.value == 284 and err.value.allowed.startswith("283,")
  b.release_absent([])  # the node leaves; the partition's records do not change
  b.claim([(binding.NodeFacts(8, "", "t2"), 0)])
  with raises_field("num-examples"):
    b.pin(0, "num-examples", 2**24)
  assert b.pins == {"num-examples": {"0": 283}}
  fresh = binding.PartitionBinding(3)
  fresh.restore_pins(b.pins)
  with pytest.raises(ValueError):
    fresh.check_pinned(0, "num-examples", 1)


def test_the_radius_floor_is_a_thousandth_of_the_rounds_learning_rate():
  assert update_bounds.radius_floor(0.1) == float(np.float32(1e-4))
  assert update_bounds.radius_floor(1e-6) == float(np.float32(1e-9))
  # A round at eta_m = 1e-6 (far below any default schedule's): an honest r_k of 6.9e-5 passes.
  assert update_bounds.check_radius(6.9e-5, 5.0, update_bounds.radius_floor(1e-6)) == 6.9e-5


@pytest.mark.parametrize(
  "config, overrides",
  [
    ("quickstart:nondp", ""),
    ("quickstart:dp", ""),
    ("quickstart:nondp", "method=scaffold"),
    ("quickstart:nondp", "method=feddm synthetic_init=noise server.radius_strategy=fixed"),
  ],
)
def test_a_clients_round_templates_are_traced_shapes_of_the_plan(config, overrides):
  """What a client reads a message, its own inputs and its kept state back against is the
  plan's structure, shapes and dtypes, traced (``jax.ShapeDtypeStruct`` leaves: nothing of the
  method's init or plan is compiled or run for it on a client) and kept for the next round."""
  run = settings.run_settings({"config": config, "overrides": overrides})
  setup = task.client_run(
    run.cfg, 0, int(run.cfg.data.num_clients), None, plan=task.named_plan(run.cfg)
  )
  method, config_ = method_work.method_of(run.cfg), setup.plan.config
  facts = method_work.run_facts(run.cfg, setup.plan.facts, setup.model.num_params)
  leaves, treedef = jax.tree.flatten(jax.tree.map(method_work.shape_of, setup.model.params))
  got = method_work.round_templates(method, config_, facts, treedef, tuple(leaves))
  assert method_work.round_templates(method, config_, facts, treedef, tuple(leaves)) is got
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(got))
  state = method_work.initial_state(method, config_, setup.model.params, jax.random.key(0), facts)
  plan = method_work.plan_fn(method, 1, config_)(state)
  want = (
    method_work.without_model(plan.message),
    jax.tree.map(lambda a: a[0], plan.own),
    tuple(jax.tree.map(lambda a: a[0], getattr(state, f)) for f in method.carried),
  )
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  # ...and the wire they are read back by (key leaves as their uint32 words)
  wire = lambda tree: Wire.of(jax.tree.map(method_work.shape_of, tree))  # noqa: E731
  assert wire(got) == wire(want)
  assert list(wire(want).names()) == list(method_work.tree_to_arrays(want))


def test_a_client_drawing_its_own_inputs_draws_keys_only():
  """Under DP a client replaces each key of its own inputs by 128 fresh bits; an own input that
  is not a key (it would keep the template's value) is refused, naming it."""
  draws = iter(range(10, 20))
  own = ((), jax.random.key(0), {"k": jax.random.key(1)})
  fresh = method_work.fresh_keys(own, lambda: jax.random.key(next(draws)))
  assert [int(jax.random.key_data(k)[1]) for k in jax.tree.leaves(fresh)] == [10, 11]
  with pytest.raises(ValueError, match=r"'images'.* not PRNG keys"):
    method_work.fresh_keys({"k": jax.random.key(0), "images": np.zeros(2, np.float32)}, lambda: 0)


def test_partition_keys_bind_by_key_only():
  keys = {"SHA256:" + "A" * 43: 0, "SHA256:" + "B" * 43: 1}
  b = binding.PartitionBinding(2, keys)
  refused = b.bind_by_key(
    [
      binding.NodeFacts(5, "SHA256:" + "B" * 43),
      binding.NodeFacts(6, "SHA256:" + "C" * 43),
      binding.NodeFacts(7, ""),
    ]
  )
  assert b.node_of(1) == 5 and b.node_of(0) is None
  assert set(refused) == {6, 7} and "is not listed" in refused[6]


@pytest.mark.parametrize(
  "text",
  [
    "0=SHA256:abc",
    "5=SHA256:" + "A" * 43,
    "0=SHA256:" + "A" * 43 + " 0=SHA256:" + "B" * 43,
    "0=SHA256:" + "A" * 43 + " 1=SHA256:" + "A" * 43,
  ],
)
def test_bad_partition_keys_are_refused(text):
  with raises_field("partition-keys", settings.SettingsError):
    settings.run_settings({"config": "quickstart:dp_loops", "partition-keys": text})


def _select(rc, nodes, infos=None, rounds=1):
  """The FedLAP strategy's Participation.select on an in-process grid (no training)."""
  from flower_harness import task_identity
  from fedlap_flower import client_app

  run = settings.run_settings(rc)
  grid = InProcessGrid(client_app.app, rc, nodes)
  grid.node_infos.update(infos or {})
  p = strategy.Participation(
    run.cfg,
    partition_keys=run.partition_keys,
    min_clients=run.min_clients,
    round_timeout=1.0,
    join_timeout=0.0,
  )
  with task_identity():
    out = [p.select(grid, r) for r in range(1, rounds + 1)]
  return out, grid


def test_a_second_node_claiming_a_partition_is_the_one_left_out(tmp_path):
  from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

  rc = {"config": "quickstart:dp_loops"}
  nodes = {
    **node_configs(state_root=tmp_path),
    106: {"partition-id": 0, "num-partitions": 5, "state-dir": str(tmp_path / "x")},
  }
  infos = {
    n: NodeInfo(node_id=n, last_activated_at=f"2024-01-01T00:00:{n - 100:02d}") for n in nodes
  }
  [(asked, chosen, reports)], grid = _select(rc, nodes, infos)
  assert asked == {101: 0, 102: 1, 103: 2, 104: 3, 105: 4} and chosen == [0, 1, 2, 3, 4]
  assert [(r["node_id"], r["status"], r["field"]) for r in reports] == [
    (106, "invalid", "partition-id")
  ]
  assert "held by node 101, which connected first" in reports[0]["reason"]
  # Bound nodes are not asked again; the intruder is, and is refused again.
  _, grid2 = _select(rc, nodes, infos, rounds=2)
  queried = [m.metadata.dst_node_id for m in grid2.sent if m.metadata.message_type == "query"]
  assert sorted(queried) == [101, 102, 103, 104, 105, 106, 106]


def test_partition_keys_decide_and_unlisted_keys_take_no_part(tmp_path):
  from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

  pems = {n: _ec_key()[0] for n in range(101, 107)}
  # Node 106 says partition 0 in its node config, but the operator listed its key for 4;
  # node 105's key is not listed.
  keys = " ".join(
    f"{k}={binding.key_fingerprint(pems[n])}"
    for k, n in [(0, 101), (1, 102), (2, 103), (3, 104), (4, 106)]
  )
  rc = {"config": "quickstart:dp_loops", "partition-keys": keys, "min-clients": 4}
  nodes = {**node_configs(), 106: {"partition-id": 0, "num-partitions": 5}}
  infos = {n: NodeInfo(node_id=n, public_key=pems[n]) for n in nodes}
  [(asked, _, reports)], grid = _select(rc, nodes, infos)
  assert asked == {101: 0, 102: 1, 103: 2, 104: 3, 106: 4}
  assert [(r["node_id"], r["field"]) for r in reports] == [(105, "partition-keys")]
  assert not grid.sent  # nothing is asked of the nodes: their keys decide


# ----------------------------------------------------------------------------
# Client sampling.
# ----------------------------------------------------------------------------


def test_the_flower_participants_are_experiments_runs():
  from fedlap_jax import participation

  cfg, _ = settings.load_config("quickstart:dp_loops", SAMPLED + " data.participation_seed=3")
  for r in (1, 2, 7):
    want = participation.sample_clients(3, r, 20, 5)
    np.testing.assert_array_equal(task.participants(cfg, r), want)
    for j, k in enumerate(want):
      assert task.key_slot(cfg, r, int(k)) == (j, 5)
    assert task.key_slot(cfg, r, int(np.setdiff1d(np.arange(20), want)[0])) is None
  full, _ = settings.load_config("quickstart:dp_loops", TINY)
  assert task.key_slot(full, 1, 3) == (3, 5)  # without sampling: split(key, K)[k], as before


def test_min_clients_is_checked_against_the_clients_of_a_round():
  run = settings.run_settings({"config": "quickstart:dp_loops", "overrides": SAMPLED})
  assert run.min_clients == 5
  with raises_field("min-clients", settings.SettingsError):
    settings.run_settings({"config": "quickstart:dp_loops", "overrides": SAMPLED, "min-clients": 6})


# The generic strategy's DP method over sampled rounds (DP at the edge, ledgers per client).
SAMPLED_DP_FEDAVG = " method=dp_fedavg baseline.local_epochs=1 eval_chunk_size=128"


@pytest.mark.slow
@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
@pytest.mark.parametrize(
  "overrides", [SAMPLED, SAMPLED + SAMPLED_DP_FEDAVG], ids=["fedlap", "dp_fedavg"]
)
def test_sampled_rounds_equal_experiments_run(tmp_path, monkeypatch, overrides):
  """data.clients_per_round=5 of 20, DP with the test-only server keys: the server asks
  only the drawn clients, and its numbers are experiments.run's; each client's ledger
  holds only the rounds it computed, at experiments.run's per-client epsilon."""
  from fedlap_jax import accounting

  monkeypatch.setenv(settings.UNSAFE_ENV, "1")
  rc = {
    "config": "quickstart:dp_loops",
    "overrides": overrides,
    "run-dir": str(tmp_path / "run"),
    "unsafe-dp-keys-from-server": True,
    "max-epsilon": 50.0,
  }
  records, grid = run_inprocess(rc, node_configs(20, state_root=tmp_path / "state"))
  ref = reference_run("quickstart:dp_loops", overrides, tmp_path / "ref")
  assert len(records) == len(ref) == 2
  for got, want in zip(records, ref):
    assert got["clients"] == got["clients_ok"] == want["clients"]
    assert (got["test_accuracy"], got["test_loss"]) == (want["test_accuracy"], want["test_loss"])
    assert got["epsilon"] == want["epsilon"]
  trained = [
    sorted(
      m.metadata.dst_node_id - 101
      for m in grid.sent
      if m.metadata.message_type == "train" and m.content["config"]["server-round"] == r
    )
    for r in (1, 2)
  ]
  assert trained == [r["clients"] for r in records]
  ledgers = accounting.ClientLedgers.from_dict(
    json.loads((tmp_path / "ref" / "privacy_ledger.json").read_text())
  )
  for k in range(20):
    state = tmp_path / "state" / f"client-{k}"
    hist = ledger_lib.ClientState(state).history() if state.exists() else []
    assert [h["server_round"] for h in hist] == [
      r["round"] for r in records if k in r["clients"]
    ], k
    if hist:
      assert hist[-1]["epsilon"] == ledgers.ledgers[k].epsilon
  assert records[-1]["epsilon"] == max(ledgers.epsilons)


# ----------------------------------------------------------------------------
# A client's own data file.
# ----------------------------------------------------------------------------


def _npz(path, **arrays):
  np.savez(path, **arrays)
  return path


@pytest.mark.parametrize(
  "arrays, match",
  [
    (
      dict(x_train=np.full((4, 8, 8, 1), np.nan, np.float32), y_train=np.zeros(4, np.int64)),
      "holds 256 NaN or Inf values",
    ),
    (
      dict(x_train=np.full((4, 8, 8, 1), np.inf, np.float32), y_train=np.zeros(4, np.int64)),
      "NaN or Inf",
    ),
    (
      dict(x_train=np.full((4, 8, 8, 1), 1e300), y_train=np.zeros(4, np.int64)),
      r"NaN or Inf values \(as float32\)",
    ),
    (
      dict(x_train=np.zeros((0, 8, 8, 1), np.float32), y_train=np.zeros(0, np.int64)),
      "allowed: N >= 1",
    ),
    (
      dict(x_train=np.zeros((4, 8, 0, 1), np.float32), y_train=np.zeros(4, np.int64)),
      "allowed: N >= 1",
    ),
    (
      dict(x_train=np.zeros((4, 8, 8, 1), np.float32), y_train=np.zeros(4, np.float32)),
      "y_train has dtype float32; allowed: integer labels",
    ),
    (
      dict(x_train=np.zeros((4, 8, 8, 1), np.float32), y_train=np.array(list("abcd"))),
      "y_train has dtype <U1",
    ),
    (
      dict(x_train=np.full((4, 8, 8, 1), "a"), y_train=np.zeros(4, np.int64)),
      "x_train has dtype <U1",
    ),
    (
      dict(x_train=np.zeros((4, 8, 8, 1), np.float32), y_train=np.zeros((4, 1), np.int64)),
      r"y_train \(4, 1\)",
    ),
    (
      dict(x_train=np.array([None] * 4, dtype=object), y_train=np.zeros(4, np.int64)),
      "cannot be read as an npz of numeric arrays",
    ),
    (None, "cannot be read as an npz"),
  ],
)
def test_a_clients_own_data_file_is_checked(tmp_path, arrays, match):
  cfg, _ = settings.load_config("quickstart:dp_loops")
  cfg.data.name, cfg.data.normalisation = "mnist", "published"  # what a data-path client needs
  path = tmp_path / "site.npz"
  if arrays is None:
    path.write_bytes(b"not a zip file")
  else:
    _npz(path, **arrays)
  with pytest.raises(ValueError, match=match) as err:
    task.load_own_data(cfg, path)
  assert str(err.value).startswith(f"data-path {path}")


def test_collect_replies_keeps_each_reply_in_its_own_error_boundary():
  def reply(node):
    return types.SimpleNamespace(
      metadata=types.SimpleNamespace(reply_to_message_id="", src_node_id=node)
    )

  def parse_one(msg, node, report):
    report["upload_bytes"] = 8
    if node == 12:
      raise replies.InvalidReply("radius", "radius=-1 is invalid")
    return ({11: 1, 13: 0}[node], f"from {node}")

  state = {"asked": {11: 1, 12: 2, 13: 0, 14: 3}, "messages": [], "reports": [{"pre": 1}]}
  msgs = [reply(n) for n in (11, 12, 99, 13, 11)]
  usable, reports = strategy.collect_replies(state, 5, msgs, parse_one, round_timeout=30)
  assert usable == [(0, "from 13"), (1, "from 11")]  # partition order
  assert reports[0] == {"pre": 1}
  got = [(r["node_id"], r["partition_id"], r["status"]) for r in reports[1:]]
  assert got == [
    (11, 1, "ok"),
    (12, 2, "invalid"),
    (99, None, "invalid"),
    (13, 0, "ok"),
    (11, 1, "invalid"),
    (14, 3, "missing"),
  ]
  assert reports[2]["field"] == "radius" and "upload_bytes" not in reports[2]
  assert "not asked this round" in reports[3]["reason"]
  assert "a second reply from node 11" in reports[5]["reason"]
  assert reports[6]["reason"] == "no reply within round-timeout=30 s"
  assert all(r["round"] == 5 for r in reports[1:])


@pytest.mark.parametrize(
  "overrides",
  ["method=scaffold rounds=1 baseline.local_epochs=1", ONE_ROUND],
  ids=["scaffold", "fedlap"],
)
def test_a_number_for_max_update_norm_is_refused_for_an_update_that_is_not_a_model(
  tmp_path, overrides
):
  """SCAFFOLD sends its model and its control delta, FedLAP its synthetic set and r_k: a norm
  bound on ``w_k - w_g`` would check nothing of that update, so a number for it is refused
  when the server starts, by name, before the run-dir is written."""

  rc = {
    "config": "quickstart:nondp",
    "overrides": overrides,
    "run-dir": str(tmp_path / "run"),
    "max-update-norm": 5.0,
  }
  with raises_field("max-update-norm"):
    run_inprocess(rc, state_root=tmp_path / "state")
  assert not (tmp_path / "run").exists()
