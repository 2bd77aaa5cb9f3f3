"""The generic round (:mod:`fedlap_jax.rounds`) over every registry method equals that
method's own round bit for bit, and the registry's values say what today's algorithms say.

Two rounds of each method on the digits (five clients, a linear model; FedDM's embedding is
the flattened image). FedLAP and the FedAvg family, whose own rounds serve users
(``fedlap_jax.fedlap_round`` / ``make_round_fn`` / ``federated.algorithm``,
``baselines.algorithm``), are built once through their module and once through
``rounds.algorithm(REGISTRY[name], ...)``: states and metrics equal, and so are the
algorithms' static facts (name, upload, mechanism, batch size, per-client fields).

FedDM, DSC and PSG have no round of their own any more: their two registry rounds are
pinned as numbers in ``data/synthetic_rounds.json`` (per state and metrics leaf: the sum and
the sum of squares in float64 of a float leaf, the sum of an integer one; and the static
facts), recorded when the registry round still equalled their own rounds bit for bit (the
test this one replaces). A deliberate change of these methods re-records them::

  FEDLAP_RECORD_SYNTHETIC_ROUNDS=1 pytest -q tests/integration/test_generic_round.py -k pinned
  git diff tests/integration/data/synthetic_rounds.json
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import chex
import jax
import numpy as np
import optax
import pytest

from fedlap_jax import accounting, baselines, condensation, feddm, federated, optim, rounds
from fedlap_jax.checks import ConfigError
from fedlap_jax.config import (
  ClientConfig,
  DPConfig,
  FedLAPConfig,
  ServerConfig,
  fixed_epochs_server,
)
from fedlap_jax.method import ModelFns, RunFacts, Wire
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods import fedavg as fedavg_methods
from fedlap_jax.methods import fedlap as fedlap_methods
from fedlap_jax.models import count_params

from conftest import linear_apply, linear_init

pytestmark = pytest.mark.bitwise  # differently built programs, bit for bit (conftest's note)

K = 5
IMAGE_SHAPE = (8, 8, 1)
MAX_CLIENT_SIZE = 400  # >= every digits client: fixes the baselines' static step count
DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
SERVER = ServerConfig(radius_strategy="constant", max_epochs=1, dsa_strategy="")
CLIENT = ClientConfig(
  ipc=2,
  iterations=1,
  max_outer=1,
  batch_loop=1,
  boost_loop=1,
  batch_size=32,
  radius=10.0,
  calibrate_radius=False,
  dsa_strategy="",
)
FEDLAP = {
  "real": FedLAPConfig(
    client=CLIENT, server=SERVER, rounds=3, learning_rate=0.5, synthetic_init="real"
  ),
  "hybrid": FedLAPConfig(
    client=dataclasses.replace(
      CLIENT, max_outer=2, batch_loop=2, average_targets=True, model_steps="noisy_real", dp=DP
    ),
    server=dataclasses.replace(SERVER, start="fedavg_delta", learning_rate=0.05),
    rounds=3,
    learning_rate=0.5,
    synthetic_init="noise",
  ),
}


def linear_embed(params, x):
  """FedDM's ``(features, logits)`` of the linear model: the flattened image and its logits."""
  return x.reshape(x.shape[0], -1), linear_apply(params, x)


MODEL = ModelFns(linear_apply, linear_embed, linear_init)


def _baseline(name, max_client_size):
  dp = DP if name.startswith("dp_") else None
  return baselines.baseline_config(
    name,
    rounds=3,
    learning_rate=0.1,
    local_epochs=1,
    batch_size=32,
    dp=dp,
    max_client_size=max_client_size,
  )


def _oneshot(name, init="noise"):
  cond = condensation.CondensationConfig(
    ipc=2,
    networks=1,
    outer_loop=2,
    inner_loop=1,
    batch_loop=2,
    classwise=name != "psg",
    batch_size=16,
    synthetic_init=init,
    dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5) if name == "psg" else None,
  )
  return condensation.OneShotConfig(method=name, condensation=cond, server=fixed_epochs_server(1))


def cases(max_client_size=MAX_CLIENT_SIZE):
  """``(id, method name, config, legacy algorithm builder)`` of every registry method."""
  out = [(f"fedlap-{k}", "fedlap", c) for k, c in FEDLAP.items()]
  out += [(m, m, _baseline(m, max_client_size)) for m in baselines.METHODS]
  for init in ("real", "noise"):
    fc = feddm.FedDMConfig(
      ipc=2, image_updates=2, batch_size=16, synthetic_init=init, server=fixed_epochs_server(1)
    )
    out.append((f"feddm-{init}", "feddm", fc))
  out += [(m, m, _oneshot(m)) for m in ("dsc", "dsc_centralized", "psg")]
  out.append(("dsc-real", "dsc", _oneshot("dsc", "real")))
  return out


