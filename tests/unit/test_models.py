"""Tests for fedlap_jax.models (the ConvNet of the paper)."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import models
from fedlap_jax.models import ConvNet, count_params, init_convnet
from conftest import raises_field


def normal(seed, shape):
  """Standard normal float32 inputs, drawn on the host (``np.random.default_rng(seed)``)."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def host(tree):
  """``tree`` read back as NumPy arrays: the checks that follow compile nothing."""
  return jax.tree.map(np.asarray, tree)


def abstract_params(model: ConvNet, image_shape):
  """Parameter shapes without computing anything (``jax.eval_shape``)."""
  x = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  return jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"]


def expected_count(image_shape, *, classes=10, width=128, depth=3, norm="instance"):
  """Closed-form parameter count of the ConvNet (for 3x3 kernels, 2x2 pooling)."""
  h, w, c = image_shape
  if (h, w, c) == (28, 28, 1):
    h = w = 32
  convs = 9 * c * width + width + (depth - 1) * (9 * width * width + width)
  norms = 0 if norm == "none" else depth * 2 * width
  side_h, side_w = h // 2**depth, w // 2**depth
  return convs + norms + width * side_h * side_w * classes + classes


def first_feature_map_shape(model, image_shape):
  """Shape of the first convolution's output, read with ``capture_intermediates``."""
  x = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)

  def run(v, x):
    _, state = model.apply(v, x, capture_intermediates=lambda mdl, _: isinstance(mdl, nn.Conv))
    return state["intermediates"]["Conv_0"]["__call__"][0]

  return jax.eval_shape(run, variables, x).shape


@pytest.mark.parametrize("image_shape, count", [((28, 28, 1), 317_706), ((32, 32, 3), 320_010)])
def test_paper_parameter_counts(image_shape, count):
  params = abstract_params(ConvNet(num_classes=10, width=128, depth=3), image_shape)
  assert count_params(params) == count
  assert expected_count(image_shape) == count


@pytest.mark.parametrize("norm", models.NORMS)
@pytest.mark.parametrize(
  "width, depth, image_shape",
  [(16, 1, (8, 8, 1)), (32, 2, (8, 8, 1)), (16, 3, (32, 32, 3)), (32, 3, (28, 28, 1))],
)
def test_narrow_variants_and_norms(norm, width, depth, image_shape):
  model = ConvNet(num_classes=10, width=width, depth=depth, norm=norm)
  params = abstract_params(model, image_shape)
  assert count_params(params) == expected_count(image_shape, width=width, depth=depth, norm=norm)
  norm_layers = [k for k in params if k.startswith("GroupNorm")]
  assert len(norm_layers) == (0 if norm == "none" else depth)
  for k in norm_layers:
    chex.assert_shape([params[k]["scale"], params[k]["bias"]], (width,))
  chex.assert_shape(params["Conv_0"]["kernel"], (3, 3, image_shape[-1], width))


@pytest.mark.parametrize(
  "image_shape, feature_shape",
  [
    ((28, 28, 1), (2, 32, 32, 16)),  # the 1-channel 28x28 rule: padding 3 in the first conv
    ((32, 32, 3), (2, 32, 32, 16)),
    ((28, 28, 3), (2, 28, 28, 16)),  # the rule is for 1-channel images only
    ((8, 8, 1), (2, 8, 8, 16)),
  ],
)
def test_padding_rule(image_shape, feature_shape):
  assert first_feature_map_shape(ConvNet(width=16, depth=3), image_shape) == feature_shape


def test_bad_norm_name():
  model = ConvNet(norm="batch")
  with raises_field("ConvNet.norm"):
    model.init(jax.random.PRNGKey(0), np.zeros((1, 8, 8, 1), np.float32))


def test_bad_input_rank():
  model = ConvNet(width=8, depth=1)
  with raises_field("x"):
    model.init(jax.random.PRNGKey(0), np.zeros((8, 8), np.float32))


@pytest.mark.parametrize(
  "model, image_shape, field",
  [
    (ConvNet(width=0, depth=1), (8, 8, 1), "ConvNet.width"),
    (ConvNet(num_classes=0, width=8), (8, 8, 1), "ConvNet.num_classes"),
    (ConvNet(width=8, depth=4), (8, 8, 1), "ConvNet.depth"),
    (ConvNet(width=8, depth=6), (28, 28, 1), "ConvNet.depth"),
  ],
)
def test_bad_sizes_are_refused_before_any_layer_is_built(model, image_shape, field):
  with raises_field(field):
    model.init(jax.random.PRNGKey(0), np.zeros((1, *image_shape), np.float32))


