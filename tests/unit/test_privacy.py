"""Tests for fedlap_jax.privacy: Poisson sampling, per-example clipping, Gaussian noise."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import privacy
from fedlap_jax.client_data import ClientData
from fedlap_jax.dp_config import DPConfig
from conftest import raises_field


CLIP = 6.4  # between the smallest and the largest per-example norm of the batch below


@pytest.fixture(scope="module")
def batch(digits):
  """Eight real digits with labels, and a padding mask hiding the last three (on the device,
  built on the host: no program compiled)."""
  x = jnp.asarray(digits.x_train[:8])
  y = jnp.asarray(digits.y_train[:8])
  is_padding = jnp.asarray(np.arange(8) >= 5)
  return x, y, is_padding


def host(tree):
  """``tree`` read back as NumPy arrays: the checks that follow compile nothing."""
  return jax.tree.map(np.asarray, tree)


# The Poisson sampler jitted once for the file (the capacity is static).
_sample = jax.jit(privacy.poisson_sample, static_argnums=3)


def global_norms(tree):
  """``(N,)`` L2 norms of per-example gradients (leaves with a leading ``N`` axis), on the
  host."""
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  return np.sqrt(sum(np.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1) for leaf in leaves))


# ---------------------------------------------------------------- Poisson sampling


def test_poisson_capacity_formula():
  for b in (1, 16, 64, 256, 1000):
    assert privacy.poisson_capacity(b) == math.ceil(b + 6 * math.sqrt(b) + 4)
  assert privacy.poisson_capacity(256) == 356
  assert privacy.poisson_capacity(100, num_std=3.0) == 134
  with raises_field("batch_size"):
    privacy.poisson_capacity(0)


@pytest.mark.parametrize("use_jit", [False, True])
def test_poisson_sample_shapes_and_content(use_jit):
  valid = jnp.asarray(np.arange(100) < 70)
  fn = _sample if use_jit else privacy.poisson_sample
  out = fn(jax.random.PRNGKey(3), valid, 0.3, 40)
  chex.assert_shape([out.indices, out.is_padding], (40,))
  chex.assert_shape([out.size, out.extra_chunks], ())
  chex.assert_shape(out.chosen, (100,))
  chex.assert_type([out.indices, out.size, out.extra_chunks], jnp.int32)
  chex.assert_type([out.is_padding, out.chosen], jnp.bool_)
  out = host(out)
  size = int(out.size)
  assert int(np.sum(~out.is_padding)) == size == int(np.sum(out.chosen))
  assert 0 < size <= 40 and int(out.extra_chunks) == 0
  chosen = out.indices[:size]
  assert np.all(np.diff(chosen) > 0)  # increasing, hence distinct
  assert np.all(chosen < 70)  # only valid records
  np.testing.assert_array_equal(chosen, np.flatnonzero(out.chosen))
  assert np.all(out.indices[size:] == 0)
  assert bool(np.all(out.is_padding[size:]))
  ref = privacy.poisson_sample(jax.random.PRNGKey(3), valid, 0.3, 40)
  chex.assert_trees_all_equal(out, ref)


def test_poisson_batch_size_mean_and_variance():
  n_valid, q, draws = 800, 0.1, 4000
  valid = np.arange(1000) < n_valid
  sample = jax.jit(jax.vmap(lambda k: privacy.poisson_sample(k, valid, q, 160)))
  out = host(sample(jax.random.split(jax.random.PRNGKey(0), draws)))
  sizes = np.asarray(out.size, np.float64)
  mean, var = q * n_valid, q * n_valid * (1 - q)  # 80, 72
  assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / draws)
  assert abs(sizes.var(ddof=1) / var - 1) < 0.1  # std. error of the ratio ~ 2.2%
  assert int(np.sum(out.extra_chunks)) == 0
  assert int(np.max(np.where(out.is_padding, 0, out.indices))) < n_valid


def test_an_overflowing_draw_is_read_whole_in_chunks():
  valid = np.ones((200,), bool)
  key = jax.random.PRNGKey(7)
  full_d = _sample(key, valid, 0.5, 200)
  small_d = _sample(key, valid, 0.5, 30)
  full, small = host(full_d), host(small_d)
  total = int(full.size)
  assert total > 90
  assert int(small.size) == total and int(small.extra_chunks) == math.ceil(total / 30) - 1
  assert not bool(np.any(small.is_padding))
  chex.assert_trees_all_equal(small.indices, full.indices[:30])  # the first 30 records drawn
  chunk = jax.jit(privacy.poisson_chunk)  # j traced: one program for every chunk
  chunks = [host(chunk(small_d, j)) for j in range(int(small.extra_chunks) + 2)]
  read = np.concatenate([i[~p] for i, p in chunks])
  np.testing.assert_array_equal(read, full.indices[:total])  # all, in order, once
  assert bool(np.all(chunks[-1][1]))  # the chunk after the last is empty


def test_sum_over_chunks_counts_every_record_with_probability_q():
  """Exact Poisson sampling even when the buffer is as small as B (bypassing the config check).

  N = 1000, B = capacity = 64 (q = 0.064): a draw exceeds the buffer in ~46 % of the steps.
  The old buffer kept the lowest indices, so the last 100 records were included with
  p = 0.041 instead of 0.064; every record must be counted with probability q.
  """
  n, b, draws = 1000, 64, 2000
  q = b / n
  valid = np.ones((n,), bool)

  def inclusion(key):
    batch = privacy.poisson_sample(key, valid, q, b)

    def chunk_sum(indices, is_padding):
      return jnp.zeros((n,), jnp.float32).at[indices].add(jnp.logical_not(is_padding))

    return privacy.sum_over_chunks(chunk_sum, batch), batch.extra_chunks, batch.chosen

  counts, extra, chosen = jax.jit(jax.vmap(inclusion))(
    jax.random.split(jax.random.PRNGKey(0), draws)
  )
  counts, extra = np.asarray(counts), np.asarray(extra)
  np.testing.assert_array_equal(counts, np.asarray(chosen, np.float32))  # each exactly once
  assert 0.35 < np.mean(extra > 0) < 0.6  # overflow is frequent: the loop really ran
  stderr = math.sqrt(q * (1 - q) / (100 * draws))  # 0.00055
  for block in (slice(0, 100), slice(450, 550), slice(900, 1000)):
    assert abs(counts[:, block].mean() - q) < 5 * stderr, (block, counts[:, block].mean())


@pytest.mark.parametrize("dp", [False, True], ids=["real_gradient_sum", "clipped_sum"])
def test_chunked_gradient_sums_equal_one_pass(dp, linear_apply_fn, linear_params, client_parts):
  """The sums over 4 chunks of 40 slots equal one pass over a buffer holding the whole draw."""
  apply_fn, params = linear_apply_fn, linear_params
  x, y = client_parts[0]
  x, y = jnp.asarray(x), jnp.asarray(y)
  valid = np.ones(len(y), bool)

  def gradient_sum(capacity):
    batch = privacy.poisson_sample(jax.random.PRNGKey(2), valid, 0.5, capacity)

    def chunk_sum(indices, is_padding):
      if dp:
        return privacy.clipped_gradient_sum(
          apply_fn, params, x[indices], y[indices], is_padding, l2_clip_norm=0.5
        )[0]
      return privacy.real_gradient_sum(apply_fn, params, x[indices], y[indices], is_padding)

    return privacy.sum_over_chunks(chunk_sum, batch), batch

  (chunked, small), (whole, big) = (
    jax.jit(gradient_sum, static_argnums=0)(c) for c in (40, len(y))
  )
  assert int(big.extra_chunks) == 0 and int(small.extra_chunks) >= 3
  assert int(small.size) == int(big.size) > 120
  chex.assert_trees_all_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_capacity_that_overflows_often_is_refused():
  assert privacy.min_poisson_capacity(64) == 88  # 64 + 3 * 8
  privacy.check_poisson_capacity(None, 64)
  privacy.check_poisson_capacity(88, 64)
  for bad in (64, 87):
    with raises_field("poisson_capacity"):
      privacy.check_poisson_capacity(bad, 64)


# ---------------------------------------------------------------- losses and gradients


def test_eager_matches_jit(batch, linear_apply_fn, linear_params):
  """Every gradient primitive, eager and jitted: same shapes, dtypes and values."""
  x, y, is_padding = batch
  apply_fn, params = linear_apply_fn, linear_params
  calls = {
    "cross_entropy": (privacy.cross_entropy, (apply_fn(params, x), y), {}),
    "masked_mean_loss": (
      functools.partial(privacy.masked_mean_loss, apply_fn),
      (params, x, y, (~is_padding).astype(jnp.float32)),
      {},
    ),
    "real_gradient": (
      functools.partial(privacy.real_gradient, apply_fn),
      (params, x, y, is_padding),
      {},
    ),
    "per_example_gradients": (
      functools.partial(privacy.per_example_gradients, apply_fn),
      (params, x, y),
      {},
    ),
    "clipped_gradient_sum": (
      functools.partial(privacy.clipped_gradient_sum, apply_fn, l2_clip_norm=1.0),
      (params, x, y, is_padding),
      {},
    ),
    "poisson_gradient": (
      functools.partial(
        privacy.poisson_gradient,
        privacy.PoissonGradient(batch_size=5, capacity=8, l2_clip_norm=1.0, noise_multiplier=1.0),
        apply_fn=apply_fn,
      ),
      (jax.random.PRNGKey(0),),
      dict(params=params, data=ClientData(x, y, ~is_padding)),
    ),
    "add_gaussian_noise": (privacy.add_gaussian_noise, (jax.random.PRNGKey(0), params, 2.0), {}),
  }
  expected = {
    "cross_entropy": jax.ShapeDtypeStruct((8,), jnp.float32),
    "masked_mean_loss": jax.ShapeDtypeStruct((), jnp.float32),
    "real_gradient": params,
    "per_example_gradients": jax.tree.map(
      lambda p: jax.ShapeDtypeStruct((8, *p.shape), p.dtype), params
    ),
    "clipped_gradient_sum": (params, jax.ShapeDtypeStruct((8,), jnp.float32)),
    "poisson_gradient": privacy.BatchGradient(
      params,
      jax.ShapeDtypeStruct((2,), jnp.uint32),
      None,
      jax.ShapeDtypeStruct((), jnp.int32),
      jax.ShapeDtypeStruct((), jnp.int32),
      jax.ShapeDtypeStruct((), jnp.float32),
    ),
    "add_gaussian_noise": params,
  }
  for name, (fn, args, kwargs) in calls.items():
    eager = fn(*args, **kwargs)
    jitted = jax.jit(fn)(*args, **kwargs)
    chex.assert_trees_all_equal_shapes_and_dtypes(eager, expected[name], custom_message=name)
    chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5, custom_message=name)
    chex.assert_tree_all_finite(eager)


def test_losses(tiny_apply_fn, tiny_params, batch):
  x, y, is_padding = batch
  logits = jax.jit(tiny_apply_fn)(tiny_params, x)
  losses, optax_losses = host(
    jax.jit(
      lambda z, t: (
        privacy.cross_entropy(z, t),
        optax.softmax_cross_entropy(z, jax.nn.one_hot(t, 10)),
      )
    )(logits, y)
  )
  chex.assert_trees_all_close(losses, optax_losses, atol=1e-5)
  weights = (~np.asarray(is_padding)).astype(np.float32)
  mml = jax.jit(privacy.masked_mean_loss, static_argnums=0)
  chex.assert_trees_all_close(
    mml(tiny_apply_fn, tiny_params, x, y, weights), np.mean(losses[:5]), atol=1e-5
  )
  chex.assert_trees_all_close(mml(tiny_apply_fn, tiny_params, x, y), np.mean(losses), atol=1e-5)


def test_real_gradient_ignores_padding(tiny_apply_fn, tiny_params, batch):
  x, y, is_padding = batch
  g = jax.jit(privacy.real_gradient, static_argnums=0)(tiny_apply_fn, tiny_params, x, y, is_padding)
  chex.assert_trees_all_equal_shapes_and_dtypes(g, tiny_params)
  x, y = np.asarray(x), np.asarray(y)  # slices on the host compile nothing
  ref = _mean_grad(tiny_apply_fn, tiny_params, x[:5], y[:5])
  chex.assert_trees_all_close(g, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("microbatch", [3, 4, "auto"])
def test_real_gradient_in_chunks_equals_one_pass(microbatch, tiny_apply_fn, tiny_params, digits):
  """Chunks (up to the last one holding a real example) give the one-pass gradient."""
  x, y = digits.x_train[:70], digits.y_train[:70]
  # Padding in the middle, real examples up to slot 60, an all-padding tail.
  is_padding = (np.arange(70) >= 61) | ((np.arange(70) % 7) == 3)
  fn = _real_gradient
  one_pass = fn(tiny_apply_fn, tiny_params, x, y, is_padding)
  chunked = fn(tiny_apply_fn, tiny_params, x, y, is_padding, microbatch_size=microbatch)
  chex.assert_trees_all_close(chunked, one_pass, atol=1e-6, rtol=1e-5)
  g, loss = jax.jit(
    privacy.real_gradient_and_loss, static_argnums=0, static_argnames="microbatch_size"
  )(tiny_apply_fn, tiny_params, x, y, is_padding, microbatch_size=microbatch)
  chex.assert_trees_all_close(g, one_pass, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(
    loss,
    _masked_mean_loss(tiny_apply_fn, tiny_params, x, y, (~is_padding).astype(np.float32)),
    atol=1e-6,
  )
  ref = _mean_grad(tiny_apply_fn, tiny_params, x[~is_padding], y[~is_padding])
  chex.assert_trees_all_close(chunked, ref, atol=1e-5, rtol=1e-4)
  # All padding: a zero gradient, not NaN.
  zero = fn(tiny_apply_fn, tiny_params, x, y, np.ones(70, bool), microbatch_size=microbatch)
  chex.assert_trees_all_equal(zero, jax.tree.map(np.zeros_like, host(tiny_params)))


_real_gradient = jax.jit(privacy.real_gradient, static_argnums=0, static_argnames="microbatch_size")
_masked_mean_loss = jax.jit(privacy.masked_mean_loss, static_argnums=0)


def test_real_gradient_auto_chunks_only_matmul_convolutions_on_cpu(digits):
  """``"auto"``: chunks of 64 for the CPU ConvNet (matmul convolutions), one pass for nn.Conv."""
  from fedlap_jax import models, per_example  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(digits.x_train[:70])
  plans = {}
  for impl in ("hybrid", "flax"):
    model = models.ConvNet(num_classes=10, width=8, depth=1, impl=impl)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), digits.x_train[:1])["params"]
    plans[impl] = per_example.auto_plan(lambda p, z: model.apply({"params": p}, z), params, x)
  assert plans["flax"][1] is None
  if jax.default_backend() == "cpu":
    assert plans["hybrid"] == ("vmap", per_example.CPU_MICROBATCH)


@functools.partial(jax.jit, static_argnums=0)
def _mean_grad(apply_fn, params, x, y):
  return jax.grad(lambda p: jnp.mean(privacy.cross_entropy(apply_fn(p, x), y)))(params)


def test_per_example_gradients_equal_one_example_batches(tiny_apply_fn, tiny_params, batch):
  x, y, _ = batch
  per_ex = jax.jit(privacy.per_example_gradients, static_argnums=0)(
    tiny_apply_fn, tiny_params, x, y
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(
    per_ex, jax.tree.map(lambda p: jax.ShapeDtypeStruct((8, *p.shape), p.dtype), tiny_params)
  )
  x, y, per_ex = np.asarray(x), np.asarray(y), host(per_ex)  # slices on the host
  for i in range(8):
    ref = _mean_grad(tiny_apply_fn, tiny_params, x[i : i + 1], y[i : i + 1])
    chex.assert_trees_all_close(jax.tree.map(lambda g: g[i], per_ex), ref, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def clipped_sum_fn(tiny_apply_fn):
  return jax.jit(
    functools.partial(privacy.clipped_gradient_sum, tiny_apply_fn),
    static_argnames=("l2_clip_norm", "microbatch_size"),
  )


def test_clipped_gradient_sum(tiny_apply_fn, tiny_params, batch, clipped_sum_fn):
  x, y, is_padding = batch
  total, norms = clipped_sum_fn(tiny_params, x, y, is_padding, l2_clip_norm=CLIP)
  chex.assert_trees_all_equal_shapes_and_dtypes(total, tiny_params)
  chex.assert_shape(norms, (8,))
  # Norms are those of vmap(grad); the sum is sum_i g_i min(1, C / |g_i|) over real examples.
  per_ex = host(
    jax.jit(privacy.per_example_gradients, static_argnums=0)(tiny_apply_fn, tiny_params, x, y)
  )
  norms, ref_norms = np.asarray(norms), global_norms(per_ex)
  chex.assert_trees_all_close(norms[:5], ref_norms[:5], rtol=1e-4)
  assert bool(np.any(ref_norms[:5] > CLIP)) and bool(np.any(ref_norms[:5] < CLIP)), (
    "pick CLIP so that some examples are clipped and some are not",
    ref_norms,
  )
  factor = np.minimum(1.0, CLIP / ref_norms) * (~np.asarray(is_padding))
  ref = jax.tree.map(lambda g: np.tensordot(factor, g, axes=1), per_ex)
  chex.assert_trees_all_close(total, ref, atol=1e-5, rtol=1e-4)


def test_clipping_bound_and_padding(tiny_params, batch, clipped_sum_fn):
  x, y, is_padding = batch
  # One-example batches: the clipped gradient of every example has norm <= C, up to float32
  # rounding of the norm (a few ulps: 6.400001 for C = 6.4 with jax 0.10.0's XLA).
  one = jax.vmap(
    lambda xi, yi: clipped_sum_fn(
      tiny_params, xi[None], yi[None], jnp.zeros((1,), bool), l2_clip_norm=CLIP
    )
  )
  clipped, norms = host(one(x, y))
  clipped_norms = global_norms(clipped)
  assert float(np.max(clipped_norms)) <= CLIP * (1 + 1e-6)
  big = norms[:, 0] > CLIP
  chex.assert_trees_all_close(clipped_norms[big], np.full((int(big.sum()),), CLIP), rtol=1e-4)
  # Padding examples contribute exactly zero, whatever their content.
  with_pad, _ = clipped_sum_fn(tiny_params, x, y, is_padding, l2_clip_norm=CLIP)
  garbage = np.array(x)
  garbage[5:] = 100.0
  with_garbage, _ = clipped_sum_fn(tiny_params, garbage, y, is_padding, l2_clip_norm=CLIP)
  chex.assert_trees_all_close(with_pad, with_garbage, atol=1e-6)
  all_pad, _ = clipped_sum_fn(tiny_params, x, y, np.ones((8,), bool), l2_clip_norm=CLIP)
  assert all(bool(np.all(np.asarray(leaf) == 0)) for leaf in jax.tree.leaves(all_pad))


# ---------------------------------------------------------------- the Gaussian mechanism


def test_noise_is_added():
  tree = {"a": np.zeros((3, 4), np.float32), "b": np.ones((5,), np.float32)}
  noise = jax.jit(privacy.add_gaussian_noise)
  noisy = host(noise(jax.random.PRNGKey(0), tree, 2.0))
  other = host(noise(jax.random.PRNGKey(1), tree, 2.0))
  assert not bool(np.allclose(noisy["a"], 0.0))
  assert not bool(np.allclose(noisy["a"], other["a"]))
  assert not bool(np.allclose(noisy["a"][0], noisy["a"][1]))  # independent across scalars


@pytest.mark.parametrize(
  "call, field, value",
  [
    (lambda k, t: privacy.poisson_sample(k, np.ones(10, bool), 1.5, 8), "rate", 1.5),
    (lambda k, t: privacy.poisson_sample(k, np.ones(10, bool), 0.5, 0), "capacity", 0),
    (lambda k, t: privacy.privatise(k, t, **_dp(l2_clip_norm=0.0)), "l2_clip_norm", 0.0),
    (lambda k, t: privacy.privatise(k, t, **_dp(noise_multiplier=-1.0)), "noise_multiplier", -1.0),
    (lambda k, t: privacy.privatise(k, t, **_dp(expected_batch_size=0)), "expected_batch_size", 0),
  ],
)
def test_primitives_refuse_dp_numbers_outside_their_range(call, field, value):
  """A number is checked when traced; sigma 0 (clipping only) and traced values pass."""
  key, tree = jax.random.PRNGKey(0), {"w": np.ones(3, np.float32)}
  with pytest.raises(privacy.ConfigError) as err:
    call(key, tree)
  assert (err.value.field, err.value.value) == (field, value)
  chex.assert_trees_all_close(privacy.privatise(key, tree, **_dp(noise_multiplier=0.0)), tree)
  traced = jax.jit(
    lambda b, q: (
      privacy.privatise(key, tree, **_dp(expected_batch_size=b)),
      privacy.poisson_sample(key, np.ones(10, bool), q, 8).size,
    )
  )
  noisy, size = traced(1.0, 1.0)
  assert int(size) == 10 and noisy["w"].shape == (3,)


def _dp(**changes):
  return {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 1.0, **changes}


@pytest.mark.parametrize("sigma, clip, expected_batch", [(1.0, 1.0, 64.0), (0.7, 0.1, 5.0)])
def test_noise_std_and_mean(linear_apply_fn, linear_params, batch, sigma, clip, expected_batch):
  """Over many keys: mean = clipped sum / B, std = sigma * C / B (within 2%)."""
  x, y, is_padding = batch
  draws = 200
  samples = _noisy_gradients(
    linear_apply_fn,
    linear_params,
    x,
    y,
    is_padding,
    jax.random.split(jax.random.PRNGKey(1), draws),
    clip,
    sigma,
    expected_batch,
  )
  exact, _ = _clipped_sum(linear_apply_fn, linear_params, x, y, is_padding, l2_clip_norm=clip)
  deviations = np.concatenate(
    [
      (s - e / np.float32(expected_batch)).reshape(-1)
      for s, e in zip(jax.tree.leaves(host(samples)), jax.tree.leaves(host(exact)))
    ]
  )
  target = sigma * clip / expected_batch
  assert deviations.size >= 100_000
  std = float(np.std(deviations))
  assert abs(std / target - 1) < 0.02, (std, target)
  assert abs(float(np.mean(deviations))) < 5 * target / math.sqrt(deviations.size)


_clipped_sum = jax.jit(privacy.clipped_gradient_sum, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _noisy_gradients(apply_fn, params, x, y, is_padding, keys, clip, sigma, expected_batch):
  """``(draws, ...)`` private gradients of one batch; clip, sigma and B are traced."""

  clipped, _ = privacy.clipped_gradient_sum(apply_fn, params, x, y, is_padding, l2_clip_norm=clip)

  def one(k):
    return privacy.privatise(
      k, clipped, l2_clip_norm=clip, noise_multiplier=sigma, expected_batch_size=expected_batch
    )

  return jax.vmap(one)(keys)


@functools.cache
def _counting_impl():
  """A PRNG whose bits are ``start, start + 1, ...`` from a key holding ``start``
  (jax.extend.random's public PRNG interface); one for the file, so that the sampler jitted on
  its keys compiles once."""
  from jax.extend import random as jex_random

  return jex_random.define_prng_impl(
    key_shape=(1,),
    seed=lambda s: jnp.reshape(jnp.asarray(s, jnp.uint32), (1,)),
    split=lambda k, shape: jnp.broadcast_to(k, (*shape, 1)),
    fold_in=lambda k, d: k,
    random_bits=lambda k, width, shape: (
      k[0] + jnp.arange(int(np.prod(shape)), dtype=jnp.uint32)
    ).reshape(shape),
    name="counting",
  )


def _counting_key(start: int) -> jax.Array:
  """A key whose bits are ``start, start + 1, ...``: every bit pattern around a threshold, in
  order."""
  return jax.random.wrap_key_data(np.array([start], np.uint32), impl=_counting_impl())


@pytest.mark.parametrize("batch, records", [(46, 274), (256, 10_000), (3, 10), (64, 128), (1, 3)])
def test_poisson_inclusion_probability_is_never_above_the_accounted_rate(batch, records):
  """Over every 32-bit pattern near the threshold: a record is included iff its bits lie below
  one integer t, and t / 2^32 <= B / N_k exactly, within 2^-22 of it (a27beca's
  uniform(float32) < rate included with probability ceil(rate 2^23) / 2^23, up to 2^-23
  above B / N_k)."""
  from fractions import Fraction

  rate = batch / np.float32(records)  # as the clients compute it: float32 division
  exact = Fraction(batch, records)
  start = int(exact * 2**32) - 2048
  valid = np.ones(4096, bool)
  chosen = np.asarray(_sample(_counting_key(start), valid, rate, 8).chosen)
  assert chosen[0] and not chosen[-1]
  t = start + int(np.argmin(chosen))  # the first pattern left out
  assert not chosen[t - start :].any()  # one threshold: everything below it, nothing above
  assert exact - Fraction(2, 2**23) <= Fraction(t, 2**32) <= exact
  everyone = _sample(_counting_key(2**32 - 4096), valid, np.float32(1.0), 8)
  assert bool(np.all(np.asarray(everyone.chosen)))


# ---------------------------------------------------------------- the one DP gradient


def _query(**changes):
  return privacy.PoissonGradient(**{"batch_size": 40, "capacity": 60, **changes})


@pytest.mark.parametrize(
  "changes, field",
  [
    (dict(noise_multiplier=1.0), "noise_multiplier"),  # noise without clipping
    (dict(l2_clip_norm=0.0), "l2_clip_norm"),
    (dict(l2_clip_norm=1.0, gradient_mean="realized"), "gradient_mean"),  # would leak |batch|
    (dict(per_example_method="fast"), "per_example_method"),
    (dict(capacity=0), "capacity"),
    (dict(microbatch_size=0), "microbatch_size"),
    (dict(dsa_strategy="blur"), "dsa_strategy"),
  ],
)
def test_the_gradient_query_refuses_what_it_cannot_honour(changes, field):
  with pytest.raises(privacy.ConfigError) as err:
    _query(**changes)
  assert err.value.field == field


def test_the_gradient_query_carries_its_sensitivity_and_declares_its_mechanism():
  q = _query(l2_clip_norm=0.5, noise_multiplier=1.2)
  assert q.private and q.mean_by == "expected"
  assert q.l2_sensitivity == 0.5 and q.noise_stddev == pytest.approx(0.6)
  m = q.mechanism(steps_per_round=7, delta=1e-5)
  assert (m.noise_multiplier, m.batch_size, m.steps_per_round, m.delta) == (1.2, 40, 7, 1e-5)
  dp = privacy.PoissonGradient.of(
    DPConfig(noise_multiplier=1.2, l2_clip_norm=0.5, delta=1e-5, per_example_method="vmap"),
    batch_size=40,
    capacity=60,
  )
  assert (dp.l2_clip_norm, dp.noise_multiplier, dp.per_example_method) == (0.5, 1.2, "vmap")
  plain = _query()
  assert not plain.private and plain.mean_by == "realized" and plain.noise_stddev is None
  for no_guarantee in (plain, _query(l2_clip_norm=0.5)):  # no noise: nothing to account for
    with pytest.raises(privacy.ConfigError):
      no_guarantee.mechanism(steps_per_round=7, delta=1e-5)


def test_poisson_gradient_is_algorithm_3_on_the_whole_draw(
  linear_apply_fn, linear_params, client_parts
):
  """At q = 1 every record is drawn: the gradient is the clipped sum over all of them (read in
  chunks of the buffer), noised with ``split(key, 3)[2]`` and divided by B; non-private, the
  mean over the records drawn, or the sum over B."""
  x, y = client_parts[0]
  n = len(y)
  data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(np.ones(n, bool)))
  key = jax.random.PRNGKey(5)
  no_padding = np.zeros(n, bool)
  clipped, norms = _clipped_sum(
    linear_apply_fn, linear_params, data.x, data.y, no_padding, l2_clip_norm=0.5
  )
  dp = privacy.PoissonGradient(
    batch_size=n, capacity=40, l2_clip_norm=0.5, noise_multiplier=1.0, track_loss=True
  )
  gradient = jax.jit(privacy.poisson_gradient, static_argnums=(0, 2))
  out = gradient(dp, key, linear_apply_fn, linear_params, data)
  expected = jax.jit(
    lambda k, g: privacy.privatise(
      jax.random.split(k, 3)[2], g, l2_clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=n
    )
  )(key, clipped)
  chex.assert_trees_all_close(out.gradient, expected, atol=1e-6, rtol=1e-5)
  assert int(out.batch_size) == n and int(out.extra_chunks) == math.ceil(n / 40) - 1 > 0
  assert float(out.clipped) == float(np.sum(np.asarray(norms) > 0.5))
  losses = jax.jit(lambda p, z, t: privacy.cross_entropy(linear_apply_fn(p, z), t))(
    linear_params, data.x, data.y
  )
  np.testing.assert_allclose(float(out.loss_sum), float(np.sum(np.asarray(losses))), rtol=1e-5)
  full = _real_gradient(linear_apply_fn, linear_params, data.x, data.y, no_padding)
  everyone = gradient(_q1(n), key, linear_apply_fn, linear_params, data)
  chex.assert_trees_all_close(everyone.gradient, full, atol=1e-6, rtol=1e-5)
  assert everyone.loss_sum is None and float(everyone.clipped) == 0.0
  # q = 1/2: the same draw, its summed gradient over the records drawn or over B.
  half = n // 2
  realized, expected = (
    gradient(
      privacy.PoissonGradient(batch_size=half, capacity=40, gradient_mean=mean),
      key,
      linear_apply_fn,
      linear_params,
      data,
    )
    for mean in ("realized", "expected")
  )
  size = int(realized.batch_size)
  assert 0 < size < n and int(expected.batch_size) == size
  chex.assert_trees_all_close(
    jax.tree.map(lambda g: np.asarray(g) * half, expected.gradient),
    jax.tree.map(lambda g: np.asarray(g) * size, realized.gradient),
    atol=1e-5,
    rtol=1e-5,
  )


def _q1(n):
  return privacy.PoissonGradient(batch_size=n, capacity=40)


def test_poisson_gradient_keys_are_the_callers_derivation(linear_apply_fn, linear_params, batch):
  """``k_sample, k_aug, k_noise = split(key, 3)``; the family key's draw is
  ``split(family_key, 3)[1]``: the derivation the callers used, so their numbers stay."""
  x, y, is_padding = batch
  data = ClientData(x, y, ~is_padding)
  key, family = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
  q = privacy.PoissonGradient(batch_size=3, capacity=8, l2_clip_norm=1.0, noise_multiplier=1.0)
  out = privacy.poisson_gradient(q, key, linear_apply_fn, linear_params, data, family_key=family)
  k_sample, k_aug, _ = jax.random.split(key, 3)
  np.testing.assert_array_equal(out.aug_key, k_aug)
  np.testing.assert_array_equal(out.family_key, jax.random.split(family, 3)[1])
  drawn = privacy.poisson_sample(k_sample, data.mask, 3 / jnp.sum(data.mask), 8)
  assert int(out.batch_size) == int(drawn.size)
  assert privacy.poisson_gradient(q, key, linear_apply_fn, linear_params, data).family_key is None
