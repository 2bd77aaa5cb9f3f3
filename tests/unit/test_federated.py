"""Tests for fedlap_jax.methods.fedlap.state and fedlap_jax.methods.fedlap.config: state, stacking
and config validation. Learning runs of FedLAP and FedLAP-DP on digits:
``tests/integration/test_learning.py``."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import dispatch, rounds
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.client_data import ClientData, stack_clients
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.methods.fedlap.state import init_state
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY
from fedlap_jax.synthetic import real_images, synthetic_labels
from conftest import raises_field


DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)

# ---------------------------------------------------------------- config validation


def dp_client(**kw):
  return ClientConfig(**{"calibrate_radius": False, "dp": DP, **kw})


@pytest.mark.parametrize(
  "build, field",
  [
    (lambda: ClientConfig(ipc=0), "ipc"),
    (lambda: ClientConfig(radius=-1.0), "radius"),
    (lambda: ClientConfig(image_lr=0.0), "image_lr"),
    (lambda: ClientConfig(batch_size=0), "batch_size"),
    (lambda: ClientConfig(max_outer=0), "max_outer"),
    (lambda: ClientConfig(inner_loop=-1), "inner_loop"),
    (lambda: ClientConfig(mse_weight=-0.1), "mse_weight"),
    (lambda: ClientConfig(poisson_capacity=10, batch_size=64), "poisson_capacity"),
    (lambda: ClientConfig(poisson_capacity=64, batch_size=64), "poisson_capacity"),
    (
      lambda: FedLAPConfig(
        client=dp_client(),
        synthetic_init="noise",
        server=ServerConfig(radius_strategy="constant", weighting="size"),
      ),
      "server.weighting",
    ),
    (lambda: DPConfig(noise_multiplier=0.0, l2_clip_norm=1.0, delta=1e-5), "dp.noise_multiplier"),
    (lambda: DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=0.0), "dp.delta"),
    (lambda: DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1.0), "dp.delta"),
    (lambda: DPConfig(noise_multiplier=1.0, l2_clip_norm=-1.0, delta=1e-5), "dp.l2_clip_norm"),
    (
      lambda: FedLAPConfig(
        client=dp_client(), server=ServerConfig(radius_strategy="constant"), synthetic_init="real"
      ),
      "synthetic_init",
    ),
    (
      lambda: FedLAPConfig(
        client=dp_client(), server=ServerConfig(radius_strategy="min"), synthetic_init="noise"
      ),
      "radius_strategy",
    ),
    (lambda: ClientConfig(dp=DP, calibrate_radius=True), "calibrate_radius"),
    (lambda: ServerConfig(radius_strategy="smallest"), "radius_strategy"),
    (lambda: ClientConfig(dsa_strategy="color_blur"), "dsa_strategy"),
    (lambda: ServerConfig(dsa_strategy="warp"), "server.dsa_strategy"),
    (lambda: FedLAPConfig(client=ClientConfig(calibrate_radius=False)), "calibrate_radius"),
    (lambda: FedLAPConfig(synthetic_init="zeros"), "synthetic_init"),
    (lambda: FedLAPConfig(rounds=0), "rounds"),
  ],
)
def test_config_validation(build, field):
  with raises_field(field):
    build()


def test_valid_configs():
  dp = FedLAPConfig(
    client=dp_client(), server=ServerConfig(radius_strategy="constant"), synthetic_init="noise"
  )
  assert dp.server.weighting == "uniform"  # the default under DP: 1/K (Algorithm 3)
  assert FedLAPConfig().server.weighting == "size"  # without DP: N_k / N (Eq. 9)
  assert ClientConfig(batch_size=64, poisson_capacity=88).capacity == 88
  FedLAPConfig(
    client=ClientConfig(calibrate_radius=False), server=ServerConfig(radius_strategy="fixed")
  )
  assert ClientConfig(batch_size=256).capacity == 356
  assert ClientConfig(iterations=4, max_outer=5, batch_loop=10).real_accesses_per_round == 200


# ---------------------------------------------------------------- stacking and state


def test_stack_clients_pads_and_masks():
  xs = [np.ones((3, 2, 2, 1), np.float32), 2 * np.ones((5, 2, 2, 1), np.float32)]
  ys = [np.array([1, 1, 2]), np.array([0, 3, 3, 3, 0])]
  data = stack_clients(xs, ys)
  chex.assert_shape(data.x, (2, 5, 2, 2, 1))
  chex.assert_shape([data.y, data.mask], (2, 5))
  chex.assert_type(data.y, jnp.int32)
  chex.assert_type(data.mask, jnp.bool_)
  # Read back on the host: slicing a device array outside jit compiles a program per slice.
  x, y = np.asarray(data.x), np.asarray(data.y)
  chex.assert_trees_all_equal(data.mask, np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool))
  chex.assert_trees_all_equal(x[0, 3:], np.zeros((2, 2, 2, 1), np.float32))
  chex.assert_trees_all_equal(y[0, :3], np.array([1, 1, 2], np.int32))
  chex.assert_trees_all_equal(x[1], 2 * np.ones((5, 2, 2, 1), np.float32))


def test_stack_clients_refuses_bad_input():
  x, y = np.ones((3, 2, 2, 1)), np.zeros(3)
  with raises_field("xs[1]"):
    stack_clients([x, x[:0]], [y, y[:0]])
  with raises_field("ys[0]"):
    stack_clients([x], [y[:2]])
  with raises_field("ys"):
    stack_clients([], [])
  # Labels are class indices: a fractional or negative label is refused, not truncated.
  for bad in (np.array([0.0, 0.7, 1.0]), np.array([0, -1, 1]), np.zeros((3, 1), np.int32)):
    with raises_field("ys[0]"):
      stack_clients([x], [bad])
  whole = stack_clients([x], [np.array([0.0, 3.0, 1.0])])  # whole floats are indices
  np.testing.assert_array_equal(whole.y[0], [0, 3, 1])


def test_synthetic_labels_balanced_and_padded():
  labels, mask = synthetic_labels([np.array([7, 2, 2, 7]), np.array([1, 4, 9, 4])], 3)
  chex.assert_shape([labels, mask], (2, 9))
  assert labels.dtype == np.int32 and mask.dtype == bool
  np.testing.assert_array_equal(labels[0, :6], [2, 2, 2, 7, 7, 7])
  np.testing.assert_array_equal(mask[0], [True] * 6 + [False] * 3)
  np.testing.assert_array_equal(labels[1], [1, 1, 1, 4, 4, 4, 9, 9, 9])
  assert mask[1].all()
  with raises_field("ipc"):
    synthetic_labels([np.array([1])], 0)


def test_init_state(clients, params, class_order):
  cfg = FedLAPConfig(
    client=dp_client(ipc=3), server=ServerConfig(radius_strategy="constant"), synthetic_init="noise"
  )
  state = init_state(jax.random.PRNGKey(0), params, clients, cfg)
  syn = state.synthetic
  chex.assert_shape(syn.x, (5, 6, 8, 8, 1))
  chex.assert_shape([syn.y, syn.mask], (5, 6))
  chex.assert_type([syn.x, syn.y, syn.mask], [jnp.float32, jnp.int32, jnp.bool_])
  assert int(state.round) == 0
  assert bool(np.all(np.asarray(syn.mask)))
  for k in range(5):
    expected = np.repeat(sorted(class_order[2 * k : 2 * k + 2]), 3)
    np.testing.assert_array_equal(np.asarray(syn.y)[k], expected)
  assert 0.8 < float(np.std(np.asarray(syn.x))) < 1.2  # N(0, 1) noise
  chex.assert_trees_all_equal(state.params, params)


def test_init_state_uneven_clients(params):
  """Clients of different sizes and class counts: padded images and masked synthetic slots."""
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(n, 8, 8, 1)).astype(np.float32) for n in (6, 9)]
  ys = [np.array([0, 0, 1, 1, 1, 0]), np.array([2, 3, 4, 2, 3, 4, 2, 3, 4])]
  clients = stack_clients(xs, ys)
  cfg = FedLAPConfig(
    client=ClientConfig(ipc=2, batch_size=4, calibrate_radius=False),
    server=ServerConfig(radius_strategy="constant"),
  )
  state = init_state(jax.random.PRNGKey(0), params, clients, cfg)
  syn = state.synthetic
  chex.assert_shape(syn.x, (2, 6, 8, 8, 1))
  np.testing.assert_array_equal(np.asarray(syn.mask[0]), [1, 1, 1, 1, 0, 0])
  chex.assert_trees_all_equal(np.asarray(syn.x)[0, 4:], np.zeros((2, 8, 8, 1), np.float32))
  # Too few records of a class for ipc real images: refused, not filled with other classes.
  cfg3 = dataclasses.replace(cfg, client=ClientConfig(ipc=4, batch_size=4, calibrate_radius=False))
  with raises_field("ipc"):
    init_state(jax.random.PRNGKey(0), params, clients, cfg3)
  # A Poisson rate q = B / N_k above 1 is refused, not silently clamped.
  cfg7 = dataclasses.replace(cfg, client=ClientConfig(ipc=2, batch_size=7, calibrate_radius=False))
  with raises_field("batch_size"):
    init_state(jax.random.PRNGKey(0), params, clients, cfg7)


def test_real_images_right_class_and_distinct(clients):
  # The client on the host (NumPy): taking it out of the stack compiles nothing.
  one = ClientData(*(np.asarray(a)[2] for a in (clients.x, clients.y, clients.mask)))
  labels, mask = synthetic_labels([one.y[one.mask]], 5)
  labels = labels[0]
  mask = mask[0].copy()
  mask[-2:] = False  # two padding slots
  pick = jax.jit(real_images, static_argnums=4)
  x = pick(jax.random.PRNGKey(0), one, labels, mask, 5)
  eager = real_images(jax.random.PRNGKey(0), jax.device_put(one), labels, mask, 5)
  chex.assert_trees_all_close(x, eager)
  x = np.asarray(x)
  chex.assert_shape(x, (10, 8, 8, 1))
  chex.assert_type(x, jnp.float32)
  real = np.asarray(one.x)[np.asarray(one.mask)]
  real_y = np.asarray(one.y)[np.asarray(one.mask)]
  flat = real.reshape(len(real), -1)
  for c in np.unique(np.asarray(labels)):
    slots = np.flatnonzero((np.asarray(labels) == c) & np.asarray(mask))
    matches = [
      np.flatnonzero(np.all(flat == np.asarray(x[s]).reshape(1, -1), axis=1)) for s in slots
    ]
    assert all(len(m) >= 1 for m in matches)  # every image is a real record ...
    assert all(np.all(real_y[m] == c) for m in matches)  # ... of the slot's class
    firsts = [m[0] for m in matches]
    assert len(set(firsts)) == len(firsts)  # distinct within a class
  chex.assert_trees_all_equal(x[-2:], np.zeros((2, 8, 8, 1), np.float32))
  other = pick(jax.random.PRNGKey(1), one, labels, mask, 5)
  assert not np.allclose(other, x)


# ---------------------------------------------------------------- end-to-end learning


def test_client_weights(clients):
  counts = dispatch.record_counts(clients)
  ones = np.ones(5, np.float32)
  chex.assert_trees_all_equal(dispatch.client_weights("uniform", counts), ones)
  chex.assert_trees_all_equal(dispatch.client_weights("uniform", num_clients=5), ones)
  with raises_field("weighting"):
    dispatch.client_weights("size", num_clients=5)
  with raises_field("weighting"):
    dispatch.client_weights("n_k", counts)
  sizes = dispatch.client_weights("size", counts)
  chex.assert_type(sizes, jnp.float32)
  np.testing.assert_array_equal(np.asarray(sizes), np.asarray(clients.mask).sum(axis=1))
  assert len(set(np.asarray(sizes).tolist())) > 1  # the digits clients differ in size
  for unresolved in (None, "n_k"):  # not silently size weighting
    with raises_field("weighting"):
      dispatch.client_weights(unresolved, counts)


def test_bad_client_backend(params, clients):
  cfg = FedLAPConfig(
    client=ClientConfig(calibrate_radius=False), server=ServerConfig(radius_strategy="constant")
  )
  state = init_state(jax.random.PRNGKey(3), params, clients, cfg)
  with raises_field("client_backend"):
    rounds.method_round(
      state,
      clients,
      method=REGISTRY["fedlap"],
      config=cfg,
      model=ModelFns(lambda p, x: x),
      client_backend="pmap",
    )


# Ten rounds at learning rate 0.05, the server's own rate unset: it follows the round's.
SCHEDULE = FedLAPConfig(client=ClientConfig(), rounds=10, learning_rate=0.05)


def test_server_learning_rate_has_its_own_schedule():
  paper = SCHEDULE
  own = dataclasses.replace(
    SCHEDULE, server=dataclasses.replace(SCHEDULE.server, learning_rate=0.5)
  )
  for m in (1, 4, 10):
    cos = (1 + np.cos(np.pi * (m - 1) / 9)) / 2
    np.testing.assert_allclose(
      float(federated.round_learning_rates(m, paper).server), max(0.05 * cos, 5e-4), rtol=1e-6
    )
    np.testing.assert_allclose(
      float(federated.round_learning_rates(m, own).server), max(0.5 * cos, 5e-3), rtol=1e-6
    )
  with raises_field("server.learning_rate"):
    ServerConfig(learning_rate=0.0)


def test_lr_schedule_reaches_the_server_and_is_validated():
  open_cfg = dataclasses.replace(SCHEDULE, rounds=3, lr_schedule="cosine_open")
  np.testing.assert_allclose(
    float(federated.round_learning_rates(3, open_cfg).server), 0.05 * 0.25, rtol=1e-5
  )
  with raises_field("lr_schedule"):
    dataclasses.replace(SCHEDULE, lr_schedule="step")


def test_fedavg_delta_needs_noisy_real_model_steps():
  with raises_field("server.start"):
    FedLAPConfig(
      client=dp_client(),
      synthetic_init="noise",
      server=ServerConfig(radius_strategy="constant", start="fedavg_delta"),
    )
  with raises_field("server.start"):
    ServerConfig(start="median")