CASE_IDS = [c[0] for c in cases()]
# The methods whose own round serves users (module docstring), and the others' pinned rounds.
OWN_ROUNDS = (FedLAPConfig, baselines.BaselineConfig)
OWN_IDS = [i for i, _, c in cases() if isinstance(c, OWN_ROUNDS)]
PINNED_IDS = [i for i in CASE_IDS if i not in OWN_IDS]
PINNED_FILE = Path(__file__).parent / "data" / "synthetic_rounds.json"
RECORD_ENV = "FEDLAP_RECORD_SYNTHETIC_ROUNDS"


def legacy(config, facts: RunFacts, client_backend: str, **optimisers):
  if isinstance(config, FedLAPConfig):
    return federated.algorithm(
      linear_apply,
      config,
      image_shape=IMAGE_SHAPE,
      max_classes_per_client=facts.max_classes_per_client,
      client_backend=client_backend,
      **optimisers,
    )
  assert isinstance(config, baselines.BaselineConfig), config
  return baselines.algorithm(
    linear_apply,
    config,
    image_shape=IMAGE_SHAPE,
    num_clients=K,
    num_params=facts.num_params,
    client_backend=client_backend,
    clients_per_round=facts.clients_per_round,
    **optimisers,
  )


@pytest.fixture(scope="module")
def facts(clients, linear_params):
  sizes = np.asarray(clients.mask).sum(axis=1)
  return RunFacts(IMAGE_SHAPE, K, count_params(linear_params), 2, int(sizes.max()))


def _case(case_id, facts):
  return next(c for c in cases() if c[0] == case_id)


def _two_rounds(alg, key, params, clients):
  state = alg.init(key, params, clients)
  out = []
  for _ in range(2):
    state, metrics = alg.round(state, clients)
    out.append((state, metrics))
  return out


def test_every_registry_method_with_a_round_of_its_own_is_a_case():
  """A method that extends another (FedAdam: FedAvg's config) has no legacy round to equal."""
  assert {c[1] for c in cases()} == {n for n, m in REGISTRY.items() if m.extends is None}


@pytest.mark.parametrize("case_id", OWN_IDS)
def test_the_generic_round_equals_the_methods_own(case_id, facts, clients, linear_params):
  _, name, config = _case(case_id, facts)
  method = REGISTRY.method(name)
  old = legacy(config, facts, "map")
  new = rounds.algorithm(method, config, MODEL, facts, client_backend="map")
  assert new.name == old.name
  assert new.upload_floats_per_client == old.upload_floats_per_client
  assert new.mechanism == old.mechanism and new.dp == old.dp
  assert new.batch_size == old.batch_size
  assert new.client_state_fields == old.client_state_fields
  key = jax.random.PRNGKey(3)
  for (s_old, m_old), (s_new, m_new) in zip(
    _two_rounds(old, key, linear_params, clients), _two_rounds(new, key, linear_params, clients)
  ):
    assert type(s_new) is type(s_old) and type(m_new) is type(m_old)
    chex.assert_trees_all_equal(s_new, s_old)
    chex.assert_trees_all_equal(m_new, m_old)


