"""Tests for fedlap_jax.methods.fedlap.client: local_approx (Algorithms 1 and 3) and its pieces.

A linear classifier (``conftest.linear_apply``: local_approx takes any
``apply_fn``) on one digits client (290 records of classes 5 and 6), no DSA, so
that each config compiles in about a second. Each
ClientConfig is a static argument, hence one compilation per config: the
configs below are module-level and every test reuses their runs.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import matching, privacy, training
from fedlap_jax.methods.fedlap import client
from fedlap_jax.methods.fedlap.client import local_approx
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.methods.fedlap.config import ClientConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.losses import cross_entropy
from fedlap_jax.matching import matching_distance
from fedlap_jax.synthetic import noise_images, synthetic_labels
from fedlap_jax.training import tree_distance
from conftest import raises_field


IPC = 2
LR = 0.1

# The model never moves (inner_loop = 0): the while loop always runs max_outer, and with
# batch_size = N_k (q = 1) every real gradient is the same full-batch gradient, so the logged
# matching losses are L_dis against one fixed target.
FIXED = ClientConfig(
  ipc=IPC,
  iterations=2,
  max_outer=3,
  batch_loop=2,
  boost_loop=3,
  inner_loop=0,
  batch_size=290,
  image_lr=1.0,
  mse_weight=0.1,
  radius=1.0,
  calibrate_radius=False,
  dsa_strategy="",
)
# A tiny radius: the first local epoch leaves the ball, the while loop stops after 1 iteration.
TINY_RADIUS = ClientConfig(
  ipc=IPC,
  iterations=2,
  max_outer=4,
  batch_loop=2,
  boost_loop=1,
  inner_loop=1,
  batch_size=64,
  radius=1e-4,
  calibrate_radius=False,
  dsa_strategy="",
)
# DP with a radius never reached: the loop is bounded by max_outer; C is so small that every
# per-example gradient is clipped.
DP_LARGE_RADIUS = ClientConfig(
  ipc=IPC,
  iterations=2,
  max_outer=3,
  batch_loop=2,
  boost_loop=1,
  inner_loop=1,
  batch_size=64,
  radius=1e3,
  mse_weight=0.0,
  calibrate_radius=False,
  dsa_strategy="",
  dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1e-3, delta=1e-5),
)

local_approx_jit = jax.jit(local_approx, static_argnames=("apply_fn", "config"))
# The library calls the tests check against, jitted once for the file (the same static
# arguments, hence one program per input shape).
_real_gradient = jax.jit(privacy.real_gradient, static_argnums=0)
_clipped_sum = jax.jit(
  privacy.clipped_gradient_sum, static_argnums=0, static_argnames="l2_clip_norm"
)
_matching_step = jax.jit(
  matching.matching_step, static_argnums=0, static_argnames=("dsa_strategy", "mse_weight")
)


def host(tree):
  """``tree`` read back as NumPy arrays: the checks that follow compile nothing."""
  return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def client_data(client_parts) -> ClientData:
  x, y = client_parts[0]
  assert len(y) == 290 and set(np.unique(y)) == {5, 6}
  return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(np.ones(len(y), bool)))


@pytest.fixture(scope="module")
def full_gradient(linear_apply_fn, linear_params, client_data):
  """The real gradient of the whole client (every record, no padding), jitted."""
  padding = ~np.asarray(client_data.mask)
  return _real_gradient(linear_apply_fn, linear_params, client_data.x, client_data.y, padding)


@pytest.fixture(scope="module")
def synthetic(client_data) -> SyntheticSet:
  labels, mask = synthetic_labels([np.asarray(client_data.y)], IPC)
  mask = jnp.asarray(mask[0])
  return SyntheticSet(
    noise_images(jax.random.PRNGKey(5), mask, (8, 8, 1)), jnp.asarray(labels[0]), mask
  )


@pytest.fixture(scope="module")
def run(linear_apply_fn, linear_params, synthetic, client_data):
  """``run(config) -> (synthetic, r_k, metrics)``, memoised per config."""
  cache = {}

  def go(config):
    if config not in cache:
      cache[config] = local_approx_jit(
        jax.random.PRNGKey(1),
        linear_apply_fn,
        linear_params,
        synthetic,
        client_data,
        config,
        learning_rate=LR,
      )
    return cache[config]

  return go


def check_outputs(out, synthetic, config):
  """Shapes and dtypes of everything local_approx returns."""
  syn, r_k, m = out
  chex.assert_trees_all_equal_shapes_and_dtypes(syn, synthetic)
  chex.assert_trees_all_equal(syn.y, synthetic.y)
  chex.assert_trees_all_equal(syn.mask, synthetic.mask)
  chex.assert_shape(r_k, ())
  chex.assert_type(r_k, jnp.float32)
  c = config
  chex.assert_shape(
    m.matching_loss, (c.iterations, c.max_outer, c.targets_per_iteration, c.boost_loop)
  )
  chex.assert_shape([m.outer_iterations, m.trajectory_distance], (c.iterations,))
  chex.assert_shape(
    [m.real_accesses, m.poisson_extra_chunks, m.mean_batch_size, m.clip_fraction], ()
  )
  chex.assert_type([m.outer_iterations, m.real_accesses, m.poisson_extra_chunks], jnp.int32)
  chex.assert_type(
    [m.matching_loss, m.mean_batch_size, m.trajectory_distance, m.clip_fraction], jnp.float32
  )
  chex.assert_tree_all_finite((syn.x, r_k, m.matching_loss))
  assert int(m.poisson_extra_chunks) == 0
  # The accesses counted are the batches actually drawn.
  assert int(m.real_accesses) == int(np.sum(np.asarray(m.outer_iterations))) * c.batch_loop
  assert np.all(np.asarray(m.outer_iterations) >= 1)
  assert np.all(np.asarray(m.outer_iterations) <= c.max_outer)
  # Losses are logged exactly for the iterations that ran.
  ran = np.arange(c.max_outer)[None, :] < np.asarray(m.outer_iterations)[:, None]
  logged = np.asarray(m.matching_loss)
  assert np.all(logged[ran] > 0) and np.all(logged[~ran] == 0)


@pytest.mark.parametrize(
  "config", [FIXED, TINY_RADIUS, DP_LARGE_RADIUS], ids=["fixed", "tiny_radius", "dp"]
)
def test_outputs(run, synthetic, config):
  out = run(config)
  check_outputs(out, synthetic, config)
  assert not bool(np.allclose(np.asarray(out[0].x), np.asarray(synthetic.x)))
  chex.assert_trees_all_close(out[1], config.radius)  # no calibration: r_k = r


def test_eager_equals_jit(linear_apply_fn, linear_params, synthetic, client_data, run):
  eager = local_approx(
    jax.random.PRNGKey(1),
    linear_apply_fn,
    linear_params,
    synthetic,
    client_data,
    FIXED,
    learning_rate=LR,
  )
  chex.assert_trees_all_close(eager, run(FIXED), atol=1e-5, rtol=1e-5)


def test_while_loop_runs_max_outer_without_local_steps(run):
  _, _, m = run(FIXED)
  chex.assert_trees_all_equal(m.outer_iterations, np.array([3, 3], np.int32))
  assert int(m.real_accesses) == FIXED.real_accesses_per_round == 12
  chex.assert_trees_all_equal(m.trajectory_distance, np.zeros(2, np.float32))
  assert float(m.mean_batch_size) == 290.0  # q = 1: the full client every time
  assert float(m.clip_fraction) == 0.0


def test_while_loop_stops_at_radius(run):
  _, _, m = run(TINY_RADIUS)
  outer = np.asarray(m.outer_iterations)
  assert np.all(outer == 1), outer  # one local epoch already leaves a ball of radius 1e-4
  assert np.all(np.asarray(m.trajectory_distance) >= TINY_RADIUS.radius)
  assert int(m.real_accesses) == 2 * TINY_RADIUS.batch_loop
  # Poisson batches of expected size 64 out of 290.
  assert 30 < float(m.mean_batch_size) < 100


def test_while_loop_bounded_by_max_outer_and_dp(run):
  _, _, m = run(DP_LARGE_RADIUS)
  chex.assert_trees_all_equal(m.outer_iterations, np.array([3, 3], np.int32))
  dist = np.asarray(m.trajectory_distance)
  assert np.all(dist > 0) and np.all(dist < DP_LARGE_RADIUS.radius)
  assert int(m.real_accesses) == DP_LARGE_RADIUS.real_accesses_per_round == 12
  assert float(m.clip_fraction) == 1.0  # C = 1e-3 clips every per-example gradient


def test_local_approx_lowers_matching_loss(
  run, linear_apply_fn, linear_params, synthetic, full_gradient
):
  syn, _, m = run(FIXED)
  losses = np.asarray(m.matching_loss).reshape(-1)  # 36 updates against one fixed target
  assert losses[-1] < 0.5 * losses[0], losses
  # L_dis recomputed from scratch on the full-batch real gradient, before and after.
  g_real = full_gradient
  step = functools.partial(
    _matching_step, linear_apply_fn, dsa_strategy="", mse_weight=FIXED.mse_weight
  )
  before, _ = step(linear_params, synthetic, g_real, jax.random.PRNGKey(0))
  after, _ = step(linear_params, syn, g_real, jax.random.PRNGKey(0))
  chex.assert_trees_all_close(before, losses[0], rtol=1e-4)
  assert float(after) < 0.5 * float(before), (float(before), float(after))
  assert float(after) <= losses[-1] + 1e-4


def test_same_key_same_result(run, linear_apply_fn, linear_params, synthetic, client_data):
  again = local_approx_jit(
    jax.random.PRNGKey(1),
    linear_apply_fn,
    linear_params,
    synthetic,
    client_data,
    TINY_RADIUS,
    learning_rate=LR,
  )
  chex.assert_trees_all_equal(again, run(TINY_RADIUS))
  other = local_approx_jit(
    jax.random.PRNGKey(2),
    linear_apply_fn,
    linear_params,
    synthetic,
    client_data,
    TINY_RADIUS,
    learning_rate=LR,
  )
  assert not bool(np.allclose(np.asarray(other[0].x), np.asarray(run(TINY_RADIUS)[0].x)))


def test_a_buffer_smaller_than_the_draw_gives_the_same_result(
  run, linear_apply_fn, linear_params, synthetic, client_data
):
  """Exact Poisson sampling: a 32-slot buffer (B = 64; the config check bypassed) processes
  every draw in 2-4 chunks and gives the result of the default 116-slot buffer."""
  small = dataclasses.replace(DP_LARGE_RADIUS, poisson_capacity=None)
  object.__setattr__(small, "poisson_capacity", 32)  # below min_poisson_capacity(64) = 88
  assert small.capacity == 32
  out = local_approx_jit(
    jax.random.PRNGKey(1),
    linear_apply_fn,
    linear_params,
    synthetic,
    client_data,
    small,
    learning_rate=LR,
  )
  ref = run(DP_LARGE_RADIUS)
  assert int(out[2].poisson_extra_chunks) >= int(out[2].real_accesses)  # >= 1 per batch
  assert int(ref[2].poisson_extra_chunks) == 0
  chex.assert_trees_all_close(out[2].mean_batch_size, ref[2].mean_batch_size)
  chex.assert_trees_all_close(out[2].clip_fraction, ref[2].clip_fraction)
  # Summation order differs, and the image updates amplify it (here at most 6e-5 of a
  # matching loss, relative, and 6e-4 of a pixel); a buffer keeping only its first 32 records
  # moves the first matching loss by 8 %, later ones by up to 76 %, and the images by up to 20.
  chex.assert_trees_all_close(out[2].matching_loss, ref[2].matching_loss, rtol=1e-4)
  chex.assert_trees_all_close(out[0].x, ref[0].x, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dsa_strategy", ["", "flip_crop"])
def test_matching_step(linear_apply_fn, linear_params, full_gradient, synthetic, dsa_strategy):
  """L_dis and its image gradient (grad of grad), eager and jitted."""
  g_real = full_gradient
  step = functools.partial(
    matching.matching_step, linear_apply_fn, dsa_strategy=dsa_strategy, mse_weight=0.1
  )
  eager = step(linear_params, synthetic, g_real, jax.random.PRNGKey(3))
  jitted = jax.jit(step)(linear_params, synthetic, g_real, jax.random.PRNGKey(3))
  chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5)
  loss, grad_x = eager
  chex.assert_shape(loss, ())
  chex.assert_trees_all_equal_shapes_and_dtypes(grad_x, synthetic.x)
  chex.assert_tree_all_finite(grad_x)
  assert float(np.max(np.abs(np.asarray(grad_x)))) > 0
  if not dsa_strategy:
    distance = jax.jit(
      lambda p, s, g: matching_distance(
        g, matching.synthetic_gradient(linear_apply_fn, p, s), mse_weight=0.1
      )
    )
    chex.assert_trees_all_close(loss, distance(linear_params, synthetic, g_real), rtol=1e-5)


def test_padding_slots_of_the_synthetic_set_are_ignored(
  linear_apply_fn, linear_params, full_gradient, synthetic
):
  """Padded synthetic slots (clients owning fewer classes) get no gradient and change nothing."""
  syn = host(synthetic)
  padded = SyntheticSet(
    np.concatenate([syn.x, 7.0 * np.ones_like(syn.x[:2])]),
    np.concatenate([syn.y, np.zeros(2, np.int32)]),
    np.concatenate([syn.mask, np.zeros(2, bool)]),
  )
  g_real = full_gradient
  step = functools.partial(_matching_step, linear_apply_fn, dsa_strategy="", mse_weight=0.1)
  loss, grad_x = step(linear_params, padded, g_real, jax.random.PRNGKey(0))
  ref_loss, ref_grad = step(linear_params, synthetic, g_real, jax.random.PRNGKey(0))
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5)
  grad_x = np.asarray(grad_x)
  chex.assert_trees_all_close(grad_x[:4], ref_grad, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_equal(grad_x[4:], np.zeros_like(grad_x[4:]))


def test_image_optimizer_is_momentum_sgd():
  opt = client.default_image_optimizer(
    ClientConfig(image_lr=2.0, image_momentum=0.5, dsa_strategy="")
  )
  x = np.zeros(3, np.float32)
  g = np.ones(3, np.float32)
  update = jax.jit(opt.update)
  state = jax.jit(opt.init)(x)
  u1, state = update(g, state, x)
  u2, _ = update(g, state, x)
  chex.assert_trees_all_close(u1, -2.0 * g)
  chex.assert_trees_all_close(u2, -2.0 * 1.5 * g)  # trace = g + 0.5 g


def test_average_targets_equals_one_target_when_the_batches_agree(run):
  # FIXED draws every record (q = 1) and has no DSA, so the batch_loop = 2 gradients of a
  # while-loop iteration are equal: their mean is that gradient, and averaging must give
  # exactly the run with one batch per iteration (same boost_loop updates against it). The
  # MSE term makes the target's scale matter (a sum instead of a mean would differ).
  avg = dataclasses.replace(FIXED, average_targets=True)
  one = dataclasses.replace(FIXED, batch_loop=1)
  s_avg, _, m_avg = run(avg)
  s_one, _, m_one = run(one)
  chex.assert_trees_all_close(s_avg.x, s_one.x, atol=1e-5, rtol=1e-5)
  loss_avg = np.asarray(m_avg.matching_loss)
  np.testing.assert_allclose(loss_avg, np.asarray(m_one.matching_loss), rtol=1e-5)
  # Every real batch is still counted: T = R_i * max_outer * batch_loop.
  assert int(m_avg.real_accesses) == avg.real_accesses_per_round == 2 * int(m_one.real_accesses)


def test_average_targets_under_dp_counts_every_access(run, synthetic):
  cfg = dataclasses.replace(DP_LARGE_RADIUS, average_targets=True, boost_loop=2)
  syn, _, m = run(cfg)
  chex.assert_tree_all_finite(syn.x)
  assert not bool(np.allclose(np.asarray(syn.x), np.asarray(synthetic.x)))
  assert int(m.real_accesses) == cfg.real_accesses_per_round
  loss = np.asarray(m.matching_loss)
  assert loss.shape[2] == 1 and np.all(loss > 0)  # one target per while-loop iteration


def test_average_targets_must_be_a_bool():
  with raises_field("average_targets"):
    ClientConfig(average_targets=1)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _gradient_descent(apply_fn, params, client_data, steps):
  """``params`` after ``steps`` full-batch gradient steps of rate LR on every record, as they are
  (one program)."""
  x = client_data.images(jnp.arange(client_data.y.shape[0]))
  loss = lambda p: jnp.mean(cross_entropy(apply_fn(p, x), client_data.y))
  w = params
  for _ in range(steps):
    w = jax.tree.map(lambda p, g: p - LR * g, w, jax.grad(loss)(w))
  return w


def test_noisy_real_model_steps_are_gradient_descent(
  run, linear_apply_fn, linear_params, client_data
):
  # q = 1, no DSA, no DP, batch_loop = 1: each while-loop iteration's target is the
  # full-batch gradient, and model_steps='noisy_real' steps w <- w - LR g along it, also after
  # the last iteration: model_delta = 3 steps of full-batch gradient descent (both trajectories
  # are equal, so their mean is that). The paper's steps (synthetic, R_l = 0) leave w alone.
  cfg = dataclasses.replace(
    FIXED, batch_loop=1, average_targets=True, model_steps="noisy_real", inner_loop=0
  )
  _, _, m = run(cfg)
  w = _gradient_descent(linear_apply_fn, linear_params, client_data, cfg.max_outer)
  expected = jax.tree.map(np.subtract, host(w), host(linear_params))
  chex.assert_trees_all_close(m.model_delta, expected, atol=1e-5, rtol=1e-4)
  np.testing.assert_allclose(
    np.asarray(m.trajectory_distance), float(jax.jit(tree_distance)(w, linear_params)), rtol=1e-4
  )
  assert run(dataclasses.replace(cfg, model_steps="synthetic"))[2].model_delta is None


def test_real_dsa_strategy_none_steps_along_the_gradient_of_the_records(
  run, linear_apply_fn, linear_params, client_data
):
  # The synthetic side augments (flip), the real batches do not (real_dsa_strategy=""): the
  # noisy_real trajectory is then full-batch gradient descent on the records as they are, as in
  # the test above. With the paper's default (real batches augmented like the synthetic ones,
  # real_dsa_strategy=None) the flipped batches give other gradients and this fails.
  cfg = dataclasses.replace(
    FIXED,
    batch_loop=1,
    boost_loop=1,
    average_targets=True,
    model_steps="noisy_real",
    inner_loop=0,
    dsa_strategy="flip",
    real_dsa_strategy="",
  )
  w = _gradient_descent(linear_apply_fn, linear_params, client_data, cfg.max_outer)
  expected = jax.tree.map(np.subtract, host(w), host(linear_params))
  chex.assert_trees_all_close(run(cfg)[2].model_delta, expected, atol=1e-5, rtol=1e-4)


def test_real_dsa_strategy_is_validated():
  with raises_field("real_dsa_strategy"):
    ClientConfig(real_dsa_strategy="spin")


def test_noisy_real_refuses_local_epochs_it_would_not_run():
  # noisy_real steps the model along the noisy gradients: R_l epochs on the synthetic set
  # never run, so a positive inner_loop would be silently ignored.
  with raises_field("inner_loop"):
    ClientConfig(model_steps="noisy_real", average_targets=True, inner_loop=2)
  ClientConfig(model_steps="noisy_real", average_targets=True, inner_loop=0)
  ClientConfig(model_steps="synthetic", inner_loop=2)


def test_noisy_real_needs_average_targets():
  with raises_field("model_steps"):
    ClientConfig(model_steps="noisy_real")
  with raises_field("model_steps"):
    ClientConfig(model_steps="real", average_targets=True)


def _with(data, **leaves):
  return data._replace(**leaves)


@pytest.mark.parametrize(
  "change, field",
  [
    (
      lambda s, d: (_with(s, x=np.zeros((s.x.shape[0], 8, 8, 3), np.float32)), d),
      "synthetic.x.shape",
    ),
    (lambda s, d: (s, _with(d, y=np.asarray(d.y).astype(np.float32))), "client_data.y.dtype"),
    (lambda s, d: (_with(s, mask=np.asarray(s.mask)[:-1]), d), "synthetic.mask.shape"),
    (lambda s, d: (_with(s, x=np.asarray(s.x).astype(np.int32)), d), "synthetic.x.dtype"),
    (lambda s, d: (s, _with(d, x=(10 * np.asarray(d.x)).astype(np.uint8))), "client_data.x.dtype"),
    (lambda s, d: (s, ClientData(*(np.asarray(a)[:40] for a in (d.x, d.y, d.mask)))), "batch_size"),
  ],
)
def test_local_approx_refuses_inputs_it_cannot_use(
  linear_apply_fn, linear_params, synthetic, client_data, change, field
):
  """Static shapes and dtypes are checked when local_approx is traced, before any compile."""
  bad_synthetic, bad_data = change(synthetic, client_data)
  with raises_field(field):
    local_approx_jit(
      jax.random.PRNGKey(1),
      linear_apply_fn,
      linear_params,
      bad_synthetic,
      bad_data,
      TINY_RADIUS,
      learning_rate=LR,
    )
  client.check_inputs(synthetic, client_data, TINY_RADIUS)  # the unchanged inputs pass
  # Stored pixels with their normalisation are model inputs.
  pixels = ClientData(
    np.zeros(client_data.x.shape, np.uint8),
    client_data.y,
    client_data.mask,
    pixel_scale=np.ones(1, np.float32),
    pixel_offset=np.zeros(1, np.float32),
  )
  client.check_inputs(synthetic, pixels, TINY_RADIUS)


# ---------------------------------------------------------------- the pieces, each alone

DP_Q1 = ClientConfig(
  ipc=IPC,
  iterations=1,
  max_outer=1,
  batch_loop=3,
  boost_loop=2,
  inner_loop=1,
  batch_size=290,
  image_lr=0.5,
  image_momentum=0.0,
  mse_weight=0.1,
  radius=1.0,
  calibrate_radius=False,
  dsa_strategy="",
  dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=0.05, delta=1e-5),
)
NONDP_Q1 = dataclasses.replace(DP_Q1, dp=None)


def _problem(apply_fn, params, synthetic, client_data, config, optimizer=None):
  return client.LocalProblem(
    apply_fn,
    params,
    synthetic,
    client_data,
    config,
    jnp.float32(LR),
    optimizer or client.default_image_optimizer(config),
  )


def _target_fn(p):
  """``keys, params -> noisy_real_target(p, keys, params)``, jitted."""
  return jax.jit(lambda keys, params: client.noisy_real_target(p, keys, params))


def test_noisy_real_target_at_q_one_is_the_full_batch_gradient(
  linear_apply_fn, linear_params, synthetic, client_data, full_gradient
):
  p = _problem(linear_apply_fn, linear_params, synthetic, client_data, NONDP_Q1)
  t = _target_fn(p)((jax.random.PRNGKey(0), None), linear_params)
  full = full_gradient
  chex.assert_trees_all_close(t.gradient, full, atol=1e-6, rtol=1e-5)
  assert int(t.batch_size) == 290 and int(t.extra_chunks) == 0 and float(t.clipped) == 0.0


def test_noisy_real_target_under_dp_is_the_clipped_noised_sum_over_b(
  linear_apply_fn, linear_params, synthetic, client_data
):
  """Algorithm 3's target by hand: every record (q = 1) clipped to C, N(0, sigma^2 C^2) with
  the batch's noise key, divided by B."""
  key = jax.random.PRNGKey(4)
  p = _problem(linear_apply_fn, linear_params, synthetic, client_data, DP_Q1)
  t = _target_fn(p)((key, None), linear_params)
  dp = DP_Q1.dp
  clipped, norms = _clipped_sum(
    linear_apply_fn,
    linear_params,
    client_data.x,
    client_data.y,
    ~np.asarray(client_data.mask),
    l2_clip_norm=dp.l2_clip_norm,
  )
  expected = jax.jit(
    lambda k, g: privacy.privatise(
      jax.random.split(k, 3)[2],
      g,
      l2_clip_norm=dp.l2_clip_norm,
      noise_multiplier=dp.noise_multiplier,
      expected_batch_size=290,
    )
  )(key, clipped)
  chex.assert_trees_all_close(t.gradient, expected, atol=1e-6, rtol=1e-5)
  assert float(t.clipped) == float(np.sum(np.asarray(norms) > dp.l2_clip_norm)) > 0


