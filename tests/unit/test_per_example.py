"""Exactness of the fast per-example clipping (fedlap_jax.per_example) and the ConvNet impls.

The reference everywhere is ``vmap(grad)`` (``privacy.per_example_gradients``)
followed by clipping written out here, so a bug shared by the implementations
under test cannot hide.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import models, per_example, privacy
from fedlap_jax import dp_config
from conftest import raises_field

RTOL = 1e-5


class MLP(nn.Module):
  """Dense layers with a LayerNorm (generic rule) in between."""

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    x = nn.LayerNorm()(nn.tanh(nn.Dense(16)(x)))
    return nn.Dense(10)(x)


@functools.lru_cache(maxsize=None)
def _model(kind):
  """``(apply_fn, params)``, one per kind for the whole file: the tests share their programs."""
  if kind == "mlp":
    model = MLP()
  else:
    model = models.ConvNet(num_classes=10, width=8, depth=2, impl=kind)
  params = jax.jit(models.init_fn(model, (12, 12, 3)))(jax.random.PRNGKey(0))
  return (lambda p, x: model.apply({"params": p}, x)), params


def _batch(n=12, real=9):
  """Images, labels and the padding mask, NumPy (built without compiling anything: JAX compiles
  every operation it runs outside ``jit`` on a new shape as a program of its own)."""
  rng = np.random.default_rng(1)
  x = 2.0 * rng.standard_normal((n, 12, 12, 3), np.float32)
  y = rng.integers(0, 10, (n,), np.int32)
  return x, y, np.arange(n) >= real


# vmap(grad) under jit: one program per model for every reference in the file.
_per_example_gradients = jax.jit(privacy.per_example_gradients, static_argnums=0)


def _reference(apply_fn, params, x, y, is_padding, clip):
  """vmap(grad), then ``sum_i min(1, C / |g_i|) g_i`` over real examples (float64 sums)."""
  per_ex = _per_example_gradients(apply_fn, params, x, y)
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(per_ex)]
  norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in leaves))
  factor = np.minimum(1.0, clip / norms) * ~np.asarray(is_padding)
  total = [np.tensordot(factor, g, axes=1) for g in leaves]
  return jax.tree.unflatten(jax.tree.structure(params), total), norms


def _assert_close(actual, expected):
  """Relative to the largest entry of the whole pytree (some leaves are ~0 by symmetry)."""
  scale = max(float(np.max(np.abs(e))) for e in jax.tree.leaves(expected))
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    chex.assert_shape(a, e.shape)
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=RTOL, atol=RTOL * scale)


@pytest.mark.parametrize("kind", ["flax", "im2col", "hybrid", "mlp"])
def test_layerwise_equals_vmap_grad(kind):
  apply_fn, params = _model(kind)
  x, y, is_padding = _batch()
  calls = per_example.discover(apply_fn, params, x)
  rules = {c.rule for c in calls}
  assert "dense" in rules and ("conv" in rules or kind == "mlp") and "generic" in rules

  fn = jax.jit(
    functools.partial(per_example.clipped_gradient_sum, apply_fn),
    static_argnames=("microbatch_size",),
  )
  for clip in (0.1, 1e3):  # everyone clipped / no one clipped
    ref, ref_norms = _reference(apply_fn, params, x, y, is_padding, clip)
    total, norms = fn(params, x, y, is_padding, l2_clip_norm=clip)
    _assert_close(total, ref)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
  # Microbatches (12 = 3 + 3 + 3 + 3) give the same sum and norms; with the real
  # examples first, the all-padding last chunk is skipped (norms reported 0).
  total_mb, norms_mb = fn(params, x, y, is_padding, l2_clip_norm=0.1, microbatch_size=3)
  ref, ref_norms = _reference(apply_fn, params, x, y, is_padding, 0.1)
  _assert_close(total_mb, ref)
  np.testing.assert_allclose(norms_mb[:9], ref_norms[:9], rtol=RTOL)
  np.testing.assert_array_equal(norms_mb[9:], 0.0)
  # Padding in the middle and an uneven split (12 = 5 + 5 + 2 padded).
  middle = np.arange(12) % 3 == 1
  total_mb, norms_mb = fn(params, x, y, middle, l2_clip_norm=0.1, microbatch_size=5)
  ref, ref_norms = _reference(apply_fn, params, x, y, middle, 0.1)
  _assert_close(total_mb, ref)
  np.testing.assert_allclose(norms_mb, ref_norms, rtol=RTOL)


def test_ghost_conv_norms_exact(monkeypatch):
  """Conv layers with ghost norms (forced on) and without give the reference result."""
  apply_fn, params = _model("im2col")
  x, y, is_padding = _batch()
  ref, ref_norms = _reference(apply_fn, params, x, y, is_padding, 0.5)
  for ghost in (True, False):
    monkeypatch.setattr(per_example, "GHOST_CONV", ghost)  # read when the call is traced
    fn = jax.jit(functools.partial(per_example.clipped_gradient_sum, apply_fn, l2_clip_norm=0.5))
    total, norms = fn(params, x, y, is_padding)
    _assert_close(total, ref)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)


def test_padding_contributes_exactly_zero():
  apply_fn, params = _model("hybrid")
  x, y, is_padding = _batch()
  fn = jax.jit(functools.partial(per_example.clipped_gradient_sum, apply_fn, l2_clip_norm=1.0))
  clean, _ = fn(params, x, y, is_padding)
  nan_padding = x.copy()
  nan_padding[9:] = np.nan
  garbage, _ = fn(params, nan_padding, y, is_padding)
  chex.assert_trees_all_equal(clean, garbage)
  nothing, _ = fn(params, x, y, np.ones_like(is_padding))
  assert all(bool(np.all(np.asarray(leaf) == 0)) for leaf in jax.tree.leaves(nothing))


def test_unsupported_models_fall_back_to_vmap():
  apply_fn, params = _model("mlp")
  x, y, is_padding = _batch()
  uses_outside = lambda p, x: apply_fn(p, x) * p["Dense_1"]["bias"][0]  # noqa: E731
  transformed = lambda p, x: apply_fn(jax.tree.map(lambda a: 2.0 * a, p), x)  # noqa: E731
  plain = lambda p, x: x.reshape(len(x), -1) @ p  # noqa: E731
  w = np.full((432, 10), 0.01, np.float32)
  for fn, p in ((uses_outside, params), (transformed, params), (plain, w)):
    assert per_example.auto_plan(fn, p, x) == ("vmap", None)
    with pytest.raises(per_example.Unsupported):
      per_example.clipped_gradient_sum(fn, p, x, y, is_padding, l2_clip_norm=1.0)
    private = jax.jit(functools.partial(privacy.clipped_gradient_sum, fn, l2_clip_norm=1.0))
    total, norms = private(p, x, y, is_padding)
    ref, ref_norms = _reference(fn, p, x, y, is_padding, 1.0)
    _assert_close(total, ref)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)


def test_auto_prefers_layerwise_only_where_it_pays():
  x, _, _ = _batch()
  expected = {"flax": "layerwise", "mlp": "layerwise", "im2col": "vmap", "hybrid": "vmap"}
  for kind, method in expected.items():
    apply_fn, params = _model(kind)
    assert per_example.auto_plan(apply_fn, params, x)[0] == method, kind
  plain = lambda p, x: x.reshape(len(x), -1) @ p  # noqa: E731
  assert per_example.auto_plan(plain, np.ones((432, 10), np.float32), x)[0] == "vmap"


def test_auto_microbatches_only_matmul_conv_models_on_cpu():
  # Microbatches paid off only for matmul convolutions on CPU; they slowed the
  # layer-wise path and vmap with XLA's convolution, so those keep one pass.
  m = per_example.CPU_MICROBATCH
  big = np.zeros((m + 1, *_batch()[0].shape[1:]), np.float32)
  small = big[:m]
  on_cpu = jax.default_backend() == "cpu"
  for kind in ("im2col", "hybrid"):
    apply_fn, params = _model(kind)
    assert per_example.auto_plan(apply_fn, params, big) == (
      "vmap",
      per_example.CPU_MICROBATCH if on_cpu else None,
    ), kind
    assert per_example.auto_plan(apply_fn, params, small) == ("vmap", None), kind
  for kind in ("flax", "mlp"):
    apply_fn, params = _model(kind)
    assert per_example.auto_plan(apply_fn, params, big) == ("layerwise", None), kind
  plain = lambda p, x: x.reshape(len(x), -1) @ p  # noqa: E731
  assert per_example.auto_plan(plain, np.ones((432, 10), np.float32), big) == ("vmap", None)


@pytest.mark.parametrize("method", ["auto", "layerwise", "vmap", "jax_privacy"])
def test_privacy_methods_agree(method):
  apply_fn, params = _model("hybrid")
  x, y, is_padding = _batch()
  ref, ref_norms = _reference(apply_fn, params, x, y, is_padding, 0.3)
  total, norms = jax.jit(
    functools.partial(privacy.clipped_gradient_sum, apply_fn, l2_clip_norm=0.3, method=method)
  )(params, x, y, is_padding)
  _assert_close(total, ref)
  np.testing.assert_allclose(norms[:9], ref_norms[:9], rtol=RTOL)


def test_bad_method_names():
  apply_fn, params = _model("mlp")
  x, y, is_padding = _batch()
  with raises_field("method"):
    privacy.clipped_gradient_sum(
      apply_fn, params, x, y, is_padding, l2_clip_norm=1.0, method="ghost"
    )
  with raises_field("dp.per_example_method"):
    dp_config.DPConfig(
      noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5, per_example_method="fast"
    )


# ----------------------------------------------------------------- ConvNet implementations


def test_instance_norm_equals_group_norm():
  rng = np.random.default_rng(0)
  x = 3.0 + rng.standard_normal((4, 6, 6, 5), np.float32)
  gn = nn.GroupNorm(num_groups=5, epsilon=1e-5)
  p = jax.jit(gn.init)(jax.random.PRNGKey(1), x)
  p = jax.tree.map(lambda a: np.asarray(a) + rng.standard_normal(a.shape, np.float32), p)
  ours = models.InstanceNorm(epsilon=1e-5)
  chex.assert_trees_all_equal_structs(jax.jit(ours.init)(jax.random.PRNGKey(1), x), p)
  chex.assert_trees_all_close(
    jax.jit(ours.apply)(p, x), jax.jit(gn.apply)(p, x), atol=1e-5, rtol=1e-5
  )


@pytest.mark.parametrize(
  "padding, shape", [(((1, 1), (1, 1)), (3, 7, 6, 4)), (((0, 2), (1, 0)), (2, 5, 5, 3))]
)
def test_conv_impls_equal_xla_conv_to_second_order(padding, shape):
  """Value, gradient and gradient-of-gradient of both matmul convolutions."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal(shape, np.float32)
  k = rng.standard_normal((3, 3, shape[-1], 5), np.float32)
  dn = ("NHWC", "HWIO", "NHWC")

  def value(conv, x, k):
    return conv(x, k, (1, 1), padding, dimension_numbers=dn)

  def second(conv, x, k):  # d/dx of |d conv / dk|^2, like the synthetic-image update
    g = jax.grad(lambda k: jnp.sum(jnp.sin(value(conv, x, k))))(k)
    return jnp.sum(g**2)

  for conv in (models.conv_im2col, models.conv_hybrid):
    for f in (value, lambda c, x, k: jax.grad(second, argnums=(1, 2))(c, x, k)):
      f = jax.jit(f, static_argnums=0)
      expected = jax.tree.map(
        lambda a: np.asarray(a, np.float64), f(jax.lax.conv_general_dilated, x, k)
      )
      _assert_close(f(conv, x, k), expected)


def test_convnet_impls_same_function_and_params():
  x = np.random.default_rng(0).standard_normal((3, 28, 28, 1), np.float32)
  outs, trees = [], []
  for impl in ("flax", "im2col", "hybrid", "auto"):
    model = models.ConvNet(num_classes=10, width=8, depth=3, impl=impl)
    params = jax.jit(models.init_fn(model, (28, 28, 1)))(jax.random.PRNGKey(1))
    trees.append(params)
    outs.append(jax.jit(model.apply)({"params": params}, x))
  for tree, out in zip(trees[1:], outs[1:]):
    chex.assert_trees_all_close(tree, trees[0])  # same names, shapes and initial values
    chex.assert_trees_all_close(out, outs[0], atol=1e-4, rtol=1e-4)
  with raises_field("ConvNet.impl"):
    models.ConvNet(impl="cuda").init(jax.random.PRNGKey(0), x)
