"""Learning runs of the library: FedLAP, FedLAP-DP and FedAvg rounds on the digits clients
lift test accuracy far above chance.

Each test runs whole rounds (the clients' synthesis or training, then the server's
update) of the ConvNets in ``conftest.py``; the functions they compose are checked one
by one in ``tests/unit``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import baselines, rounds
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.methods.fedlap.state import init_state
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import ConvNet
from fedlap_jax.training import evaluate

from conftest import apply_of, params_of


DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
E2E_WIDTH, E2E_DEPTH = 16, 1


NONDP = FedLAPConfig(
  client=ClientConfig(
    ipc=10,
    iterations=1,
    max_outer=2,
    batch_loop=5,
    boost_loop=5,
    inner_loop=0,
    batch_size=64,
    radius=5.0,
    calibration_epochs=30,
    image_lr=10.0,
  ),
  server=ServerConfig(max_epochs=100),
  rounds=10,
  learning_rate=0.1,
)


# The DP run skips DSA (it halves the compile time; the DSA code path of local_approx is the
# same with and without DP and is exercised by the non-DP run).
DP_CONFIG = FedLAPConfig(
  client=ClientConfig(
    ipc=10,
    iterations=1,
    max_outer=2,
    batch_loop=5,
    boost_loop=5,
    inner_loop=1,
    batch_size=64,
    radius=5.0,
    mse_weight=0.0,
    calibrate_radius=False,
    dsa_strategy="",
    dp=DP,
  ),
  server=ServerConfig(
    radius_strategy="constant", weighting="uniform", max_epochs=50, dsa_strategy=""
  ),
  rounds=10,
  learning_rate=0.05,
  synthetic_init="noise",
)


@pytest.fixture(scope="module")
def e2e_model():
  model = ConvNet(num_classes=10, width=E2E_WIDTH, depth=E2E_DEPTH)
  return apply_of(model), params_of(model)


def run_rounds(e2e_model, clients, digits, config, num_rounds):
  apply_fn, params = e2e_model
  round_fn = rounds.make_round_fn(REGISTRY["fedlap"], config, ModelFns(apply_fn))
  accuracy = jax.jit(lambda p: evaluate(apply_fn, p, digits.x_test, digits.y_test).accuracy)
  state0 = init_state(jax.random.PRNGKey(1), params, clients, config)
  state, accs, history, first = state0, [], [], None
  for _ in range(num_rounds):
    state, metrics = round_fn(state, clients)
    if first is None:
      first = (state, metrics)
    accs.append(float(accuracy(state.params)))
    history.append(metrics)
  return round_fn, state0, first, state, accs, history


def check_round_metrics(metrics, config, num_clients=5):
  cc = config.client
  chex.assert_shape(
    metrics.client.matching_loss,
    (num_clients, cc.iterations, cc.max_outer, cc.targets_per_iteration, cc.boost_loop),
  )
  chex.assert_shape([metrics.client.outer_iterations], (num_clients, cc.iterations))
  chex.assert_shape(metrics.client_radius, (num_clients,))
  chex.assert_shape([metrics.server.epochs, metrics.server.distance, metrics.learning_rate], ())
  np.testing.assert_array_equal(
    np.asarray(metrics.client.real_accesses),
    np.asarray(metrics.client.outer_iterations).sum(axis=1) * cc.batch_loop,
  )
  assert int(jnp.sum(metrics.client.poisson_extra_chunks)) == 0
  assert 1 <= int(metrics.server.epochs) <= config.server.max_epochs


@pytest.mark.run_bound  # long runs of few programs (conftest's compiler note)
def test_fedlap_nondp_learns(e2e_model, clients, digits):
  round_fn, state0, first, state, accs, history = run_rounds(e2e_model, clients, digits, NONDP, 3)
  print("non-DP test accuracy per round:", accs)
  assert accs[-1] > 0.75, accs  # chance is 0.1; measured 0.86 / 0.89 / 0.93
  for m in history:
    check_round_metrics(m, NONDP)
    # Calibrated r_k in (0, r], server radius = min r_k, server stopped at it (or the cap).
    radii = np.asarray(m.client_radius)
    assert np.all(radii > 0) and np.all(radii <= NONDP.client.radius)
    chex.assert_trees_all_close(m.server.radius, radii.min())
    assert (
      float(m.server.distance) >= radii.min() or int(m.server.epochs) == NONDP.server.max_epochs
    )
  chex.assert_trees_all_close(
    [float(m.learning_rate) for m in history],
    [0.1 * (1 + np.cos(np.pi * i / 9)) / 2 for i in range(3)],
    rtol=1e-5,
  )
  assert int(state.round) == 3
  # Same key, same result: the first round again from the same state is bitwise equal.
  chex.assert_trees_all_equal(round_fn(state0, clients), first)


@pytest.mark.run_bound  # long runs of few programs (conftest's compiler note)
def test_fedlap_dp_learns(e2e_model, clients, digits):
  round_fn, state0, first, _, accs, history = run_rounds(e2e_model, clients, digits, DP_CONFIG, 4)
  print("DP test accuracy per round:", accs)
  assert accs[-1] > 0.5, accs  # chance is 0.1; measured 0.55 / 0.74 / 0.79 / 0.78
  for m in history:
    check_round_metrics(m, DP_CONFIG)
    chex.assert_trees_all_close(m.client_radius, jnp.full((5,), 5.0))
    chex.assert_trees_all_close(m.server.radius, 5.0)
    clip = np.asarray(m.client.clip_fraction)
    assert np.all((clip >= 0) & (clip <= 1))
  # DP carries the synthetic set across rounds (noise init once, never real images).
  chex.assert_trees_all_equal(round_fn(state0, clients), first)
  after_one, _ = first
  chex.assert_trees_all_equal(after_one.synthetic.y, state0.synthetic.y)
  assert not bool(jnp.allclose(after_one.synthetic.x, state0.synthetic.x))


@pytest.mark.run_bound  # long runs of few programs (conftest's compiler note)
def test_fedavg_learns_digits(apply_fn, params, clients, digits):
  """FedAvg on 5 clients x 2 classes: 2 rounds of 5 local epochs lift test accuracy far above
  chance."""
  sizes = np.asarray(clients.mask).sum(1)
  config = baselines.baseline_config(
    "fedavg",
    rounds=3,
    learning_rate=0.1,
    local_epochs=5,
    batch_size=64,
    prox_mu=0.1,
    dp=None,
    max_client_size=int(sizes.max()),
  )
  alg = rounds.algorithm(
    REGISTRY["fedavg"],
    config,
    ModelFns(apply_fn),
    rounds.run_facts(params, clients),
    client_backend="auto",
  )
  state = alg.init(jax.random.PRNGKey(0), params, clients)
  x_test, y_test = jnp.asarray(digits.x_test), jnp.asarray(digits.y_test)
  before = float(evaluate(apply_fn, params, x_test, y_test).accuracy)
  for _ in range(2):
    state, metrics = alg.round(state, clients)
  after = float(evaluate(apply_fn, alg.params_of(state), x_test, y_test).accuracy)
  assert before < 0.3
  assert after > 0.5  # chance is 0.1; 2 rounds reach about 0.62
  # Each client fits its own two classes.
  assert np.all(np.asarray(metrics.client.loss) < 1.0)
