"""A round's two halves: FedLAP's client_step / server_step and the baselines' own.

Every front end (the jitted round, ``experiments.run``, the Flower app) is
built on these steps; the tests check that the round is exactly the two steps
composed, what each step does alone, that the FedAvg-delta start is the mean of the
clients' local_approx deltas, and (by reading the source) that the round and the Flower
app call nothing else of FedLAP's.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import baselines, dispatch, rounds
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.methods.fedlap.client import (
  ClientUpdate,
  client_step,
  local_approx,
  shared_family_key,
)
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods.fedlap.server import (
  fedavg_delta_start,
  global_update,
  server_step_with_state,
)
from fedlap_jax.synthetic import real_images
from conftest import raises_field

ROOT = pathlib.Path(__file__).resolve().parents[2]
DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
K = 5

# The hybrid recipe in miniature: DP, averaged targets, noisy_real model steps, the
# FedAvg-delta start (every piece of both steps is on).
HYBRID = FedLAPConfig(
  client=ClientConfig(
    ipc=2,
    iterations=1,
    max_outer=2,
    batch_loop=2,
    boost_loop=1,
    batch_size=32,
    radius=10.0,
    calibrate_radius=False,
    dsa_strategy="",
    average_targets=True,
    model_steps="noisy_real",
    inner_loop=0,
    dp=DP,
  ),
  server=ServerConfig(
    radius_strategy="constant",
    max_epochs=1,
    dsa_strategy="",
    start="fedavg_delta",
    learning_rate=0.05,
  ),
  rounds=3,
  learning_rate=0.5,
  synthetic_init="noise",
)
# Non-DP with real images re-drawn every round and size weighting.
REAL = FedLAPConfig(
  client=ClientConfig(
    ipc=2,
    iterations=1,
    max_outer=1,
    batch_loop=1,
    boost_loop=1,
    batch_size=32,
    radius=10.0,
    calibrate_radius=False,
    dsa_strategy="",
  ),
  server=ServerConfig(radius_strategy="constant", max_epochs=1, dsa_strategy=""),
  rounds=3,
  learning_rate=0.5,
  synthetic_init="real",
)

_client_step = jax.jit(client_step, static_argnames=("apply_fn", "config", "client_axis"))
_server_step = jax.jit(server_step_with_state, static_argnames=("apply_fn", "config"))
_local_approx = jax.jit(local_approx, static_argnames=("apply_fn", "config"))


def _pick(tree, k):
  return jax.tree.map(lambda a: a[k], tree)


def _fedlap_round(state, clients, apply_fn, config):
  return rounds.method_round(
    state,
    clients,
    method=REGISTRY["fedlap"],
    config=config,
    model=ModelFns(apply_fn),
    client_backend="map",
  )


@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
@pytest.mark.parametrize("config", [HYBRID, REAL], ids=["hybrid", "real"])
def test_the_round_is_client_step_then_server_step(linear_apply_fn, linear_params, clients, config):
  """The FedLAP round's keys, rates and weights fed to the two steps by hand give its numbers."""
  state = federated.init_state(jax.random.PRNGKey(2), linear_params, clients, config)
  new, metrics = _fedlap_round(state, clients, linear_apply_fn, config)
  _, k_init, k_clients, k_server = federated.round_keys(state.key)
  rates = federated.round_learning_rates(1, config)
  family = shared_family_key(k_clients)
  keys, init_keys = jax.random.split(k_clients, K), jax.random.split(k_init, K)
  updates = []
  for k in range(K):
    update, _ = _client_step(
      keys[k],
      linear_apply_fn,
      linear_params,
      _pick(state.synthetic, k),
      _pick(clients, k),
      config,
      learning_rate=rates.client,
      family_key=family,
      init_key=init_keys[k] if config.synthetic_init == "real" else None,
    )
    updates.append(update)
  stacked = jax.tree.map(lambda *u: jnp.stack(u), *updates)
  params, _, server_metrics = _server_step(
    k_server,
    linear_apply_fn,
    linear_params,
    stacked,
    config,
    None,
    learning_rate=rates.server,
    num_records=dispatch.record_counts(clients),
  )
  chex.assert_trees_all_equal(new.synthetic, stacked.synthetic)
  chex.assert_trees_all_equal(metrics.client_radius, stacked.radius)
  chex.assert_trees_all_equal(new.params, params)
  assert int(metrics.server.steps) == int(server_metrics.steps)
  assert metrics.client.model_delta is None  # the delta travels in the update
  if config.server.start == "fedavg_delta":
    assert stacked.model_delta is not None
  else:
    assert stacked.model_delta is None


