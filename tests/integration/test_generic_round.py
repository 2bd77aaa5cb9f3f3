"""Every registry method's rounds through the one generic round (:mod:`fedlap_jax.rounds`),
pinned as numbers, and the registry's values.

Two rounds of each method on the digits (five clients, a linear model; FedDM's embedding is
the flattened image), plus FedLAP's side-by-side loops and SCAFFOLD's ``m / K`` server
variate under ``vmap``, and other optimisers in every role, are pinned in
``data/registry_rounds.json`` (per state and metrics leaf: the sum and the sum of squares in
float64 of a float leaf, the sum of an integer one; and the algorithm's static facts). They
were recorded when every method still had a round of its own (FedLAP's ``fedlap_round``, the
baselines' ``baseline_round``, FedDM's, DSC's and PSG's) and the registry round equalled it
bit for bit (the tests these replace): those rounds reproduced the file exactly before they
were removed. A deliberate change of a method re-records them::

  FEDLAP_RECORD_REGISTRY_ROUNDS=1 pytest -q tests/integration/test_generic_round.py -k record
  git diff tests/integration/data/registry_rounds.json
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

from fedlap_jax import accounting, baselines, optim, rounds
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.config import (
  ClientConfig,
  FedLAPConfig,
  ServerConfig,
  fixed_epochs_server,
)
from fedlap_jax.dp_config import DPConfig
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
      CLIENT,
      max_outer=2,
      batch_loop=2,
      average_targets=True,
      model_steps="noisy_real",
      inner_loop=0,
      dp=DP,
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
PINNED_FILE = Path(__file__).parent / "data" / "registry_rounds.json"
RECORD_ENV = "FEDLAP_RECORD_REGISTRY_ROUNDS"

# Optimisers other than the defaults, built once (jit statics that hash by identity).
ADAM = optax.scale_by_adam()
MOMENTUM = optim.sgd(0.9)
OPTIMISED = {
  "fedlap-hybrid": fedlap_methods.method(
    image_optimizer=optax.adam(1e-2), model_optimizer=MOMENTUM, server_optimizer=ADAM
  ),
  "fedavg": fedavg_methods.family("fedavg", client_optimizer=MOMENTUM, server_optimizer=ADAM),
  "scaffold": fedavg_methods.family("scaffold", client_optimizer=MOMENTUM, server_optimizer=ADAM),
}


def _carrying(config):
  """FedLAP's config with the server's optimiser state carried across rounds."""
  if not isinstance(config, FedLAPConfig):
    return config
  return dataclasses.replace(config, server=dataclasses.replace(config.server, carry_state=True))


def pin_cases() -> dict:
  """``{pin id: (method, config, facts change, client backend, key seed)}``: every registry
  method's two rounds (``map``), FedLAP's side-by-side loops and SCAFFOLD's ``m / K`` server
  variate (``vmap``), and other optimisers in every role (the server's Adam carried)."""
  out = {i: (REGISTRY.method(n), c, {}, "map", 3) for i, n, c in cases()}
  by_id = {i: c for i, _, c in cases()}
  out["fedlap-real/vmap"] = (REGISTRY.method("fedlap"), by_id["fedlap-real"], {}, "vmap", 4)
  out["scaffold/vmap-sampled"] = (
    REGISTRY.method("scaffold"),
    by_id["scaffold"],
    {"clients_per_round": 3},
    "vmap",
    4,
  )
  for i, method in OPTIMISED.items():
    out[f"{i}/optimised"] = (method, _carrying(by_id[i]), {}, "map", 6)
  return out


PIN_IDS = list(pin_cases())


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
  """A method that extends another (FedAdam: FedAvg's config) is pinned by its own tests."""
  assert {c[1] for c in cases()} == {n for n, m in REGISTRY.items() if m.extends is None}


def _leaves(state, metrics):
  """``(leaf path, NumPy array)`` of every leaf of ``state`` and ``metrics``."""
  for name, tree in (("state", state), ("metrics", metrics)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      yield name + jax.tree_util.keystr(path), np.asarray(leaf)


def round_numbers(state, metrics) -> dict:
  """``{leaf path: [sum, sum of squares]}`` (float64) of every float leaf of ``state`` and
  ``metrics``, ``{leaf path: sum}`` of every integer or bool leaf (the pinned numbers)."""
  out: dict = {}
  for key, a in _leaves(state, metrics):
    if a.dtype.kind in "fc":
      a64 = a.astype(np.float64)
      out[key] = [float(a64.sum()), float(np.square(a64).sum())]
    else:
      out[key] = int(a.astype(np.int64).sum())
  return out


def leaf_sizes(state, metrics) -> dict:
  """``{leaf path: number of elements}`` of every leaf, keyed as :func:`round_numbers`."""
  return {key: a.size for key, a in _leaves(state, metrics)}


def assert_round_numbers(have: dict, want: dict, sizes: dict, context) -> None:
  """``have`` (:func:`round_numbers` of a round) holds ``want``'s pinned numbers: integers
  exactly; a float leaf's sum of squares to a relative 1e-5, and its sum to 1e-5 of the
  leaf's mass, ``sqrt(n * sum of squares)`` for its ``n`` elements (a bound on the sum of
  their magnitudes): each element to a relative 1e-5. A sum whose terms cancel (SCAFFOLD's
  control variates, an optimiser's first moment) is near zero, and another CPU's rounding
  moves it by far more than a relative 1e-5 of itself, but not of its terms."""
  assert sorted(have) == sorted(want), (context, sorted(set(have) ^ set(want)))
  for leaf, value in want.items():
    if not isinstance(value, list):
      assert have[leaf] == value, (context, leaf)
      continue
    total, squares = have[leaf]
    assert squares == pytest.approx(value[1], rel=1e-5, abs=1e-12), (context, leaf)
    mass = np.sqrt(sizes[leaf] * value[1])
    assert abs(total - value[0]) <= 1e-5 * mass + 1e-9, (context, leaf, total, value[0], mass)


def _pinned_facts(alg, state) -> list:
  return [
    alg.name,
    alg.upload_floats_per_client,
    alg.batch_size,
    list(alg.client_state_fields),
    type(state).__name__,
  ]


def _registry_rounds(pin_id, facts, clients, linear_params):
  method, config, change, backend, seed = pin_cases()[pin_id]
  alg = rounds.algorithm(method, config, MODEL, facts._replace(**change), client_backend=backend)
  two = _two_rounds(alg, jax.random.PRNGKey(seed), linear_params, clients)
  pinned = {"facts": _pinned_facts(alg, two[0][0]), "rounds": [round_numbers(*r) for r in two]}
  return alg, config, two, pinned


@pytest.mark.skipif(not os.environ.get(RECORD_ENV), reason=f"records only with {RECORD_ENV}=1")
def test_record_the_pinned_registry_rounds(facts, clients, linear_params):
  """Writes ``data/registry_rounds.json`` (the module docstring's command)."""
  out = {i: _registry_rounds(i, facts, clients, linear_params)[3] for i in PIN_IDS}
  PINNED_FILE.write_text(json.dumps(out, sort_keys=True, indent=1) + "\n")


@pytest.mark.parametrize("pin_id", PIN_IDS)
def test_the_registry_rounds_are_the_pinned_numbers(pin_id, facts, clients, linear_params):
  """Each method's two registry rounds give the numbers recorded from its own round (module
  docstring): every leaf of state and metrics, integers exactly, floats to a relative 1e-5
  of each element (:func:`assert_round_numbers`; the bits on the machine that recorded them,
  with room for another CPU's rounding, far below what a changed key, step or weight moves);
  and the algorithm's facts
  (name, upload, batch size, per-client fields, state type), its mechanism the library
  config's."""
  pinned = json.loads(PINNED_FILE.read_text())[pin_id]
  alg, config, two, got = _registry_rounds(pin_id, facts, clients, linear_params)
  assert got["facts"] == pinned["facts"]
  assert alg.mechanism == accounting.DpMechanism.from_config(config)
  assert alg.dp == getattr(config, "dp", None)
  if pin_id.endswith("/optimised"):  # the server's Adam state advanced with every round
    assert all(int(s.opt_state[0].count) >= int(s.round) >= 1 for s, _ in two)
  for r, (round_, have, want) in enumerate(
    zip(two, got["rounds"], pinned["rounds"], strict=True), 1
  ):
    assert_round_numbers(have, want, leaf_sizes(*round_), r)


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


def test_fedlaps_upload_is_what_its_wire_carries(facts, linear_params):
  """The upload a run reports is the wire's floats: the synthetic images and r_k, plus the
  model delta under noisy_real model steps (the hybrid); labels and mask travel once."""
  for config in FEDLAP.values():
    wire = REGISTRY.method("fedlap").wire(config, linear_params, facts)
    assert isinstance(wire, Wire)
    upload = REGISTRY.method("fedlap").upload_floats(config, facts)
    images = config.client.ipc * facts.max_classes_per_client * int(np.prod(IMAGE_SHAPE))
    delta = facts.num_params if config.client.model_steps == "noisy_real" else 0
    assert upload == wire.floats() == images + 1 + delta


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
