"""Tests for fedlap_jax.matching (the layer-wise gradient-matching distance L_dis)."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import matching
from fedlap_jax.matching import matching_distance
from conftest import raises_field


def random_grads(seed, shapes=None):
  """A gradient-like pytree: a conv kernel, a Dense kernel and their biases (Flax layouts).

  NumPy arrays, float32: built without compiling anything (JAX compiles every operation it runs
  outside ``jit`` on a new shape as a program of its own).
  """
  shapes = shapes or {
    "conv": {"kernel": (3, 3, 2, 4), "bias": (4,)},
    "dense": {"kernel": (6, 3), "bias": (3,)},
  }
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: rng.standard_normal(s, np.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


# The distance under jit, one program per configuration (the eager path is tested on its own).
distance = jax.jit(
  matching_distance, static_argnames=("row_axis", "row_reduction", "include_vectors")
)
layer_distance = jax.jit(matching.layer_distance, static_argnums=2)


# A hand-computed example: a (2, 3) Dense kernel in Flax layout (in=2, out=3), so its rows
# for the distance are its 3 columns, plus a bias of 3 (one row).
HAND_REAL = {
  "kernel": np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], np.float32),
  "bias": np.array([1.0, 0.0, 0.0], np.float32),
}
HAND_SYN = {
  "kernel": np.array([[1.0, 1.0, -1.0], [0.0, 0.0, -1.0]], np.float32),
  "bias": np.array([0.0, 1.0, 0.0], np.float32),
}
# columns: (1,0)/(1,0) cos 1; (0,1)/(1,0) cos 0; (1,1)/(-1,-1) cos -1 -> mean(0, 1, 2) = 1.
# bias: (1,0,0)/(0,1,0) cos 0 -> 1.  Cosine part = 2.
# squared differences: kernel 0+1+4+0+1+4 = 10, bias 1+1+0 = 2 -> 12.
HAND_COSINE = 2.0
HAND_SQ = 12.0


@pytest.mark.parametrize("use_jit", [False, True])
def test_shapes_dtypes_jit_and_eager(use_jit):
  g_real, g_syn = random_grads(0), random_grads(1)
  fn = jax.jit(matching_distance) if use_jit else matching_distance
  d = fn(g_real, g_syn, mse_weight=0.1)
  chex.assert_shape(d, ())
  chex.assert_type(d, jnp.float32)
  chex.assert_trees_all_close(
    d, jax.jit(matching_distance)(g_real, g_syn, mse_weight=0.1), rtol=1e-6
  )
  layer = jax.jit(matching.layer_distance, static_argnums=2) if use_jit else matching.layer_distance
  chex.assert_shape(layer(g_real["conv"]["kernel"], g_syn["conv"]["kernel"], -1), ())
  # Bounds: each layer distance lies in [0, 2]; there are 4 tensors.
  assert 0.0 <= float(matching_distance(g_real, g_syn)) <= 8.0


def test_rows_of():
  chex.assert_shape(matching.rows_of(jnp.zeros((3, 3, 2, 4))), (4, 18))
  chex.assert_shape(matching.rows_of(jnp.zeros((6, 3))), (3, 6))
  chex.assert_shape(matching.rows_of(jnp.zeros((6, 3)), 0), (6, 3))
  chex.assert_shape(matching.rows_of(jnp.zeros((6, 3)), None), (1, 18))
  chex.assert_shape(matching.rows_of(jnp.zeros((5,))), (1, 5))
  chex.assert_shape(matching.rows_of(jnp.zeros(())), (1, 1))
  k = jnp.arange(6.0).reshape(2, 3)  # Flax (in, out): row j is column j
  chex.assert_trees_all_equal(matching.rows_of(k), k.T)


@pytest.mark.parametrize("mse_weight", [0.0, 0.1, 3.0])
def test_zero_for_identical_gradients(mse_weight):
  g = random_grads(0)
  assert abs(float(distance(g, g, mse_weight=mse_weight))) <= 1e-6


def test_hand_computed_value():
  cosine = distance(HAND_REAL, HAND_SYN)
  chex.assert_trees_all_close(cosine, HAND_COSINE, atol=1e-6)
  full = distance(HAND_REAL, HAND_SYN, mse_weight=0.1)
  chex.assert_trees_all_close(full, HAND_COSINE + 0.1 * HAND_SQ, atol=1e-5)
  # The wrong (PyTorch-style) orientation gives a different number: rows (1,0,1)/(1,1,-1)
  # have cos 0, rows (0,1,1)/(0,0,-1) cos -1/sqrt(2); with the bias: 1 + 1/(2 sqrt 2) + 1.
  torch_rows = distance(HAND_REAL, HAND_SYN, row_axis=0)
  chex.assert_trees_all_close(torch_rows, 2.0 + 1.0 / (2.0 * np.sqrt(2.0)), atol=1e-6)


def test_mse_weight_term():
  g_real, g_syn = random_grads(0), random_grads(1)
  sq = sum(np.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(g_real), jax.tree.leaves(g_syn)))
  base = distance(g_real, g_syn)
  for lam in (0.1, 2.5):
    chex.assert_trees_all_close(distance(g_real, g_syn, mse_weight=lam), base + lam * sq, rtol=1e-5)
  # A traced weight works too (one compilation for every lambda).
  traced = jax.jit(lambda lam: matching_distance(g_real, g_syn, mse_weight=lam))
  chex.assert_trees_all_close(traced(0.1), base + 0.1 * sq, rtol=1e-5)


def test_cosine_part_invariant_to_positive_row_scaling():
  g_real, g_syn = random_grads(0), random_grads(1)
  rng = np.random.default_rng(2)

  def scale_rows(g):
    # One positive factor per output unit (last axis); 1-D tensors are one row.
    size = g.shape[-1] if g.ndim >= 2 else ()
    return g * rng.uniform(0.1, 10.0, size).astype(np.float32)

  scaled = jax.tree.map(scale_rows, g_syn)
  chex.assert_trees_all_close(distance(g_real, scaled), distance(g_real, g_syn), atol=1e-5)
  # A negative factor on one row does change it.
  flipped = jax.tree.map(np.copy, g_syn)
  flipped["dense"]["kernel"][:, 0] *= -1.0
  assert abs(float(distance(g_real, flipped) - distance(g_real, g_syn))) > 1e-3


def test_flax_kernel_rows_are_output_units():
  """With real Flax Dense gradients: scaling an output unit's column by 5 leaves L_dis unchanged,
  scaling an input row by 5 changes it."""
  dense = nn.Dense(3)
  x = jax.random.normal(jax.random.PRNGKey(0), (7, 4))
  params = jax.jit(dense.init)(jax.random.PRNGKey(1), x)["params"]
  chex.assert_shape(params["kernel"], (4, 3))  # Flax: (in, out)

  @jax.jit
  def grad(targets):
    return jax.grad(lambda p: jnp.mean((dense.apply({"params": p}, x) - targets) ** 2))(params)

  g_real = grad(jax.random.normal(jax.random.PRNGKey(2), (7, 3)))
  g_syn = grad(jax.random.normal(jax.random.PRNGKey(3), (7, 3)))
  g_real, g_syn = jax.tree.map(np.asarray, (g_real, g_syn))

  def scaled(g, index):
    kernel = g["kernel"].copy()
    kernel[index] *= 5.0
    return {**g, "kernel": kernel}

  base = distance(g_real, g_syn)
  chex.assert_trees_all_close(distance(g_real, scaled(g_syn, (slice(None), 1))), base, atol=1e-5)
  assert abs(float(distance(g_real, scaled(g_syn, (1, slice(None)))) - base)) > 1e-3
  # Same for a Conv kernel (h, w, in, out).
  conv_real, conv_syn = random_grads(4)["conv"], random_grads(5)["conv"]
  base = distance(conv_real, conv_syn)
  chex.assert_trees_all_close(distance(conv_real, scaled(conv_syn, (..., 2))), base, atol=1e-5)
  assert abs(float(distance(conv_real, scaled(conv_syn, (..., 1, slice(None)))) - base)) > 1e-3


def test_row_axis_override():
  g_real, g_syn = random_grads(0), random_grads(1)
  # PyTorch layout (out, in, h, w) with row_axis=0 equals Flax layout with the default.
  to_torch = {
    "kernel": lambda k: np.transpose(k, (3, 2, 0, 1)) if k.ndim == 4 else k.T,
    "bias": lambda b: b,
  }
  torch_real = {m: {n: to_torch[n](v) for n, v in layer.items()} for m, layer in g_real.items()}
  torch_syn = {m: {n: to_torch[n](v) for n, v in layer.items()} for m, layer in g_syn.items()}
  chex.assert_trees_all_close(
    distance(torch_real, torch_syn, row_axis=0), distance(g_real, g_syn), atol=1e-6
  )
  # A pytree of axes: per-tensor choice; None makes a tensor a single row.
  axes = {"conv": {"kernel": None, "bias": 0}, "dense": {"kernel": 0, "bias": None}}
  manual = (
    float(layer_distance(g_real["conv"]["kernel"], g_syn["conv"]["kernel"], None))
    + float(layer_distance(g_real["conv"]["bias"], g_syn["conv"]["bias"], -1))
    + float(layer_distance(g_real["dense"]["kernel"], g_syn["dense"]["kernel"], 0))
    + float(layer_distance(g_real["dense"]["bias"], g_syn["dense"]["bias"], -1))
  )
  # A pytree of axes is no static jit argument (unhashable): it is closed over instead.
  by_axes = jax.jit(lambda a, b: matching_distance(a, b, row_axis=axes))
  chex.assert_trees_all_close(by_axes(g_real, g_syn), manual, atol=1e-6)
  assert abs(manual - float(distance(g_real, g_syn))) > 1e-3
  # None for a whole tensor is the cosine of the flattened tensors.
  a, b = g_real["conv"]["kernel"].ravel(), g_syn["conv"]["kernel"].ravel()
  chex.assert_trees_all_close(
    layer_distance(g_real["conv"]["kernel"], g_syn["conv"]["kernel"], None),
    1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)),
    atol=1e-6,
  )


def test_mismatched_pytrees_raise():
  g = random_grads(0)
  with pytest.raises(ValueError, match="4 real leaves, 2 synthetic"):
    matching_distance(g, g["conv"])
  with pytest.raises(ValueError, match="3 row axes"):
    matching_distance(g, g, row_axis={"a": 0, "b": 0, "c": 0})


def test_finite_gradient_with_zero_rows():
  g_real, g_syn = random_grads(0), random_grads(1)
  g_syn["dense"]["kernel"][:, 1] = 0.0  # a zero output unit
  g_syn["conv"]["bias"][:] = 0.0  # an all-zero 1-D tensor
  g_real["dense"]["bias"][:] = 0.0  # zero on the real side
  loss = functools.partial(matching_distance, g_real, mse_weight=0.1)
  value, grad = jax.jit(jax.value_and_grad(loss))(g_syn)
  chex.assert_tree_all_finite((value, grad))
  chex.assert_trees_all_equal_shapes_and_dtypes(grad, g_syn)
  # A zero real row gives cos = 0, a constant distance of 1 for that tensor.
  chex.assert_trees_all_close(
    layer_distance(g_real["dense"]["bias"], g_syn["dense"]["bias"], -1), 1.0, atol=1e-6
  )
  grad_zero = jax.jit(jax.grad(lambda b: matching.layer_distance(g_real["dense"]["bias"], b)))(
    g_syn["dense"]["bias"]
  )
  chex.assert_trees_all_close(grad_zero, jnp.zeros(3), atol=1e-6)


def test_condensation_code_variant_sums_rows_and_skips_vectors():
  """DSC / PSG: ``1 - cos`` summed over rows, 1-D tensors scored 0 (the condensation code)."""
  # kernel rows cos 1, 0, -1 -> sum 0 + 1 + 2 = 3 (mean 1); bias one row -> 1.
  summed = distance(HAND_REAL, HAND_SYN, row_reduction="sum")
  chex.assert_trees_all_close(summed, 4.0, atol=1e-6)
  no_vectors = distance(HAND_REAL, HAND_SYN, row_reduction="sum", include_vectors=False)
  chex.assert_trees_all_close(no_vectors, 3.0, atol=1e-6)
  chex.assert_trees_all_close(distance(HAND_REAL, HAND_SYN, include_vectors=False), 1.0, atol=1e-6)
  # The MSE term still covers the bias.
  chex.assert_trees_all_close(
    distance(HAND_REAL, HAND_SYN, mse_weight=1.0, include_vectors=False), 1.0 + HAND_SQ, atol=1e-5
  )
  with raises_field("row_reduction"):
    matching_distance(HAND_REAL, HAND_SYN, row_reduction="max")


def test_mean_embedding_distance_by_hand():
  f32 = functools.partial(np.array, dtype=np.float32)
  real = ({"f": f32([[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]])}, f32([[1.0], [1.0], [9.0]]))
  syn = ({"f": f32([[0.0, 1.0], [0.0, 1.0]])}, f32([[0.0], [4.0]]))
  real_w, syn_w = f32([1.0, 1.0, 0.0]), f32([1.0, 1.0])  # the third real row is padding
  # means: f (2, 0) vs (0, 1) -> 4 + 1; second leaf 1 vs 2 -> 1.
  d = jax.jit(matching.mean_embedding_distance)(real, syn, real_w, syn_w)
  chex.assert_trees_all_close(d, 6.0, atol=1e-6)
  g = jax.jit(jax.grad(lambda s: matching.mean_embedding_distance(real, s, real_w, syn_w)))(syn)
  # d/ds_i of (mean - m)^2 = 2 (mean_s - mean_r) / 2 per example.
  chex.assert_trees_all_close(g[0]["f"], f32([[-2.0, 1.0], [-2.0, 1.0]]), atol=1e-6)