def round_numbers(state, metrics) -> dict:
  """``{leaf path: [sum, sum of squares]}`` (float64) of every float leaf of ``state`` and
  ``metrics``, ``{leaf path: sum}`` of every integer or bool leaf (the pinned numbers)."""
  out: dict = {}
  for name, tree in (("state", state), ("metrics", metrics)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      a = np.asarray(leaf)
      key = name + jax.tree_util.keystr(path)
      if a.dtype.kind in "fc":
        a64 = a.astype(np.float64)
        out[key] = [float(a64.sum()), float(np.square(a64).sum())]
      else:
        out[key] = int(a.astype(np.int64).sum())
  return out


def _pinned_facts(alg) -> list:
  return [alg.name, alg.upload_floats_per_client, alg.batch_size, list(alg.client_state_fields)]


def _synthetic_rounds(case_id, facts, clients, linear_params):
  _, name, config = _case(case_id, facts)
  alg = rounds.algorithm(REGISTRY.method(name), config, MODEL, facts, client_backend="map")
  two = _two_rounds(alg, jax.random.PRNGKey(3), linear_params, clients)
  return alg, config, {"facts": _pinned_facts(alg), "rounds": [round_numbers(*r) for r in two]}


@pytest.mark.skipif(not os.environ.get(RECORD_ENV), reason=f"records only with {RECORD_ENV}=1")
def test_record_the_pinned_synthetic_rounds(facts, clients, linear_params):
  """Writes ``data/synthetic_rounds.json`` (the module docstring's command)."""
  out = {c: _synthetic_rounds(c, facts, clients, linear_params)[2] for c in PINNED_IDS}
  PINNED_FILE.write_text(json.dumps(out, sort_keys=True, indent=1) + "\n")


@pytest.mark.parametrize("case_id", PINNED_IDS)
def test_the_synthetic_set_methods_rounds_are_the_pinned_numbers(
  case_id, facts, clients, linear_params
):
  """FedDM's, DSC's and PSG's two registry rounds give the numbers recorded from their own
  rounds (module docstring): every leaf of state and metrics, integers exactly, floats to a
  relative 1e-5 (the bits on the machine that recorded them; the tolerance leaves room for
  another CPU's rounding, far below what a changed key, step or weight moves); and the
  algorithm's facts, its mechanism the library config's."""
  pinned = json.loads(PINNED_FILE.read_text())[case_id]
  alg, config, got = _synthetic_rounds(case_id, facts, clients, linear_params)
  assert got["facts"] == pinned["facts"]
  assert alg.mechanism == accounting.DpMechanism.from_config(config)
  assert alg.dp == getattr(config, "dp", None)
  for r, (have, want) in enumerate(zip(got["rounds"], pinned["rounds"], strict=True), 1):
    assert sorted(have) == sorted(want), (r, sorted(set(have) ^ set(want)))
    for leaf, value in want.items():
      assert have[leaf] == pytest.approx(value, rel=1e-5, abs=1e-9), (r, leaf)


@pytest.mark.parametrize("case_id", ["fedlap-real", "scaffold"])
def test_side_by_side_and_sampled_clients_equal_the_methods_own(
  case_id, facts, clients, linear_params
):
  """``vmap`` clients (FedLAP's side-by-side loops), and SCAFFOLD's ``m / K`` server variate."""
  _, name, config = _case(case_id, facts)
  facts = facts._replace(clients_per_round=3) if name == "scaffold" else facts
  old = legacy(config, facts, "vmap")
  new = rounds.algorithm(REGISTRY.method(name), config, MODEL, facts, client_backend="vmap")
  key = jax.random.PRNGKey(4)
  for (s_old, m_old), (s_new, m_new) in zip(
    _two_rounds(old, key, linear_params, clients), _two_rounds(new, key, linear_params, clients)
  ):
    chex.assert_trees_all_equal(s_new, s_old)
    chex.assert_trees_all_equal(m_new, m_old)


# Optimisers other than the defaults, built once (jit statics that hash by identity).
ADAM = optax.scale_by_adam()
MOMENTUM = optim.sgd(0.9)
FEDLAP_OPTIMISERS = dict(
  image_optimizer=optax.adam(1e-2), model_optimizer=MOMENTUM, server_optimizer=ADAM
)
BASELINE_OPTIMISERS = dict(client_optimizer=MOMENTUM, server_optimizer=ADAM)
OPTIMISED = {
  "fedlap-hybrid": fedlap_methods.method(**FEDLAP_OPTIMISERS),
  "fedavg": fedavg_methods.family("fedavg", **BASELINE_OPTIMISERS),
  "scaffold": fedavg_methods.family("scaffold", **BASELINE_OPTIMISERS),
}


@pytest.mark.parametrize("case_id", list(OPTIMISED))
def test_the_generic_round_carries_the_server_optimisers_state(
  case_id, facts, clients, linear_params
):
  """With other optimisers in every role (the server's Adam carried across rounds: FedLAP's
  by ``server.carry_state``) the generic round equals the method's own, the server's state
  included."""
  _, name, config = _case(case_id, facts)
  if name == "fedlap":
    config = dataclasses.replace(
      config, server=dataclasses.replace(config.server, carry_state=True)
    )
  optimisers = FEDLAP_OPTIMISERS if name == "fedlap" else BASELINE_OPTIMISERS
  old = legacy(config, facts, "map", **optimisers)
  new = rounds.algorithm(OPTIMISED[case_id], config, MODEL, facts, client_backend="map")
  key = jax.random.PRNGKey(6)
  for (s_old, m_old), (s_new, m_new) in zip(
    _two_rounds(old, key, linear_params, clients), _two_rounds(new, key, linear_params, clients)
  ):
    assert int(s_new.opt_state[0].count) >= int(s_new.round)  # Adam's state advanced
    chex.assert_trees_all_equal(s_new, s_old)
    chex.assert_trees_all_equal(m_new, m_old)


def test_scaffolds_control_update_is_in_its_client_step(facts, clients, linear_params):
  """A SCAFFOLD client's step alone returns ``c_k+`` and sends ``(y_k, delta c_k)``."""
  method = REGISTRY.method("scaffold")
  config = _baseline("scaffold", MAX_CLIENT_SIZE)
  state = method.init(jax.random.PRNGKey(5), linear_params, clients, config, facts)
  state = state._replace(control=jax.tree.map(lambda p: p + 0.01, state.control))
  plan = method.plan(state, K, config)
  one = jax.tree.map(lambda a: a[1], (plan.own, clients, state.client_controls))
  result = method.client_step(one[0], MODEL, plan.message, (one[2],), one[1], config)
  y, delta_c = result.update
  (c_new,) = result.carried
  steps = float(result.metrics.steps)
  lr = float(plan.message.learning_rate)
  for leaf in ("kernel", "bias"):
    expect = -np.asarray(state.control[leaf]) - (
      np.asarray(y[leaf]) - np.asarray(linear_params[leaf])
    ) / (steps * lr)
    np.testing.assert_allclose(np.asarray(delta_c[leaf]), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      np.asarray(c_new[leaf]), np.asarray(one[2][leaf]) + np.asarray(delta_c[leaf]), rtol=1e-6
    )


def test_the_wire_refuses_a_malformed_reply(facts, linear_params):
  wire = REGISTRY.method("scaffold").wire(None, linear_params, facts)
  assert wire.names() == (
    "params.bias",
    "params.kernel",
    "control_delta.bias",
    "control_delta.kernel",
  )
  assert wire.floats() == 2 * facts.num_params
  good = {f.name: np.zeros(f.shape, f.dtype) for f in wire.fields}
  wire.check(good)
  bad = [
    ({k: v for k, v in good.items() if k != "params.bias"}, "params.bias"),
    ({**good, "extra": np.zeros(1)}, "extra"),
    ({**good, "params.kernel": np.zeros((3,), np.float32)}, "params.kernel"),
    ({**good, "params.bias": np.zeros(10, np.float64)}, "params.bias"),
    ({**good, "control_delta.bias": np.full(10, np.nan, np.float32)}, "control_delta.bias"),
  ]
  for reply, field in bad:
    with pytest.raises(ConfigError) as err:
      wire.check(reply)
    assert err.value.field == field


def test_fedlaps_wire_pins_labels_and_counts_todays_upload(facts, linear_params):
  for config in FEDLAP.values():
    wire = REGISTRY.method("fedlap").wire(config, linear_params, facts)
    assert isinstance(wire, Wire)
    upload = REGISTRY.method("fedlap").upload_floats(config, facts)
    delta = facts.num_params if config.client.model_steps == "noisy_real" else 0
    assert wire.floats() == upload + delta + 1  # + the radius, a scalar today's count leaves out


def test_the_registry_refuses_an_unknown_name_and_a_config_of_another_method(facts):
  with pytest.raises(ConfigError) as err:
    REGISTRY.method("fedbogus")
  assert err.value.field == "method"
  with pytest.raises(ConfigError) as err:
    rounds.algorithm(REGISTRY.method("fedavg"), FEDLAP["real"], MODEL, facts)
  assert err.value.field == "config"
  with pytest.raises(ValueError):
    REGISTRY.with_methods(REGISTRY.method("fedavg"))


OWN_INIT_CASES = [c[0] for c in cases() if REGISTRY[c[1]].carried and REGISTRY[c[1]].federated]


@pytest.mark.parametrize("case_id", OWN_INIT_CASES)
def test_a_clients_own_init_is_its_slot_of_the_methods_init(case_id, facts, clients, linear_params):
  """What a client that keeps its own state computes before round 1 from its own records
  (:attr:`Method.client_init`) is its slot of :attr:`Method.init`'s carried fields, bit for
  bit (labels, mask and the N(0, 1) images of the whole federation's draw)."""
  _, name, config = _case(case_id, facts)
  method = REGISTRY.method(name)
  assert method.client_init is not None, f"{name} carries {method.carried} without client_init"
  key = jax.random.key(3)
  state = method.init(key, linear_params, clients, config, facts)
  for k in range(K):
    own = jax.tree.map(lambda a: a[k], clients)
    got = method.client_init(key, linear_params, own, config, facts, index=k)
    want = tuple(jax.tree.map(lambda a: a[k], getattr(state, f)) for f in method.carried)
    chex.assert_trees_all_equal(got, want, strict=True)
