"""``server.carry_state``: FedLAP's server optimiser's state carried across rounds as a config
value, end to end (``experiments.run``'s config, its checkpoints and resume), refused by name
where no server reads it, and the default (``False``) is the paper's round as it was."""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import optax
import pytest

from experiments import resume, train

from fedlap_runs import library_configs, method_entries
from fedlap_jax import rounds
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.config import ServerConfig, fixed_epochs_server
from fedlap_jax.methods.condensation.one_shot import CondensationConfig, OneShotConfig
from fedlap_jax.methods.feddm.distribution_matching import FedDMConfig
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY

from test_experiments_run import TIMING, tiny_config
from conftest import raises_field

# Tiny FedLAP-DP (digits, ConvNet-8x1), 3 rounds, Adam as the server's descent: its moments
# are what a carried state holds.
ADAM_SERVER = {
  "rounds": 3,
  "checkpoint_every": 1,
  "snapshot_rounds": (),
  "progress_bar": False,
  "plots": False,
  "server.optimizer.name": "adam",
}


def _adam_count(opt_state) -> int:
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
  return int(adam.count)


def _records(out):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in out["records"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Straight runs with and without ``server.carry_state``, and the carried run stopped in
  round 3 (after round 2's checkpoint) and resumed."""
  from fault_run import install  # pylint: disable=g-import-not-at-top

  carried = dict(ADAM_SERVER, **{"server.carry_state": True})
  fresh = train.train_and_evaluate(tiny_config(**ADAM_SERVER), tmp_path_factory.mktemp("fresh"))
  straight = train.train_and_evaluate(tiny_config(**carried), tmp_path_factory.mktemp("carried"))
  workdir = tmp_path_factory.mktemp("resumed")
  mp = pytest.MonkeyPatch()

  def stop():
    raise RuntimeError("stopped in round 3")

  install("round", 3, stop, mp.setattr)
  with pytest.raises(RuntimeError, match="stopped in round 3"):
    train.train_and_evaluate(tiny_config(**carried), workdir)
  mp.undo()
  resumed = train.train_and_evaluate(tiny_config(**carried), workdir)
  return fresh, straight, resumed


@pytest.mark.slow
def test_carry_state_reaches_the_server_step_and_a_resumed_run_keeps_it(runs):
  """With ``server.carry_state=True`` the state holds Adam's moments after every round's
  descent (its count is every server step so far, so each round's step started from the last
  one's state), the run differs from the restarting one from round 2 on (round 1 starts from
  a fresh state both ways), and a run stopped in round 3 resumes from round 2's checkpoint,
  the carried state included, to the same records and state bit for bit."""
  fresh, straight, resumed = runs
  assert fresh["state"].opt_state == ()
  steps = [r["server_steps"] for r in straight["records"]]
  assert len(steps) == 3 and min(steps) > 0
  assert _adam_count(straight["state"].opt_state) == sum(steps)
  a, b = _records(fresh), _records(straight)
  assert a[0] == b[0]
  assert a[1]["test_loss"] != b[1]["test_loss"]
  assert _records(resumed) == b
  chex.assert_trees_all_equal(resumed["state"], straight["state"])


def test_carry_state_is_a_run_defining_field_and_old_checkpoints_ran_without_it():
  assert resume.ADDED_FIELDS["server.carry_state"] is False
  now = resume.run_defining_fields(tiny_config())
  carried = resume.run_defining_fields(tiny_config(**{"server.carry_state": True}))
  before = {k: v for k, v in now.items() if k != "server.carry_state"}
  meta = lambda stored: {"privacy": {}, "config": stored}  # noqa: E731
  resume.check_resume_compatible(meta(before), {}, now, "WORKDIR")
  with pytest.raises(resume.ResumeError) as err:
    resume.check_resume_compatible(meta(before), {}, carried, "WORKDIR")
  assert err.value.fields == ["server.carry_state"]


def test_carry_state_is_refused_by_name_where_no_server_carries_it():
  for value in ("yes", 1):
    with raises_field("server.carry_state") as err:
      ServerConfig(carry_state=value)
    assert err.value.allowed == "True or False"
  carrying = dataclasses.replace(fixed_epochs_server(1), carry_state=True)
  with raises_field("server.carry_state"):
    FedDMConfig(server=carrying)
  for method in ("dsc", "psg"):
    private = method == "psg"
    cond = CondensationConfig(
      classwise=not private, dp=method_entries.dp_config(tiny_config()) if private else None
    )
    with raises_field("server.carry_state"):
      OneShotConfig(method=method, condensation=cond, server=carrying)
  # experiments.run: FedLAP takes it; the FedAvg family, FedDM and PSG refuse it by name.
  cfg = tiny_config(**{"server.carry_state": True})
  assert library_configs.validate_config(cfg).server.carry_state is True
  for method, extra in (
    ("dp_fedavg", {}),
    ("fedadam", {"dp.enabled": False}),
    ("feddm", {"dp.enabled": False, "server.radius_strategy": "fixed"}),
    (
      "psg",
      {
        "rounds": 1,
        "server.radius_strategy": "fixed",
        "condense.outer_loop": 1,
        "condense.inner_loop": 1,
      },
    ),
  ):
    cfg = tiny_config(method=method, **{"server.carry_state": True, **extra})
    with pytest.raises(ConfigError) as err:
      library_configs.validate_config(cfg)
    assert err.value.field == "server.carry_state", (method, str(err.value))
    assert f"False for method={method!r}" in str(err.value)


@pytest.mark.bitwise
def test_the_default_is_the_paper_round_and_carrying_plain_sgd_changes_no_number(
  linear_apply_fn, linear_params, clients
):
  """``carry_state=False`` (the default) keeps ``opt_state = ()``; carrying plain SGD (a state
  without numbers) gives the same parameters as restarting it."""
  from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig

  config = FedLAPConfig(
    client=ClientConfig(
      ipc=2,
      iterations=1,
      max_outer=1,
      batch_loop=1,
      boost_loop=1,
      batch_size=32,
      calibrate_radius=False,
      dsa_strategy="",
    ),
    server=ServerConfig(radius_strategy="constant", max_epochs=1, dsa_strategy=""),
    rounds=3,
    learning_rate=0.5,
    synthetic_init="noise",
  )
  assert config.server.carry_state is False
  carrying = dataclasses.replace(
    config, server=dataclasses.replace(config.server, carry_state=True)
  )
  facts = rounds.run_facts(linear_params, clients)
  key = jax.random.PRNGKey(21)
  out = {}
  for name, c in (("default", config), ("carried", carrying)):
    alg = rounds.algorithm(
      REGISTRY["fedlap"], c, ModelFns(linear_apply_fn), facts, client_backend="map"
    )
    state = alg.init(key, linear_params, clients)
    for _ in range(2):
      state, _ = alg.round(state, clients)
    out[name] = state
  assert out["default"].opt_state == ()
  assert out["carried"].opt_state != ()
  chex.assert_trees_all_equal(out["default"].params, out["carried"].params)
  assert np.isfinite(np.asarray(jax.tree.leaves(out["default"].params)[0])).all()