@pytest.mark.parametrize("norm", models.NORMS)
def test_apply_shapes_jit_and_eager(norm):
  model, params = init_convnet(jax.random.PRNGKey(0), (8, 8, 1), 10, width=8, depth=1, norm=norm)
  assert model.norm == norm and model.width == 8
  x = jnp.asarray(normal(1, (5, 8, 8, 1)))

  def apply(p, x):
    return model.apply({"params": p}, x)

  eager = apply(params, x)
  jitted = jax.jit(apply)(params, x)
  chex.assert_shape([eager, jitted], (5, 10))
  chex.assert_type([eager, jitted], jnp.float32)
  chex.assert_tree_all_finite(eager)
  chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5)


def test_instance_norm_is_per_example():
  """An example's logits do not depend on the rest of the batch (needed for record-level DP)."""
  model, params = init_convnet(jax.random.PRNGKey(0), (8, 8, 1), 10, width=8, depth=2)
  apply = jax.jit(model.apply)
  x = normal(1, (4, 8, 8, 1))
  other = x.copy()
  other[1:] = 5.0 * normal(2, (3, 8, 8, 1))
  a = np.asarray(apply({"params": params}, x))
  b = np.asarray(apply({"params": params}, other))
  chex.assert_trees_all_close(a[0], b[0], atol=1e-5)
  assert not bool(np.allclose(a[1:], b[1:]))