@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_client_step_draws_real_images_and_packs_what_the_client_sends(
  linear_apply_fn, linear_params, clients
):
  state = federated.init_state(jax.random.PRNGKey(2), linear_params, clients, REAL)
  syn, data = _pick(state.synthetic, 1), _pick(clients, 1)
  key, init_key = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
  update, metrics = _client_step(
    key, linear_apply_fn, linear_params, syn, data, REAL, learning_rate=0.1, init_key=init_key
  )

  @jax.jit
  def by_hand(key, init_key, params, syn, data, lr):
    """The real images of the client's classes, then Algorithm 1 from them."""
    start = syn._replace(x=real_images(init_key, data, syn.y, syn.mask, REAL.client.ipc))
    return local_approx(key, linear_apply_fn, params, start, data, REAL.client, learning_rate=lr)

  ref_syn, ref_r, ref_m = by_hand(key, init_key, linear_params, syn, data, 0.1)
  chex.assert_trees_all_equal(update.synthetic, ref_syn)
  chex.assert_trees_all_equal(update.radius, ref_r)
  chex.assert_trees_all_equal(metrics.matching_loss, ref_m.matching_loss)
  assert isinstance(update, ClientUpdate) and update.model_delta is None
  with pytest.raises(ValueError, match="synthetic_init='real' needs init_key"):
    client_step(key, linear_apply_fn, linear_params, syn, data, REAL, learning_rate=0.1)


def test_client_step_sends_the_delta_only_to_a_fedavg_delta_server(
  linear_apply_fn, linear_params, clients
):
  glob = dataclasses.replace(HYBRID, server=dataclasses.replace(HYBRID.server, start="global"))
  state = federated.init_state(jax.random.PRNGKey(2), linear_params, clients, HYBRID)
  args = (
    jax.random.PRNGKey(3),
    linear_apply_fn,
    linear_params,
    _pick(state.synthetic, 0),
    _pick(clients, 0),
  )
  rate = jnp.float32(0.5)  # typed as the round's rates: _local_approx's program is shared
  with_delta, _ = _client_step(*args, HYBRID, learning_rate=rate)
  without, _ = _client_step(*args, glob, learning_rate=rate)
  _, _, m = _local_approx(*args, HYBRID.client, learning_rate=rate)
  chex.assert_trees_all_equal(with_delta.model_delta, m.model_delta)
  assert without.model_delta is None
  chex.assert_trees_all_equal(with_delta.synthetic, without.synthetic)


def test_fedavg_delta_starts_the_server_from_the_mean_client_delta(
  linear_apply_fn, linear_params, clients
):
  # A server step of ~0 leaves the model where the descent starts: with start='global' the
  # global model, with 'fedavg_delta' the global model plus the mean (uniform weights under
  # DP) of the deltas local_approx returns for each client with the round's keys.
  server = dataclasses.replace(HYBRID.server, learning_rate=1e-9)
  cfg = dataclasses.replace(HYBRID, server=server, rounds=2)
  state = federated.init_state(jax.random.PRNGKey(2), linear_params, clients, cfg)
  new, _ = _fedlap_round(state, clients, linear_apply_fn, cfg)
  keys = jax.random.split(federated.round_keys(state.key).clients, K)
  rate = federated.round_learning_rates(1, cfg).client
  deltas = []
  for k in range(K):
    _, _, m = _local_approx(
      keys[k],
      linear_apply_fn,
      linear_params,
      _pick(state.synthetic, k),
      _pick(clients, k),
      cfg.client,
      learning_rate=rate,
    )
    deltas.append(m.model_delta)
  mean = jax.tree.map(lambda *d: sum(d) / K, *deltas)
  assert float(optax.tree.norm(mean)) > 1e-2
  chex.assert_trees_all_close(
    new.params, jax.tree.map(jnp.add, linear_params, mean), atol=1e-5, rtol=1e-4
  )
  glob = dataclasses.replace(cfg, server=dataclasses.replace(server, start="global"))
  same, _ = _fedlap_round(state, clients, linear_apply_fn, glob)
  chex.assert_trees_all_close(same.params, linear_params, atol=1e-6)


def _updates(linear_params, clients, config, radii):
  state = federated.init_state(jax.random.PRNGKey(2), linear_params, clients, config)
  rng = np.random.default_rng(0)
  deltas = jax.tree.map(
    lambda p: jnp.asarray(rng.normal(size=(K, *p.shape)).astype(np.float32) * 0.01), linear_params
  )
  return ClientUpdate(state.synthetic, jnp.asarray(radii, jnp.float32), deltas)


