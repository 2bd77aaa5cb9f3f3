"""The server optimiser's state in checkpoints: a carried Adam state is saved and restored, and
a checkpoint written before ``opt_state`` existed (a state without the field) still resumes
through :func:`experiments.resume.restore_newest_valid`, as ``experiments.run`` resumes."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import chex
import jax
import optax
import pytest

from experiments import resume

from fedlap_runs import checkpointing, configs
from fedlap_jax import baselines, optim, rounds
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods import fedavg as fedavg_methods
from fedlap_jax.types import PyTree

pytestmark = pytest.mark.bitwise  # a resumed round against the uninterrupted one, bit for bit

FEDAVG = baselines.baseline_config(
  "fedavg", rounds=3, learning_rate=0.1, local_epochs=1, batch_size=32, prox_mu=0.0, dp=None
)
PAPER = FedLAPConfig(
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
FEDYOGI = dataclasses.replace(FEDAVG, server_optimizer=optim.Optimizer(name="yogi"), server_lr=0.01)
ADAM = optax.scale_by_adam()
FEDAVG_ADAM = fedavg_methods.family("fedavg", server_optimizer=ADAM)  # built once: a jit static


def _count(opt_state) -> int:
  """The step count of the one Adam state inside ``opt_state``."""
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
  return int(adam.count)


# ------------------------------------------------------------------------------------------
# Checkpoints: the server's state is saved; a checkpoint from before the field resumes.
# ------------------------------------------------------------------------------------------


class _BaselineStateBefore(NamedTuple):
  """BaselineState as it was before ``opt_state`` (same fields, same order)."""

  params: PyTree
  round: jax.Array
  key: jax.Array
  control: PyTree = None
  client_controls: PyTree = None


class _FedLAPStateBefore(NamedTuple):
  params: PyTree
  synthetic: PyTree
  round: jax.Array
  key: jax.Array


def _resume(directory, template):
  ckpt = checkpointing.Checkpointer(directory)
  r, state, _, damaged = resume.restore_newest_valid(
    ckpt, template, privacy={}, fields={}, fresh_ledger=None, workdir=directory
  )
  ckpt.close()
  assert damaged == []
  return r, state


def _save(directory, round_index, state):
  ckpt = checkpointing.Checkpointer(directory)
  meta = {"round": round_index, "ledger": None, "privacy": {}, "config": {}}
  ckpt.save(round_index, state, meta)
  ckpt.close()


def test_a_checkpoint_written_before_opt_state_resumes(
  tmp_path, linear_apply_fn, linear_params, clients
):
  model, facts = ModelFns(linear_apply_fn), rounds.run_facts(linear_params, clients)
  algo = rounds.algorithm(REGISTRY["fedavg"], FEDAVG, model, facts)
  template = algo.init(jax.random.PRNGKey(11), linear_params, clients)
  state, _ = algo.round(template, clients)
  before = _BaselineStateBefore(*state[:5])
  _save(tmp_path / "baseline", 1, before)
  r, restored = _resume(tmp_path / "baseline", template)
  assert r == 1 and restored.opt_state == ()
  chex.assert_trees_all_equal(restored.params, state.params)
  chex.assert_trees_all_equal(restored.key, state.key)
  chex.assert_trees_all_equal(algo.round(restored, clients)[0], algo.round(state, clients)[0])

  fl = rounds.algorithm(REGISTRY["fedlap"], PAPER, model, facts)
  template = fl.init(jax.random.PRNGKey(12), linear_params, clients)
  _save(tmp_path / "fedlap", 0, _FedLAPStateBefore(*template[:4]))
  r, restored = _resume(tmp_path / "fedlap", template)
  assert r == 0 and restored.opt_state == ()
  chex.assert_trees_all_equal(restored.synthetic, template.synthetic)


@pytest.mark.parametrize("given", ["optax", "spec"])
def test_a_carried_server_state_is_checkpointed(
  tmp_path, linear_apply_fn, linear_params, clients, given
):
  """The server's state of an optax transformation passed in (Adam) or of the config's spec
  (``server_optimizer=Optimizer(name='yogi')``, FedYogi) is saved, restored and carried on."""
  model, facts = ModelFns(linear_apply_fn), rounds.run_facts(linear_params, clients)
  if given == "optax":
    algo = rounds.algorithm(FEDAVG_ADAM, FEDAVG, model, facts)
  else:
    algo = rounds.algorithm(REGISTRY["fedavg"], FEDYOGI, model, facts)
  template = algo.init(jax.random.PRNGKey(13), linear_params, clients)
  s1, _ = algo.round(template, clients)
  s2, _ = algo.round(s1, clients)
  _save(tmp_path, 2, s2)
  r, restored = _resume(tmp_path, template)
  assert r == 2 and _count(restored.opt_state) == 2
  chex.assert_trees_all_equal(restored.opt_state, s2.opt_state)
  chex.assert_trees_all_equal(
    algo.round(restored, clients)[0].params, algo.round(s2, clients)[0].params
  )


# ------------------------------------------------------------------------------------------
# The run's config: a checkpoint from before the optimiser fields resumes; another optimiser
# is refused as any other changed run-defining field.
# ------------------------------------------------------------------------------------------


def _fields(**baseline):
  cfg = configs.load("quickstart:fedadam")
  cfg.method = "fedavg"
  for path, value in baseline.items():
    section, _, name = path.partition("__")
    if name:
      cfg.baseline[section][name] = value
    else:
      cfg.baseline[section] = value
  return resume.run_defining_fields(cfg)


def _check(stored: dict, now: dict):
  meta = {"privacy": {}, "config": stored}
  resume.check_resume_compatible(meta, {}, now, "WORKDIR")


def test_a_config_from_before_the_optimiser_fields_resumes_and_another_optimiser_is_refused():
  now = _fields()
  before = {k: v for k, v in now.items() if k not in resume.ADDED_FIELDS}
  assert set(now) - set(before) == set(resume.ADDED_FIELDS)  # the fields a run holds today
  assert "baseline.server_optimizer.name" in resume.ADDED_FIELDS
  _check(before, now)  # written before the fields: their defaults are what it ran with
  _check(now, now)
  yogi = _fields(server_optimizer__name="yogi", server_lr=0.01)
  for stored in (before, now):
    with pytest.raises(resume.ResumeError) as err:
      _check(stored, yogi)
    text = str(err.value)
    assert "baseline.server_optimizer.name: checkpoint 'sgd' vs now 'yogi'" in text
    assert "baseline.server_lr: checkpoint 1.0 vs now 0.01" in text
  adam = _fields(server_optimizer__name="adam", server_lr=0.01)
  with pytest.raises(resume.ResumeError) as err:
    _check(yogi, adam)
  assert err.value.fields == ["baseline.server_optimizer.name"]
  with pytest.raises(resume.ResumeError) as err:
    _check(yogi, _fields(server_optimizer__name="yogi", server_optimizer__b2=0.99, server_lr=0.01))
  assert err.value.fields == ["baseline.server_optimizer.b2"]
  with pytest.raises(resume.ResumeError) as err:
    _check(before, _fields(client_optimizer__momentum=0.9))
  assert err.value.fields == ["baseline.client_optimizer.momentum"]


def _fedlap_fields(**settings):
  cfg = configs.load("quickstart:nondp")
  cfg.client.inner_loop = 1
  for path, value in settings.items():
    *parents, leaf = path.split("__")
    node = cfg
    for p in parents:
      node = node[p]
    node[leaf] = value
  return resume.run_defining_fields(cfg)


def test_a_fedlap_checkpoint_from_before_its_optimiser_fields_resumes_and_another_is_refused():
  """``client.model_optimizer`` and ``server.optimizer``: a checkpoint without them ran with
  plain SGD (their defaults) and resumes; another optimiser is a changed run-defining field."""
  now = _fedlap_fields()
  added = [k for k in resume.ADDED_FIELDS if k.startswith(("client.", "server."))]
  assert {
    "client.model_optimizer.name",
    "client.image_optimizer.name",
    "server.optimizer.name",
  } <= set(added)
  before = {k: v for k, v in now.items() if k not in added}
  assert set(now) - set(before) == set(added)
  _check(before, now)
  _check(now, now)
  adam = _fedlap_fields(server__optimizer__name="adam")
  for stored in (before, now):
    with pytest.raises(resume.ResumeError) as err:
      _check(stored, adam)
    assert err.value.fields == ["server.optimizer.name"]
  with pytest.raises(resume.ResumeError) as err:
    _check(before, _fedlap_fields(client__model_optimizer__name="yogi"))
  assert err.value.fields == ["client.model_optimizer.name"]
