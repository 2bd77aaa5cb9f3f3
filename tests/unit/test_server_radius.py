"""Tests for fedlap_jax.methods.fedlap.radius (r_k calibration, r_g strategies) and
fedlap_jax.methods.fedlap.server
(Algorithm 2: trust-region global update)."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import training
from fedlap_jax.methods.fedlap import radius
from fedlap_jax.methods.fedlap import server
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.methods.fedlap.config import ServerConfig
from conftest import raises_field


# ---------------------------------------------------------------- server radius strategies

RADII = jnp.array([3.0, 1.0, 4.0, 1.5, 9.0])
VALID = jnp.array([True, False, True, True, False])


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize(
  "strategy, expected, expected_valid",
  [
    ("min", 1.0, 1.5),
    ("max", 9.0, 4.0),
    ("median", 3.0, 3.0),
    ("mean", 3.7, (3.0 + 4.0 + 1.5) / 3),
    ("constant", 2.5, 2.5),
    ("fixed", math.inf, math.inf),
  ],
)
def test_server_radius_strategies(strategy, expected, expected_valid, use_jit):
  fn = functools.partial(radius.server_radius, strategy=strategy)
  if use_jit:
    fn = jax.jit(fn)
  r = fn(RADII, radius=2.5)
  chex.assert_shape(r, ())
  chex.assert_type(r, jnp.float32)
  chex.assert_trees_all_close(r, jnp.float32(expected), rtol=1e-6)
  chex.assert_trees_all_close(
    fn(RADII, radius=2.5, valid=VALID), jnp.float32(expected_valid), rtol=1e-6
  )


def test_server_radius_median_even_count():
  r = radius.server_radius(jnp.array([4.0, 1.0, 3.0, 2.0]), "median", 0.0)
  chex.assert_trees_all_close(r, 2.5)


def test_server_radius_bad_strategy():
  with raises_field("radius_strategy"):
    radius.server_radius(RADII, "smallest", 1.0)


# ---------------------------------------------------------------- client radius calibration


@pytest.fixture(scope="module")
def calibration_data(client_parts):
  """Client 0's real data and a synthetic set of 6 of its real images (no padding)."""
  x, y = client_parts[0]
  syn_idx = np.concatenate([np.flatnonzero(y == 5)[:3], np.flatnonzero(y == 6)[:3]])
  return (
    SyntheticSet(jnp.asarray(x[syn_idx]), jnp.asarray(y[syn_idx]), jnp.asarray(np.ones(6, bool))),
    ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(np.ones(len(y), bool))),
  )


def host(tree):
  """``tree`` read back as NumPy arrays: the checks that follow compile nothing."""
  return jax.tree.map(np.asarray, tree)


# Helpers of the checks under jit: each is one program, not one per operation (JAX compiles every
# operation it runs outside jit on a new shape as a program of its own).
tree_distance = jax.jit(training.tree_distance)
evaluate_jit = jax.jit(training.evaluate, static_argnums=0, static_argnames="chunk_size")
sgd_epoch_jit = jax.jit(
  training.sgd_epoch, static_argnums=1, static_argnames=("batch_size", "dsa_strategy")
)


@functools.lru_cache(maxsize=None)
def _mean_loss_grad(apply_fn):
  """``grad(p, x, y)`` of the mean cross-entropy, jitted."""
  return jax.jit(jax.grad(lambda p, x, y: jnp.mean(training.cross_entropy(apply_fn(p, x), y))))


calibrate_jit = jax.jit(
  radius.calibrate_radius,
  static_argnames=("apply_fn", "epochs", "batch_size", "dsa_strategy", "eval_size"),
)