def test_match_images_steps_the_images_with_the_given_optimizer(
  linear_apply_fn, linear_params, synthetic, client_data, full_gradient
):
  """R_b = 2 updates of plain SGD at 0.5, by hand: x <- x - 0.5 grad_x L_dis."""
  opt = optax.sgd(0.5)
  p = _problem(linear_apply_fn, linear_params, synthetic, client_data, NONDP_Q1, opt)
  target = full_gradient
  keys = (jax.random.PRNGKey(0), None)
  x, _, losses = jax.jit(
    lambda params, images, t, ks: client.match_images(
      p, params, images, opt.init(images), t, ks, fresh_augmentation=False
    )
  )(linear_params, synthetic.x, target, keys)
  x_ref, ref_losses = np.asarray(synthetic.x), []
  for _ in range(2):
    loss, grad_x = _matching_step(
      linear_apply_fn,
      linear_params,
      synthetic._replace(x=x_ref),
      target,
      keys[0],
      dsa_strategy="",
      mse_weight=0.1,
    )
    ref_losses.append(np.asarray(loss))
    x_ref = x_ref - np.float32(0.5) * np.asarray(grad_x)
  chex.assert_trees_all_close(x, x_ref, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(losses, np.stack(ref_losses), rtol=1e-5)


def test_averaged_target_is_the_mean_of_the_batch_targets(
  linear_apply_fn, linear_params, synthetic, client_data
):
  cfg = dataclasses.replace(DP_Q1, average_targets=True)
  p = _problem(linear_apply_fn, linear_params, synthetic, client_data, cfg)
  keys = (jax.random.PRNGKey(2), None)

  def recipe_of(targets_fn):
    return jax.jit(
      lambda ks, params, images: targets_fn(
        p, ks, params, images, p.optimizer.init(images), client.AccessStats.zeros()
      )
    )

  x, _, losses, stats, g = recipe_of(client.averaged_target)(keys, linear_params, synthetic.x)
  target = _target_fn(p)
  targets = [host(target(client._fold(keys, b), linear_params).gradient) for b in range(3)]
  chex.assert_trees_all_close(g, jax.tree.map(lambda *t: sum(t) / 3, *targets), atol=1e-7)
  assert int(stats.accesses) == 3 and int(stats.sampled) == 3 * 290
  assert np.all(np.asarray(losses[0]) > 0) and np.all(np.asarray(losses[1:]) == 0)
  # The per-batch recipe's first row is against the first batch's target alone.
  _, _, per_batch, stats_b, none = recipe_of(client.per_batch_targets)(
    keys, linear_params, synthetic.x
  )
  assert none is None and int(stats_b.accesses) == 3
  first, _ = _matching_step(
    linear_apply_fn,
    linear_params,
    synthetic,
    targets[0],
    jax.random.split(client._fold(keys, 0)[0], 3)[1],
    dsa_strategy="",
    mse_weight=0.1,
  )
  np.testing.assert_allclose(float(per_batch[0, 0]), float(first), rtol=1e-5)


def test_the_model_steps(linear_apply_fn, linear_params, synthetic, client_data):
  p = _problem(linear_apply_fn, linear_params, synthetic, client_data, DP_Q1)
  g = jax.tree.map(jnp.ones_like, linear_params)
  moved = client.noisy_real_step(p, None, 0, linear_params, synthetic.x, g)
  chex.assert_trees_all_close(moved, jax.tree.map(lambda w: w - LR, linear_params))
  keys = (jax.random.PRNGKey(3), None)
  epochs = client.synthetic_epochs(p, keys, linear_params, synthetic.x)
  k, _ = client._fold(client._fold(keys, DP_Q1.batch_loop), 0)
  ref = training.sgd_epoch(
    k,
    linear_apply_fn,
    linear_params,
    synthetic.x,
    synthetic.y,
    synthetic.mask.astype(jnp.float32),
    LR,
    batch_size=DP_Q1.model_batch_size,
    dsa_strategy="",
  )[0]
  chex.assert_trees_all_close(epochs, ref, atol=1e-7)
  # The paper's step: those epochs after every while-loop iteration but the last permitted.
  two = _problem(
    linear_apply_fn, linear_params, synthetic, client_data, dataclasses.replace(DP_Q1, max_outer=2)
  )
  step = client.synthetic_model_step
  chex.assert_trees_all_close(step(two, keys, 0, linear_params, synthetic.x, None), ref, atol=1e-7)
  chex.assert_trees_all_equal(step(two, keys, 1, linear_params, synthetic.x, None), linear_params)


def test_recipe_names_the_pieces_of_each_config():
  paper = client.recipe(FIXED)
  assert paper == (client.per_batch_targets, None, False)
  assert client.recipe(TINY_RADIUS).model_step is client.synthetic_model_step
  hybrid = client.recipe(
    dataclasses.replace(DP_Q1, average_targets=True, model_steps="noisy_real", inner_loop=0)
  )
  assert hybrid == (client.averaged_target, client.noisy_real_step, True)


TOY = ClientConfig(
  ipc=1,
  iterations=1,
  max_outer=5,
  batch_loop=1,
  boost_loop=1,
  radius=1.0,
  calibrate_radius=False,
  dsa_strategy="",
)


def _toy_trajectory(step, client_axis, moves_model=True):
  """A trajectory whose iteration moves w by ``step`` and logs loss o + 1."""

  def iteration(keys_o, o, w, images, opt_state, stats):
    return (
      {"w": w["w"] + step},
      images + 1.0,
      opt_state,
      jnp.full((1, 1), o + 1.0),
      stats.add(client.RealTarget(None, None, None, 1, 0, 0.0)),
    )

  return client.trajectory(
    iteration,
    (jax.random.PRNGKey(0), None),
    {"w": jnp.float32(0.0)},
    jnp.float32(0.0),
    (),
    client.AccessStats.zeros(),
    config=TOY,
    moves_model=moves_model,
    client_axis=client_axis,
  )


def test_one_trajectory_function_alone_and_side_by_side():
  """Alone each client stops at its own iteration; side by side (shared counter, masks) every
  client ends exactly where it ends alone."""
  steps = np.array([0.3, 0.6, 0.1], np.float32)
  one = jax.jit(lambda s: _toy_trajectory(s, None))  # the step traced: one program
  alone = [host(one(s)) for s in steps]
  images, _, stats, log = alone[0]
  assert int(log.iterations) == 4 and int(stats.accesses) == 4 and float(images) == 4.0
  np.testing.assert_allclose(float(log.distance), 1.2, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(log.matching_loss).ravel(), [1, 2, 3, 4, 0])
  assert [int(a[3].iterations) for a in alone] == [4, 2, 5]
  side = host(jax.jit(jax.vmap(lambda s: _toy_trajectory(s, "toy"), axis_name="toy"))(steps))
  for k in range(3):
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[k], side), alone[k])
  # A model that never moves: the radius cannot stop the loop.
  _, _, _, still = _toy_trajectory(0.3, None, moves_model=False)
  assert int(still.iterations) == TOY.max_outer and float(still.distance) == 0.0


