"""The ScatterNet (fedlap_jax.models.ScatterNet): a fixed scattering front end, numbers and
symmetries of its filter bank, and its per-example gradients as the DP paths compute them."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import models, per_example, privacy
from fedlap_jax.losses import cross_entropy
from fedlap_jax.models import ScatterNet, scattering

RNG = np.random.default_rng(0)
X28 = RNG.random((3, 28, 28, 1), np.float32)
X8 = RNG.standard_normal((6, 8, 8, 1)).astype(np.float32)
Y8 = np.arange(6, dtype=np.int32) % 10


def init(model, x):
  return jax.jit(model.init)(jax.random.PRNGKey(0), x)["params"]


@pytest.mark.parametrize("head", models.SCATTER_HEADS)
@pytest.mark.parametrize("shape, side", [((28, 28, 1), 7), ((8, 8, 1), 2), ((16, 16, 3), 4)])
def test_shapes(head, shape, side):
  x = jax.ShapeDtypeStruct((2, *shape), jnp.float32)
  model = ScatterNet(num_classes=10, head=head)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"]
  logits = jax.eval_shape(lambda p, x: model.apply({"params": p}, x), params, x)
  chex.assert_shape(logits, (2, 10))
  chex.assert_shape(jax.eval_shape(scattering, x), (2, side, side, 81 * shape[2]))


def test_the_front_end_has_no_parameters_and_the_head_all_of_them():
  params = init(ScatterNet(head="linear"), X28[:1])
  # GroupNorm's scale and bias over 81 channels, and one Dense layer on 81 x 7 x 7 features.
  assert models.count_params(params) == 2 * 81 + 81 * 7 * 7 * 10 + 10
  assert set(params) == {"GroupNorm_0", "Dense_0"}


def test_a_side_not_a_multiple_of_4_is_refused():
  with pytest.raises(ValueError, match="multiple of 4"):
    jax.eval_shape(scattering, jax.ShapeDtypeStruct((1, 10, 10, 1), jnp.float32))


def test_order_0_is_the_mean_and_the_wavelets_have_zero_mean():
  """On a constant image the low-pass keeps the value (gain 1) and every band-pass gives 0."""
  s = np.asarray(jax.jit(scattering)(np.full((1, 16, 16, 1), 3.0, np.float32)))
  np.testing.assert_allclose(s[..., 0], 3.0, rtol=1e-5)
  assert np.abs(s[..., 1:]).max() < 1e-4


def test_transposing_the_image_maps_each_angle_t_to_4_minus_t():
  """The Morlet filter at angle t pi / 8, mirrored across the diagonal, is the one at
  (4 - t) pi / 8 (angles mod pi, where the modulus cannot tell a filter from its conjugate):
  the features of the transposed image are the transposed features, angles permuted."""
  J, L = models.SCATTER_J, models.SCATTER_L
  s = np.asarray(jax.jit(scattering)(X28))
  st = np.asarray(jax.jit(scattering)(X28.transpose(0, 2, 1, 3)))
  t = (4 - np.arange(L)) % L
  perm = [0]
  perm += [1 + j * L + t[a] for j in range(J) for a in range(L)]
  perm += [1 + J * L + t[a] * L + t[b] for a in range(L) for b in range(L)]  # J = 2: one (j1, j2)
  np.testing.assert_allclose(st, s.transpose(0, 2, 1, 3)[..., perm], rtol=1e-4, atol=1e-6)
  assert not np.allclose(st, s.transpose(0, 2, 1, 3), atol=1e-3)  # the permutation is needed


@pytest.mark.parametrize("head", models.SCATTER_HEADS)
def test_per_example_gradients_are_single_example_gradients(head):
  """The project's per-example gradients and its layer-wise clipped sum, against a loop of
  single-example gradients; DP accepts the model and its layer-wise path serves it."""
  model = ScatterNet(num_classes=10, head=head)
  params = init(model, X8[:1])

  def apply_fn(p, x):
    return model.apply({"params": p}, x)

  per_example.check_dp_model(apply_fn, params, X8)  # no statistics, no state: no refusal
  assert {c.rule for c in per_example.discover(apply_fn, params, X8)} >= {"dense", "generic"}
  grads = jax.jit(per_example.per_example_gradients, static_argnums=0)(apply_fn, params, X8, Y8)

  def loss_one(p, x, y):
    return cross_entropy(apply_fn(p, x[None]), y[None])[0]

  grad_one = jax.jit(jax.grad(loss_one))
  for i in range(len(X8)):
    chex.assert_trees_all_close(
      jax.tree.map(lambda g: g[i], grads), grad_one(params, X8[i], Y8[i]), rtol=1e-4, atol=1e-6
    )
  clip, pad = 0.05, np.zeros(len(X8), bool)
  summed, norms = jax.jit(
    lambda p: privacy.clipped_gradient_sum(
      apply_fn, p, X8, Y8, pad, l2_clip_norm=clip, method="layerwise"
    )
  )(params)
  flat = jnp.sqrt(sum(jnp.sum(g.reshape(len(X8), -1) ** 2, 1) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(norms, flat, rtol=1e-4)
  scale = jnp.minimum(1.0, clip / flat)
  expected = jax.tree.map(lambda g: jnp.tensordot(scale, g, 1), grads)
  chex.assert_trees_all_close(summed, expected, rtol=1e-4, atol=1e-7)


def test_the_gradient_to_the_image_is_finite():
  """FedLAP differentiates the model to its synthetic images, through the modulus: finite even
  on an all-zero image (where the modulus has no derivative)."""
  model = ScatterNet(head="cnn")
  params = init(model, X8[:1])
  x = np.concatenate([X8[:2], np.zeros((1, 8, 8, 1), np.float32)])
  g = jax.jit(jax.grad(lambda x: model.apply({"params": params}, x).sum()))(x)
  assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g[:2])).max() > 0