@pytest.mark.parametrize("max_radius", [100.0, 1.0])
def test_calibrate_radius(tiny_apply_fn, tiny_params, calibration_data, max_radius):
  """r_k is the distance at the epoch of lowest real loss, capped at max_radius.

  Full-batch SGD without DSA is deterministic, so the trace is checked against
  plain gradient steps.
  """
  epochs, lr = 5, 0.5
  r_k, trace = calibrate_jit(
    jax.random.PRNGKey(0),
    tiny_apply_fn,
    tiny_params,
    *calibration_data,
    learning_rate=lr,
    max_radius=max_radius,
    epochs=epochs,
    batch_size=512,
    dsa_strategy="",
  )
  chex.assert_shape([trace.distances, trace.real_losses], (epochs,))
  chex.assert_shape([r_k, trace.best_epoch], ())
  chex.assert_type(r_k, jnp.float32)
  best = int(np.argmin(np.asarray(trace.real_losses)))
  assert int(trace.best_epoch) == best
  trace = host(trace)
  chex.assert_trees_all_close(r_k, np.minimum(trace.distances[best], max_radius))
  # Reproduce the trace with explicit full-batch gradient steps.
  (sx, sy, _), (rx, ry, rm, *_) = calibration_data
  step = _full_batch_step(tiny_apply_fn)
  evaluate = jax.jit(training.evaluate, static_argnums=0)
  w = tiny_params
  for e in range(epochs):
    w = step(w, sx, sy, lr)
    chex.assert_trees_all_close(trace.distances[e], tree_distance(w, tiny_params), rtol=1e-4)
    chex.assert_trees_all_close(
      trace.real_losses[e], evaluate(tiny_apply_fn, w, rx, ry, rm).loss, rtol=1e-4
    )
  # On this 6-image set the real loss is not monotone: the lowest is not the last epoch, so
  # r_k is not simply the final distance.
  assert best < epochs - 1 and float(trace.distances[best]) < float(trace.distances[-1])
  assert (float(r_k) == max_radius) == (max_radius < float(trace.distances[best]))


@functools.lru_cache(maxsize=None)
def _full_batch_step(apply_fn):
  @jax.jit
  def step(w, x, y, lr):
    g = jax.grad(lambda p: jnp.mean(training.cross_entropy(apply_fn(p, x), y)))(w)
    return jax.tree.map(lambda p, g: p - lr * g, w, g)

  return step


def test_calibrate_radius_eval_subsample(linear_apply_fn, linear_params, calibration_data):
  r_k, trace = calibrate_jit(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    *calibration_data,
    learning_rate=0.5,
    max_radius=100.0,
    epochs=4,
    batch_size=512,
    dsa_strategy="",
    eval_size=50,
  )
  chex.assert_shape(trace.real_losses, (4,))
  chex.assert_tree_all_finite((r_k, trace))
  assert 0 < float(r_k) <= 100.0
  full_r, full = calibrate_jit(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    *calibration_data,
    learning_rate=0.5,
    max_radius=100.0,
    epochs=4,
    batch_size=512,
    dsa_strategy="",
  )
  chex.assert_trees_all_close(trace.distances, full.distances, rtol=1e-5)  # same trajectory
  assert not np.allclose(trace.real_losses, full.real_losses)  # a different eval set


# ---------------------------------------------------------------- server: Algorithm 2


@pytest.fixture(scope="module")
def union(client_parts):
  """Two clients' synthetic sets of 8 real images each, stacked ``(2, 8, 8, 8, 1)``."""
  xs, ys = [], []
  for k in range(2):
    x, y = client_parts[k]
    idx = np.concatenate([np.flatnonzero(y == c)[:4] for c in np.unique(y)])
    xs.append(x[idx])
    ys.append(y[idx])
  return SyntheticSet(
    jnp.asarray(np.stack(xs)), jnp.asarray(np.stack(ys)), jnp.asarray(np.ones((2, 8), bool))
  )


SERVER = ServerConfig(radius_strategy="min", batch_size=4, max_epochs=20, dsa_strategy="")
global_update_jit = jax.jit(server.global_update, static_argnames=("apply_fn", "config"))


def server_run(apply_fn, params, union, r_g, config=SERVER, key=jax.random.PRNGKey(0)):
  return global_update_jit(
    key, apply_fn, params, union, jnp.ones(2), r_g, learning_rate=0.05, config=config
  )