def test_server_step_is_radius_weights_start_then_global_update(
  linear_apply_fn, linear_params, clients
):
  """Hand-composed from the library's pieces: r_g = min r_k, N_k weights, the delta start."""
  config = dataclasses.replace(
    HYBRID,
    client=dataclasses.replace(HYBRID.client, dp=None, calibrate_radius=True),
    server=dataclasses.replace(
      HYBRID.server, radius_strategy="min", weighting="size", max_epochs=3
    ),
  )
  radii = [0.5, 0.2, 0.9, 0.3, 0.7]
  updates = _updates(linear_params, clients, config, radii)
  counts = dispatch.record_counts(clients)
  key = jax.random.PRNGKey(5)
  params, _, metrics = _server_step(
    key,
    linear_apply_fn,
    linear_params,
    updates,
    config,
    None,
    learning_rate=0.05,
    num_records=counts,
  )
  weights = counts.astype(jnp.float32)
  start = fedavg_delta_start(linear_params, updates.model_delta, weights)
  ref, ref_m = global_update(
    key,
    linear_apply_fn,
    start,
    updates.synthetic,
    weights,
    0.2,
    learning_rate=0.05,
    config=config.server,
  )
  chex.assert_trees_all_equal(params, ref)
  chex.assert_trees_all_close(metrics.radius, 0.2)
  assert int(metrics.steps) == int(ref_m.steps)
  with raises_field("weighting"):
    server_step_with_state(
      key, linear_apply_fn, linear_params, updates, config, None, learning_rate=0.05
    )
  with pytest.raises(ValueError, match="server.start='fedavg_delta' needs the clients' model"):
    server_step_with_state(
      key,
      linear_apply_fn,
      linear_params,
      updates._replace(model_delta=None),
      config,
      None,
      learning_rate=0.05,
      num_records=counts,
    )


def test_server_step_leaves_out_invalid_clients(linear_apply_fn, linear_params, clients):
  """valid=False: the client's radius, delta and synthetic set change nothing."""
  config = dataclasses.replace(
    HYBRID,
    client=dataclasses.replace(HYBRID.client, dp=None, calibrate_radius=True),
    server=dataclasses.replace(
      HYBRID.server, radius_strategy="min", weighting="size", max_epochs=2
    ),
  )
  updates = _updates(linear_params, clients, config, [0.5, 0.2, 0.9, 0.3, 0.7])
  valid = jnp.array([True, False, True, True, True])
  counts = dispatch.record_counts(clients)
  garbage = updates._replace(
    radius=updates.radius.at[1].set(1e-3),
    model_delta=jax.tree.map(lambda d: d.at[1].set(100.0), updates.model_delta),
    synthetic=updates.synthetic._replace(x=updates.synthetic.x.at[1].set(50.0)),
  )
  run = lambda u: _server_step(
    jax.random.PRNGKey(5),
    linear_apply_fn,
    linear_params,
    u,
    config,
    None,
    learning_rate=0.05,
    num_records=counts,
    valid=valid,
  )
  a, _, ma = run(updates)
  b, _, mb = run(garbage)
  chex.assert_trees_all_equal(a, b)
  chex.assert_trees_all_close(ma.radius, 0.3)  # min over the valid clients
  chex.assert_trees_all_close(mb.radius, 0.3)


def test_round_learning_rates_are_the_clients_and_the_servers():
  own = dataclasses.replace(HYBRID, server=dataclasses.replace(HYBRID.server, learning_rate=0.2))
  paper = dataclasses.replace(HYBRID, server=dataclasses.replace(HYBRID.server, learning_rate=None))
  for m in (1, 2, 3):
    cos = (1 + np.cos(np.pi * (m - 1) / 2)) / 2
    rates = federated.round_learning_rates(m, own)
    np.testing.assert_allclose(float(rates.client), max(0.5 * cos, 0.005), rtol=1e-6)
    np.testing.assert_allclose(float(rates.server), max(0.2 * cos, 0.002), rtol=1e-6)
    same = federated.round_learning_rates(m, paper)
    assert float(same.server) == float(same.client) == float(rates.client)


# ---------------------------------------------------------------- the baselines' steps

FEDAVG = baselines.baseline_config(
  "fedavg", rounds=3, learning_rate=0.1, local_epochs=1, batch_size=32, prox_mu=0.0, dp=None
)


def test_the_fedavg_round_is_client_step_then_server_step(linear_apply_fn, linear_params, clients):
  state = baselines.init_baseline_state(jax.random.PRNGKey(6), linear_params, clients, FEDAVG)
  new, _ = rounds.method_round(
    state,
    clients,
    method=REGISTRY["fedavg"],
    config=FEDAVG,
    model=ModelFns(linear_apply_fn),
    client_backend="map",
  )
  _, k_clients = baselines.round_key(state.key)
  keys = jax.random.split(k_clients, K)
  lr = baselines.learning_rate(1, FEDAVG)
  step = jax.jit(baselines.client_step, static_argnames=("apply_fn", "config"))
  ys = [
    step(keys[k], linear_apply_fn, linear_params, _pick(clients, k), FEDAVG, learning_rate=lr)[0]
    for k in range(K)
  ]
  ys = jax.tree.map(lambda *y: jnp.stack(y), *ys)
  params, _, weights = baselines.server_step_with_state(
    linear_params, ys, FEDAVG, (), num_records=dispatch.record_counts(clients)
  )
  chex.assert_trees_all_equal(new.params, params)
  counts = np.asarray(clients.mask).sum(axis=1)
  np.testing.assert_allclose(np.asarray(weights), counts / counts.sum(), rtol=1e-6)