def test_a_custom_image_optimizer_is_used(
  linear_apply_fn, linear_params, synthetic, client_data, full_gradient
):
  run = jax.jit(local_approx, static_argnames=("apply_fn", "config", "image_optimizer"))
  cfg = dataclasses.replace(NONDP_Q1, batch_loop=1, boost_loop=1, inner_loop=0)
  args = (jax.random.PRNGKey(1), linear_apply_fn, linear_params, synthetic, client_data, cfg)
  default = run(*args, learning_rate=LR)
  explicit = run(*args, learning_rate=LR, image_optimizer=optax.sgd(0.5))
  chex.assert_trees_all_equal(default, explicit)  # the default is tau's SGD (momentum 0 here)
  frozen = run(*args, learning_rate=LR, image_optimizer=optax.scale(0.0))
  chex.assert_trees_all_equal(frozen[0].x, synthetic.x)
  adam = run(*args, learning_rate=LR, image_optimizer=optax.adam(0.01))
  # Adam's first step: -0.01 g / (|g| + eps), g the image gradient against the full batch.
  target = full_gradient
  _, g = host(
    _matching_step(
      linear_apply_fn,
      linear_params,
      synthetic,
      target,
      jax.random.PRNGKey(0),
      dsa_strategy="",
      mse_weight=0.1,
    )
  )
  adam_step = np.asarray(synthetic.x) - np.float32(0.01) * g / (np.abs(g) + np.float32(1e-8))
  chex.assert_trees_all_close(adam[0].x, adam_step, atol=1e-4)
  assert not np.allclose(np.asarray(adam[0].x), np.asarray(default[0].x), atol=1e-3)