def test_global_update_fixed_runs_max_epochs(linear_apply_fn, linear_params, union):
  params, m = server_run(
    linear_apply_fn, linear_params, union, radius.server_radius(jnp.ones(2), "fixed", 1.0)
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(params, linear_params)
  chex.assert_shape([m.epochs, m.steps, m.distance, m.radius], ())
  assert int(m.epochs) == SERVER.max_epochs
  assert int(m.steps) == SERVER.max_epochs * 4  # 16 examples in batches of 4
  assert float(m.radius) == math.inf
  chex.assert_trees_all_close(m.distance, tree_distance(params, linear_params), rtol=1e-5)


def test_global_update_stops_at_radius(linear_apply_fn, linear_params, union):
  _, full = server_run(linear_apply_fn, linear_params, union, jnp.inf)
  r_g = 0.5 * float(full.distance)
  params, m = server_run(linear_apply_fn, linear_params, union, r_g)
  epochs = int(m.epochs)
  assert 1 < epochs < SERVER.max_epochs
  assert float(m.distance) >= r_g
  assert int(m.steps) == 4 * epochs
  chex.assert_trees_all_close(m.distance, tree_distance(params, linear_params), rtol=1e-5)
  # The same run capped one epoch earlier is still inside the ball.
  short = ServerConfig(radius_strategy="min", batch_size=4, max_epochs=epochs - 1, dsa_strategy="")
  _, before = server_run(linear_apply_fn, linear_params, union, r_g, config=short)
  assert int(before.epochs) == epochs - 1
  assert float(before.distance) < r_g


def test_global_update_eager_equals_jit(linear_apply_fn, linear_params, union):
  cfg = ServerConfig(radius_strategy="min", batch_size=8, max_epochs=3, dsa_strategy="flip")
  args = (jax.random.PRNGKey(1), linear_apply_fn, linear_params, union, jnp.array([1.0, 3.0]), 0.5)
  eager = server.global_update(*args, learning_rate=0.1, config=cfg)
  jitted = global_update_jit(*args, learning_rate=0.1, config=cfg)
  chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_equal_shapes_and_dtypes(eager[0], linear_params)


@pytest.mark.parametrize(
  "change, field",
  [
    (lambda s, w: (jax.tree.map(lambda a: np.asarray(a)[0], s), w[:1]), "synthetic.y.shape"),
    (lambda s, w: (s, np.ones(3, np.float32)), "client_weights.shape"),
    (lambda s, w: (s._replace(y=np.asarray(s.y).astype(np.float32)), w), "synthetic.y.dtype"),
  ],
)
def test_global_update_refuses_a_union_it_cannot_use(
  linear_apply_fn, linear_params, union, change, field
):
  bad, weights = change(union, np.ones(2, np.float32))
  with raises_field(field):
    global_update_jit(
      jax.random.PRNGKey(0),
      linear_apply_fn,
      linear_params,
      bad,
      weights,
      1.0,
      learning_rate=0.1,
      config=SERVER,
    )
  server.check_union(union, jnp.ones(2))  # the union the other tests train on passes
  with raises_field("synthetic.x.shape"):
    server.check_union(
      SyntheticSet(jnp.zeros(16), jnp.zeros(16, jnp.int32), jnp.ones(16, bool)), jnp.ones(1)
    )


def test_example_weights():
  mask = np.array([[True, True, False, False], [True, True, True, True]])
  example_weights = jax.jit(server.example_weights)
  w = example_weights(mask, np.array([1.0, 3.0], np.float32))
  chex.assert_shape(w, (2, 4))
  w = np.asarray(w)
  chex.assert_trees_all_equal(w[0, 2:], np.zeros(2, w.dtype))  # padding
  # A full pass weighs the clients 1 : 3; the mean weight over valid examples is 1.
  chex.assert_trees_all_close(np.sum(w, axis=1) / np.sum(w), np.array([0.25, 0.75]))
  chex.assert_trees_all_close(np.sum(w), 6.0)
  equal = example_weights(np.ones((3, 5), bool), np.ones(3, np.float32))
  chex.assert_trees_all_close(equal, np.ones((3, 5)))


# ---------------------------------------------------------------- model steps (training.py)


@pytest.mark.parametrize("use_jit", [False, True])
def test_cosine_learning_rate(use_jit):
  fn = training.cosine_learning_rate
  if use_jit:
    fn = jax.jit(fn, static_argnums=1)
  lrs = jnp.stack([fn(m, 11, 0.1) for m in range(1, 12)])
  chex.assert_shape(lrs, (11,))
  chex.assert_type(lrs, jnp.float32)
  expected = np.maximum(0.1 * (1 + np.cos(np.pi * np.arange(11) / 10)) / 2, 1e-3)
  chex.assert_trees_all_close(lrs, expected, rtol=1e-5, atol=1e-8)
  assert float(lrs[-1]) == pytest.approx(1e-3) and float(lrs[5]) == pytest.approx(0.05)
  chex.assert_trees_all_close(fn(1, 1, 0.3), 0.3)


@pytest.mark.parametrize("rounds", [2, 3, 10, 17, 300])
def test_every_round_of_the_default_schedules_steps(rounds):
  """No round of the default schedule (FedLAP's and the baselines', client and server) runs
  below 1 % of round 1's rate: the reference cosine's last rounds would otherwise be ~0 (a
  round that changes nothing but, under DP, still spends epsilon). Where the cosine is above
  the floor it is unchanged."""
  from fedlap_jax import baselines  # pylint: disable=g-import-not-at-top
  from fedlap_jax.methods.fedlap import state as federated
  from fedlap_jax.methods.fedlap.config import FedLAPConfig, ServerConfig

  fedlap = FedLAPConfig(rounds=rounds, learning_rate=0.3, server=ServerConfig(learning_rate=0.7))
  baseline = baselines.BaselineConfig(method="fedavg", rounds=rounds, learning_rate=0.3)
  m = np.arange(1, rounds + 1)
  rates = federated.round_learning_rates(m, fedlap)
  series = {
    "client": np.asarray(rates.client),
    "server": np.asarray(rates.server),
    "baseline": np.asarray([float(baselines.learning_rate(i, baseline)) for i in m]),
  }
  cos = (1 + np.cos(np.pi * (m - 1) / (rounds - 1))) / 2
  for name, lrs in series.items():
    assert np.all(lrs >= 0.01 * lrs[0] * (1 - 1e-6)), (name, lrs.min(), lrs[0])
    above = cos >= 0.01
    np.testing.assert_allclose(lrs[above], lrs[0] * cos[above], rtol=1e-5, err_msg=name)
  assert series["client"][-1] == pytest.approx(0.003)


def test_tree_distance():
  a = {"w": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}
  b = {"w": np.zeros((2, 3), np.float32), "b": np.full(4, 2.0, np.float32)}
  for fn in (training.tree_distance, jax.jit(training.tree_distance)):
    d = fn(a, b)
    chex.assert_shape(d, ())
    chex.assert_trees_all_close(d, np.sqrt(6.0 + 16.0))
    chex.assert_trees_all_close(fn(a, a), 0.0)


def test_evaluate_chunks_and_mask(linear_apply_fn, linear_params, union):
  x = np.asarray(union[0]).reshape(-1, 8, 8, 1)
  y = np.asarray(union[1]).reshape(-1)
  mask = np.arange(16) < 11
  losses, correct = host(
    jax.jit(
      lambda p: (
        training.cross_entropy(linear_apply_fn(p, x), y),
        (jnp.argmax(linear_apply_fn(p, x), -1) == y).astype(jnp.float32),
      )
    )(linear_params)
  )
  for fn in (
    training.evaluate,
    jax.jit(training.evaluate, static_argnums=0, static_argnames="chunk_size"),
  ):
    out = fn(linear_apply_fn, linear_params, x, y, mask, chunk_size=7)  # 3 chunks of 6, 2 pad rows
    chex.assert_shape([out.loss, out.accuracy], ())
    chex.assert_trees_all_close(out.loss, np.mean(losses[:11]), rtol=1e-5)
    chex.assert_trees_all_close(out.accuracy, np.mean(correct[:11]), rtol=1e-5)
    full = fn(linear_apply_fn, linear_params, x, y)
    chex.assert_trees_all_close(full.loss, np.mean(losses), rtol=1e-5)


@pytest.mark.parametrize(
  "n, chunk_size, traced", [(2048, 1000, 683), (12000, 16, 16), (16, 5, 4), (3, 1000, 3)]
)
def test_evaluate_makes_chunks_equal(n, chunk_size, traced):
  """ceil(N / chunk_size) chunks of near-equal size: 2,048 in chunks <= 1000 is 3 x 683, not 3 x 1000."""
  seen = []

  def apply_fn(p, x):
    seen.append(x.shape[0])  # the chunk shape, recorded while tracing
    return jnp.zeros((x.shape[0], 3)) + p

  x, p, y = np.zeros((n, 1), np.float32), np.zeros(3, np.float32), np.zeros((n,), np.int32)
  out = evaluate_jit(apply_fn, p, x, y, chunk_size=chunk_size)  # one program
  assert seen == [traced]
  chex.assert_trees_all_close(out.loss, np.log(3.0), rtol=1e-6)
  with raises_field("chunk_size"):
    training.evaluate(apply_fn, p, x, y, chunk_size=0)
  with raises_field("x"):
    training.evaluate(apply_fn, p, x[:0], y[:0])


def test_sgd_epoch(linear_apply_fn, linear_params, union):
  # Reshaped on the host, on the device for the eager epoch (it gathers batches with traced
  # indices).
  x = jnp.asarray(np.asarray(union[0]).reshape(-1, 8, 8, 1))
  y = jnp.asarray(np.asarray(union[1]).reshape(-1))
  weights = jnp.asarray(np.ones(16, np.float32))
  epoch = functools.partial(training.sgd_epoch, batch_size=6, dsa_strategy="")
  eager = epoch(jax.random.PRNGKey(0), linear_apply_fn, linear_params, x, y, weights, 0.1)
  jitted = jax.jit(epoch, static_argnums=1)(
    jax.random.PRNGKey(0), linear_apply_fn, linear_params, x, y, weights, 0.1
  )
  chex.assert_trees_all_close(eager, jitted, atol=1e-6)
  params, steps = eager
  chex.assert_trees_all_equal_shapes_and_dtypes(params, linear_params)
  assert int(steps) == 3  # ceil(16 / 6) batches
  # One full batch: exactly one gradient step on the mean loss.
  params, steps = sgd_epoch_jit(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    x,
    y,
    weights,
    0.1,
    batch_size=16,
    dsa_strategy="",
  )
  g = _mean_loss_grad(linear_apply_fn)(linear_params, x, y)
  chex.assert_trees_all_close(
    params, jax.tree.map(lambda p, g: p - 0.1 * g, linear_params, g), atol=1e-6
  )
  # Zero weights: no update and no step counted.
  params, steps = sgd_epoch_jit(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    x,
    y,
    np.zeros(16, np.float32),
    0.1,
    batch_size=6,
    dsa_strategy="",
  )
  chex.assert_trees_all_equal(params, linear_params)
  assert int(steps) == 0


def test_evaluate_is_independent_of_the_chunk_size(
  linear_apply_fn, linear_params, calibration_data
):
  # The backend default (16 on CPU), a ragged split and one chunk agree; the
  # mask excludes records exactly.
  x, y = calibration_data[1][:2]
  mask = np.arange(x.shape[0]) % 3 != 0
  ref = evaluate_jit(linear_apply_fn, linear_params, x, y, mask, chunk_size=x.shape[0])
  assert training.default_eval_chunk_size() == (16 if jax.default_backend() == "cpu" else 1000)
  for cs in (None, 7):
    out = evaluate_jit(linear_apply_fn, linear_params, x, y, mask, chunk_size=cs)
    np.testing.assert_allclose(out.loss, ref.loss, rtol=1e-5)
    np.testing.assert_allclose(out.accuracy, ref.accuracy, rtol=1e-6)
  kept = mask
  sub = evaluate_jit(linear_apply_fn, linear_params, np.asarray(x)[kept], np.asarray(y)[kept])
  np.testing.assert_allclose(sub.loss, ref.loss, rtol=1e-5)


def test_cosine_open_schedule_has_no_zero_rate_round():
  fn = training.cosine_learning_rate
  lrs = [float(fn(m, 3, 0.2, schedule="cosine_open")) for m in (1, 2, 3)]
  np.testing.assert_allclose(lrs, [0.2, 0.15, 0.05], rtol=1e-5)
  # The reference schedule spends its last round at the floor, 1 % of eta_0.
  assert float(fn(3, 3, 0.2)) == pytest.approx(0.002)
  chex.assert_trees_all_close(fn(1, 1, 0.3, schedule="cosine_open"), 0.3)
  with raises_field("lr_schedule"):
    fn(1, 3, 0.1, schedule="linear")


def test_server_momentum_and_weight_decay_are_pytorch_sgd(linear_apply_fn, linear_params, union):
  """Two full-batch epochs of ``global_update`` with momentum m and decay wd, by hand (PyTorch SGD)."""
  lr, m, wd = 0.1, 0.9, 5e-3
  cfg = ServerConfig(
    radius_strategy="fixed",
    batch_size=16,
    max_epochs=2,
    dsa_strategy="",
    weighting="uniform",
    momentum=m,
    weight_decay=wd,
  )
  params, metrics = server.global_update(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    union,
    jnp.ones(2),
    jnp.inf,
    learning_rate=lr,
    config=cfg,
  )
  x, y = union.x.reshape(-1, 8, 8, 1), union.y.reshape(-1)
  w, buf = jax.tree.map(np.asarray, linear_params), None
  for _ in range(2):
    g = jax.tree.map(np.asarray, _mean_loss_grad(linear_apply_fn)(w, x, y))
    d = jax.tree.map(lambda g, p: g + wd * p, g, w)
    buf = d if buf is None else jax.tree.map(lambda b, di: m * b + di, buf, d)
    w = jax.tree.map(lambda p, b: p - lr * b, w, buf)
  chex.assert_trees_all_close(params, w, atol=1e-6)
  assert int(metrics.epochs) == 2 and int(metrics.steps) == 2
  # Plain SGD (the FedLAP server) is the default: momentum and decay 0.
  assert (ServerConfig().momentum, ServerConfig().weight_decay) == (0.0, 0.0)
  with raises_field("server.momentum"):
    ServerConfig(momentum=1.0)
  with raises_field("server.weight_decay"):
    ServerConfig(weight_decay=-1.0)


def test_default_server_is_plain_sgd_as_before(linear_apply_fn, linear_params, union):
  """FedLAP's server is unchanged by the optimiser option: with the default momentum and decay
  (0, 0), two full-batch epochs of ``global_update`` are two plain SGD steps ``w - lr g``."""
  cfg = ServerConfig(
    radius_strategy="fixed", batch_size=16, max_epochs=2, dsa_strategy="", weighting="uniform"
  )
  params, _ = server.global_update(
    jax.random.PRNGKey(0),
    linear_apply_fn,
    linear_params,
    union,
    jnp.ones(2),
    jnp.inf,
    learning_rate=0.1,
    config=cfg,
  )
  x, y = union.x.reshape(-1, 8, 8, 1), union.y.reshape(-1)
  w = jax.tree.map(np.asarray, linear_params)
  for _ in range(2):
    g = jax.tree.map(np.asarray, _mean_loss_grad(linear_apply_fn)(w, x, y))
    w = jax.tree.map(lambda p, g: p - np.float32(0.1) * g, w, g)
  chex.assert_trees_all_close(params, w, atol=1e-6)


def test_train_epoch_takes_any_optax_optimiser(linear_apply_fn, linear_params, union):
  """``train_epoch`` applies the given optimiser and returns its state: Adam, one full batch."""
  import optax  # pylint: disable=g-import-not-at-top

  x, y = union.x.reshape(-1, 8, 8, 1), union.y.reshape(-1)
  weights = np.ones(16, np.float32)
  weights[3] = 0.0  # one padding example
  opt = optax.adam(0.01)
  params, state, steps = jax.jit(
    functools.partial(
      training.train_epoch, apply_fn=linear_apply_fn, optimizer=opt, batch_size=16, dsa_strategy=""
    )
  )(
    jax.random.PRNGKey(0),
    params=linear_params,
    opt_state=opt.init(linear_params),
    x=x,
    y=y,
    weights=weights,
  )
  keep = weights > 0

  @jax.jit
  def by_hand(p):  # one Adam step on the gradient of the real examples' mean loss
    g = jax.grad(lambda q: jnp.mean(training.cross_entropy(linear_apply_fn(q, x[keep]), y[keep])))(
      p
    )
    updates, state = opt.update(g, opt.init(p), p)
    return optax.apply_updates(p, updates), state

  want_params, want_state = by_hand(linear_params)
  chex.assert_trees_all_close(params, want_params, atol=1e-6)
  chex.assert_trees_all_close(state, want_state, atol=1e-6)
  chex.assert_trees_all_equal_shapes_and_dtypes(params, linear_params)
  assert int(steps) == 1
  # Adam's first step moves every parameter by about lr (its sign-like update).
  moved = np.abs(
    np.asarray(jax.tree.leaves(params)[0]) - np.asarray(jax.tree.leaves(linear_params)[0])
  )
  assert 0.005 < float(np.max(moved)) <= 0.0101