def test_baseline_server_step_is_the_weighted_fedavg_step():
  x = {"w": jnp.array([1.0, -2.0])}
  ys = {"w": jnp.array([[3.0, 0.0], [1.0, 2.0]])}
  half = dataclasses.replace(FEDAVG, server_lr=0.5)
  params, _, w = baselines.server_step_with_state(x, ys, half, (), num_records=jnp.array([1, 3]))
  # x + 0.5 * (1/4 (y_1 - x) + 3/4 (y_2 - x)) = [1, -2] + 0.5 * [0.5, 3.5]
  np.testing.assert_allclose(np.asarray(params["w"]), [1.25, -0.25], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w), [0.25, 0.75])
  uniform = dataclasses.replace(FEDAVG, weighting="uniform")
  params, _, _ = baselines.server_step_with_state(x, ys, uniform, ())
  np.testing.assert_allclose(np.asarray(params["w"]), [2.0, 1.0], rtol=1e-6)
  with raises_field("weighting"):
    baselines.server_step_with_state(x, ys, FEDAVG, ())


# ---------------------------------------------------------------- who calls what

# FedLAP's pieces that only the two steps may call.
STEP_INTERNALS = {
  "local_approx",
  "real_images",
  "server_radius",
  "global_update",
  "fedavg_delta_start",
  "client_weights",
  "calibrate_radius",
}


def _names(path: pathlib.Path) -> set[str]:
  """Every identifier a module uses: names, attributes, imported names, defined functions."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
    elif isinstance(node, ast.alias):
      names.add(node.name.split(".")[-1])
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.add(node.name)
  return names


def _library_imports(path: pathlib.Path) -> set[str]:
  """The ``fedlap_jax`` modules a file imports (anywhere in it, functions included)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedlap_jax"):
      if node.module == "fedlap_jax":  # from fedlap_jax import client
        found |= {f"fedlap_jax.{a.name}" for a in node.names}
      else:  # from fedlap_jax.methods.fedlap import client: a name or a module
        found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("fedlap_jax")}
  return found


# Modules that hold one method's (or one family's) own steps.
METHOD_MODULES = {
  f"fedlap_jax.{m}"
  for m in (
    "methods.fedlap.client",
    "methods.fedlap.server",
    "methods.fedlap.radius",
    "methods.fedlap.state",
    "baselines",
    "methods.feddm.distribution_matching",
    "methods.condensation.one_shot",
  )
}


def test_the_round_reaches_a_method_only_through_its_value():
  """The jitted round imports the seam (the method interface, client dispatch), never a
  method's module; FedLAP's method is built on its two steps and none of their insides."""
  imported = _library_imports(ROOT / "fedlap_jax" / "rounds.py")
  assert "fedlap_jax.method" in imported and "fedlap_jax.dispatch" in imported, imported
  assert not METHOD_MODULES & imported, METHOD_MODULES & imported
  assert not any(m.startswith("fedlap_jax.methods") for m in imported), imported
  fedlap = ROOT / "fedlap_jax" / "methods" / "fedlap" / "__init__.py"
  assert {
    "fedlap_jax.methods.fedlap.client",
    "fedlap_jax.methods.fedlap.server",
  } <= _library_imports(fedlap)
  names = _names(fedlap)
  assert {"client_step", "server_step_with_state"} <= names
  assert not STEP_INTERNALS & names, STEP_INTERNALS & names


def test_the_flower_app_calls_the_librarys_steps_and_no_copy_of_them():
  """fedlap_flower marshals messages: every method's steps and client init, FedLAP's included,
  are the library's (its learning rates come in the plan's message)."""
  assert (ROOT / "fedlap_flower" / "client_app.py").is_file(), ROOT
  used = set()
  for path in sorted((ROOT / "fedlap_flower").glob("*.py")):
    names = _names(path)
    assert not STEP_INTERNALS & names, (path.name, STEP_INTERNALS & names)
    # No local training of its own either: FedAvg's client is the library's.
    assert not {"client_update", "real_gradient", "sgd_epoch", "cosine_learning_rate"} & names, (
      path.name
    )
    used |= names
  assert {"client_step", "server_step", "client_init"} <= used