def test_count_params_concrete():
  _, params = init_convnet(jax.random.PRNGKey(0), (8, 8, 1), 10, width=16, depth=1)
  assert count_params(params) == expected_count((8, 8, 1), width=16, depth=1)
  assert count_params(params) == sum(np.size(p) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("impl", ["flax", "hybrid"])
def test_conv_bias_before_instance_norm_does_nothing(impl):
  """conv_bias=False is the same function with width * depth fewer parameters."""
  kw = dict(num_classes=10, width=8, depth=2, impl=impl)
  with_bias, without = ConvNet(**kw), ConvNet(**kw, conv_bias=False)
  x = normal(1, (3, 8, 8, 1))
  params = host(jax.jit(with_bias.init)(jax.random.PRNGKey(0), x)["params"])
  params = jax.tree_util.tree_map_with_path(  # make the biases matter if they could
    lambda path, p: (
      p + np.float32(0.5) if "Conv" in jax.tree_util.keystr(path) and p.ndim == 1 else p
    ),
    params,
  )
  stripped = {
    k: ({"kernel": v["kernel"]} if k.startswith("Conv") else v) for k, v in params.items()
  }
  assert count_params(params) - count_params(stripped) == 8 * 2
  chex.assert_trees_all_close(
    jax.jit(without.apply)({"params": stripped}, x),
    jax.jit(with_bias.apply)({"params": params}, x),
    atol=1e-5,
  )
  # With group norm (4 channels per group) a per-channel bias is not removed.
  grouped = ConvNet(**kw, norm="group", num_groups=2)
  gp = host(jax.jit(grouped.init)(jax.random.PRNGKey(0), x)["params"])
  moved = {
    k: ({**v, "bias": np.arange(8.0, dtype=np.float32)} if k.startswith("Conv") else v)
    for k, v in gp.items()
  }
  apply = jax.jit(grouped.apply)
  assert not bool(np.allclose(apply({"params": gp}, x), apply({"params": moved}, x), atol=1e-3))


@pytest.mark.parametrize("impl", ["flax", "hybrid"])
def test_a_tanh_convnet_has_the_same_parameters_and_bounded_features(impl):
  """``activation=jnp.tanh`` changes the function, not the parameters: every feature of the
  last block is an average of tanh values, so within [-1, 1], and ReLU's are not."""
  x = 4.0 * normal(2, (3, 8, 8, 1))
  relu, tanh = (
    ConvNet(width=8, depth=1, impl=impl),
    ConvNet(width=8, depth=1, impl=impl, activation=jnp.tanh),
  )
  params = host(jax.jit(relu.init)(jax.random.PRNGKey(0), x)["params"])
  chex.assert_trees_all_equal_shapes(
    params, host(jax.jit(tanh.init)(jax.random.PRNGKey(0), x)["params"])
  )
  features, logits = jax.jit(lambda p, x: tanh.apply({"params": p}, x, return_features=True))(
    params, x
  )
  chex.assert_shape(logits, (3, 10))
  assert float(jnp.min(features)) < 0.0 and float(jnp.max(jnp.abs(features))) <= 1.0
  relu_features, _ = jax.jit(lambda p, x: relu.apply({"params": p}, x, return_features=True))(
    params, x
  )
  assert float(jnp.min(relu_features)) >= 0.0


def image_gradient(apply_fn, params, g_real, x_syn, y_syn, dtype):
  """``d L_dis / d x_syn`` with every input cast to ``dtype``, as float64 numpy.

  For ``jnp.float64`` call it inside ``with jax.enable_x64(True):``.
  """
  from fedlap_jax import matching, privacy

  cast = lambda t: jax.tree.map(lambda a: np.asarray(a).astype(dtype), t)  # noqa: E731
  params, g_real, x_syn = cast(params), cast(g_real), cast(x_syn)

  def loss(x):
    g_syn = privacy.real_gradient(apply_fn, params, x, y_syn, jnp.zeros(len(y_syn), bool))
    return matching.matching_distance(g_real, g_syn)

  return np.asarray(jax.jit(jax.grad(loss))(x_syn), np.float64)


def test_without_conv_bias_the_dp_image_gradient_is_exact_in_float32():
  """The float noise of a structurally zero bias gradient does not reach the images."""
  from fedlap_jax import privacy

  x = jax.random.normal(jax.random.PRNGKey(3), (16, 8, 8, 1))
  y = np.arange(16, dtype=np.int32) % 10
  x_syn = jax.random.normal(jax.random.PRNGKey(2), (10, 8, 8, 1))
  errors = {}
  for conv_bias in (True, False):
    model, params = init_convnet(
      jax.random.PRNGKey(0), (8, 8, 1), width=8, depth=1, conv_bias=conv_bias
    )
    apply_fn = lambda p, v, m=model: m.apply({"params": p}, v)  # noqa: E731
    g_dp = jax.jit(
      lambda p, f=apply_fn: privacy.privatise(
        jax.random.PRNGKey(1),
        privacy.clipped_gradient_sum(f, p, x, y, np.zeros(16, bool), l2_clip_norm=1.0)[0],
        l2_clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=16.0,
      )
    )(params)
    with jax.enable_x64(True):
      exact = image_gradient(apply_fn, params, g_dp, x_syn, np.arange(10), jnp.float64)
      single = image_gradient(apply_fn, params, g_dp, x_syn, np.arange(10), jnp.float32)
    errors[conv_bias] = np.linalg.norm(single - exact) / np.linalg.norm(exact)
  assert errors[False] < 1e-4 < errors[True], errors


def test_embedding_returns_features_and_the_same_logits():
  from fedlap_jax.models import embed_fn, init_fn

  model = ConvNet(num_classes=10, width=8, depth=2)
  init = jax.jit(init_fn(model, (8, 8, 1)))  # one program for both keys
  params = init(jax.random.PRNGKey(0))
  x = normal(1, (3, 8, 8, 1))
  features, logits = host(jax.jit(embed_fn(model))(params, x))
  chex.assert_shape(features, (3, 8 * 2 * 2))
  chex.assert_trees_all_close(logits, jax.jit(model.apply)({"params": params}, x), atol=1e-6)
  # The logits are the Dense layer of the features.
  dense = host(params["Dense_0"])
  chex.assert_trees_all_close(logits, features @ dense["kernel"] + dense["bias"], atol=1e-5)
  # init_fn gives fresh networks: another key, other parameters.
  other = init(jax.random.PRNGKey(2))
  assert not np.allclose(other["Dense_0"]["kernel"], dense["kernel"])


class _Compiles:
  """Counts the programs XLA builds (or reads from a cache) inside ``with``."""

  def __enter__(self):
    self.n = 0
    self._on = lambda event, seconds, **kw: setattr(
      self, "n", self.n + (event == "/jax/core/compile/backend_compile_duration")
    )
    jax.monitoring.register_event_duration_secs_listener(self._on)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._on)


def test_init_convnet_is_one_program_with_the_eager_initialisation_s_numbers():
  shape, key = (6, 6, 2), jax.random.key(7)  # a shape no other test initialises
  with _Compiles() as built:
    model, params = init_convnet(key, shape, 3, width=4, depth=1)
  assert built.n == 1  # eagerly: one program per operation of Flax's initialisation
  eager = model.init(key, jnp.zeros((1, *shape)))["params"]
  chex.assert_trees_all_equal(params, eager)  # bit for bit


def test_noise_images_is_one_program_with_the_eager_sampler_s_numbers():
  from fedlap_jax.synthetic import noise_images  # pylint: disable=g-import-not-at-top

  key, mask = jax.random.key(3), jnp.asarray([[True, True, False], [True, False, False]])
  with _Compiles() as built:
    x = noise_images(key, mask, (5, 3, 2))
  assert built.n == 1
  eager = jax.random.normal(key, (2, 3, 5, 3, 2)) * mask[:, :, None, None, None]
  np.testing.assert_array_equal(np.asarray(x), np.asarray(eager))
