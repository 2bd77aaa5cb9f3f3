"""Tests for fedlap_jax.dsa (Differentiable Siamese Augmentation)."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import dsa
from conftest import raises_field

SHAPES = [(4, 16, 16, 3), (3, 28, 28, 1)]
NUM_KEYS = 16

# Jitted entry points shared by the tests (eager op-by-op dispatch is slow).
augment = jax.jit(dsa.augment, static_argnames="strategy")
affine_sample = jax.jit(dsa._affine_sample)
color = jax.jit(dsa._color)
translate = jax.jit(dsa._translate, static_argnums=(3, 4))
cutout = jax.jit(dsa._cutout, static_argnums=(3, 4))
scale_theta = jax.jit(dsa._scale_theta)
rotate_theta = jax.jit(dsa._rotate_theta)


@jax.jit
def all_families(key, x):
  """Every family applied to ``x`` with the same key: {family: images}."""
  return {family: dsa.apply_family(key, x, family) for family in dsa.FAMILIES}


def _images(shape, seed=0):
  """Standard normal images, NumPy float32: built without compiling anything (JAX compiles
  every operation it runs outside ``jit`` on a new shape as a program of its own)."""
  return np.random.default_rng(seed).standard_normal(shape, np.float32)


@functools.lru_cache(maxsize=None)
def _keys(n=NUM_KEYS, seed=1):
  """``n`` PRNG keys (JAX's own split: the keys pick the transforms), as a NumPy array: taking
  one out compiles nothing."""
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed), n))
  keys.flags.writeable = False
  return keys


@jax.jit
def _family_choice(key):
  """``augment``'s draw: the family's index and the key of its parameters."""
  choice_key, param_key = jax.random.split(key)
  return jax.random.randint(choice_key, (), 0, len(dsa.FAMILIES)), param_key


# --------------------------------------------------------------------------
# parse_strategy
# --------------------------------------------------------------------------


def test_parse_strategy():
  assert dsa.parse_strategy("color_crop") == ("color", "crop")
  assert dsa.parse_strategy(dsa.DEFAULT_STRATEGY) == dsa.FAMILIES
  assert dsa.parse_strategy("") == ()
  assert dsa.parse_strategy("none") == ()
  assert dsa.parse_strategy("flip") == ("flip",)


@pytest.mark.parametrize(
  "bad, token", [("color_blur", "blur"), ("crop__flip", ""), ("Color", "Color")]
)
def test_parse_strategy_error_names_bad_token(bad, token):
  with pytest.raises(ValueError) as info:
    dsa.parse_strategy(bad)
  message = str(info.value)
  assert repr(token) in message
  for family in dsa.FAMILIES:
    assert family in message


def test_parse_strategy_rejects_repeats():
  with raises_field("strategy"):
    dsa.parse_strategy("flip_flip")


def test_apply_family_rejects_unknown():
  with raises_field("family"):
    dsa.apply_family(jax.random.PRNGKey(0), _images((2, 8, 8, 1)), "blur")


# --------------------------------------------------------------------------
# Shapes, dtypes, jit, Siamese property
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_dtype_and_jit(shape):
  x = _images(shape)
  key = jax.random.PRNGKey(7)
  compiled = all_families(key, x)
  chex.assert_shape(list(compiled.values()), shape)
  chex.assert_type(list(compiled.values()), jnp.float32)
  if shape != SHAPES[0]:
    return  # eager dispatch compiles op by op: check it on one shape only
  for family in dsa.FAMILIES:
    eager = dsa.apply_family(key, x, family)
    chex.assert_shape([eager, compiled[family]], shape)
    chex.assert_type([eager, compiled[family]], jnp.float32)
    chex.assert_trees_all_close(eager, compiled[family], atol=1e-5, rtol=1e-5)
  eager = dsa.augment(key, x)
  compiled = augment(key, x)
  chex.assert_shape([eager, compiled], shape)
  chex.assert_type([eager, compiled], jnp.float32)
  chex.assert_trees_all_close(eager, compiled, atol=1e-5, rtol=1e-5)


def test_dtype_kept_bfloat16():
  x = _images((4, 16, 16, 3)).astype(jnp.bfloat16)
  out = all_families(jax.random.PRNGKey(3), x)
  chex.assert_type(list(out.values()), jnp.bfloat16)


def test_empty_strategy_is_identity():
  x = _images((2, 8, 8, 3))
  key = jax.random.PRNGKey(0)
  chex.assert_trees_all_equal(dsa.augment(key, x, ""), x)
  chex.assert_trees_all_equal(dsa.augment(key, x, "none"), x)
  chex.assert_trees_all_equal(dsa.make_augment_fn("none")(key, x), x)


def test_make_augment_fn_matches_augment():
  x = _images((4, 16, 16, 3))
  fn = jax.jit(dsa.make_augment_fn("crop_flip"))
  for key in _keys(4):
    chex.assert_trees_all_close(fn(key, x), augment(key, x, strategy="crop_flip"))
  with raises_field("strategy"):
    dsa.make_augment_fn("blur")


def test_same_key_same_transform_across_batches():
  """Parameters are drawn per batch: aug(concat[a, b]) == concat[aug(a), aug(b)]."""
  a = _images((4, 16, 16, 3), seed=10)
  b = _images((4, 16, 16, 3), seed=11)
  ab = np.concatenate([a, b])
  for key in _keys(8):
    joint = all_families(key, ab)
    out_a, out_b = all_families(key, a), all_families(key, b)
    for family in dsa.FAMILIES:
      separate = np.concatenate([out_a[family], out_b[family]])
      chex.assert_trees_all_close(joint[family], separate, atol=1e-5, rtol=1e-5)
    separate = np.concatenate([augment(key, a), augment(key, b)])
    chex.assert_trees_all_close(augment(key, ab), separate, atol=1e-5, rtol=1e-5)


def test_every_family_is_picked():
  """With all families enabled, random keys reach every branch."""
  x = _images((4, 16, 16, 3))
  picked = set()
  for key in _keys(48):
    out = augment(key, x)
    choice, param_key = _family_choice(key)
    family = dsa.FAMILIES[int(choice)]
    chex.assert_trees_all_close(out, all_families(param_key, x)[family], atol=1e-5)
    picked.add(family)
  assert picked == set(dsa.FAMILIES)


# --------------------------------------------------------------------------
# Individual families
# --------------------------------------------------------------------------


def test_flip_flips_for_some_keys_only():
  x = _images((4, 16, 16, 3))
  flipped, kept = 0, 0
  for key in _keys():
    out = np.asarray(all_families(key, x)["flip"])
    if np.array_equal(out, x):
      kept += 1
    else:
      np.testing.assert_array_equal(out, x[:, :, ::-1, :])
      flipped += 1
  assert flipped > 0 and kept > 0


def _manual_shift(x, dy, dx):
  """out[:, i, j] = x[:, i + dy, j + dx], zero outside."""
  n, h, w, c = x.shape
  out = np.zeros_like(x)
  for i in range(h):
    for j in range(w):
      if 0 <= i + dy < h and 0 <= j + dx < w:
        out[:, i, j] = x[:, i + dy, j + dx]
  return out


def test_translate_matches_manual_shift():
  x = _images((2, 8, 8, 2))
  for dy, dx in [(0, 0), (2, -1), (-2, 2), (1, 0)]:
    out = translate(x, np.int32(dy), np.int32(dx), 2, 2)
    np.testing.assert_array_equal(np.asarray(out), _manual_shift(x, dy, dx))


@pytest.mark.parametrize("shape", SHAPES)
def test_crop_is_a_bounded_translation(shape):
  x = _images(shape)
  s = int(shape[1] * 0.125 + 0.5)
  candidates = {
    (dy, dx): _manual_shift(x, dy, dx) for dy in range(-s, s + 1) for dx in range(-s, s + 1)
  }
  seen = set()
  for key in _keys():
    out = np.asarray(all_families(key, x)["crop"])
    matches = [shift for shift, ref in candidates.items() if np.array_equal(out, ref)]
    assert len(matches) == 1, "crop output is not a translation within [-s, s]"
    seen.add(matches[0])
  assert len(seen) > 1


def _zero_box(mask):
  """Bounding box (rows, cols) of the zeros in a 2-D boolean 'is zero' mask."""
  rows = np.flatnonzero(mask.any(axis=1))
  cols = np.flatnonzero(mask.any(axis=0))
  return rows, cols


def test_cutout_helper_zeros_square_of_right_size():
  x = np.ones((2, 16, 16, 3), np.float32)
  out = np.asarray(cutout(x, np.int32(8), np.int32(6), 8, 8))
  zero = out == 0
  np.testing.assert_array_equal(zero, np.broadcast_to(zero[:1, :, :, :1], zero.shape))
  rows, cols = _zero_box(zero[0, :, :, 0])
  np.testing.assert_array_equal(rows, np.arange(4, 12))
  np.testing.assert_array_equal(cols, np.arange(2, 10))
  assert zero[0, :, :, 0].sum() == 64
  # Near the border the square is clipped.
  out = np.asarray(cutout(x, np.int32(0), np.int32(15), 8, 8))
  assert (out[0, :, :, 0] == 0).sum() == 4 * 5


@pytest.mark.parametrize("shape", SHAPES)
def test_cutout_zeros_a_clipped_square(shape):
  n, h, w, c = shape
  size = int(h * 0.5 + 0.5)
  x = np.ones(shape, np.float32)
  full = 0
  for key in _keys(32):
    out = np.asarray(all_families(key, x)["cutout"])
    zero = out == 0
    # Same region in every image and channel; other values untouched.
    np.testing.assert_array_equal(zero, np.broadcast_to(zero[:1, :, :, :1], zero.shape))
    np.testing.assert_array_equal(out[~zero], 1.0)
    region = zero[0, :, :, 0]
    rows, cols = _zero_box(region)
    assert 0 < len(rows) <= size and 0 < len(cols) <= size
    assert region.sum() == len(rows) * len(cols)  # a filled rectangle
    full += len(rows) == size and len(cols) == size
  assert full > 0


def test_color_changes_values_keeps_shape():
  x = _images((4, 16, 16, 3))
  for key in _keys(4):
    out = all_families(key, x)["color"]
    chex.assert_shape(out, x.shape)
    assert not np.allclose(np.asarray(out), x)


def test_color_helper_formula():
  x = _images((2, 4, 4, 3))
  # Neutral parameters are the identity.
  chex.assert_trees_all_close(color(x, 0.0, 1.0, 1.0), x, atol=1e-6)
  # Brightness only shifts.
  chex.assert_trees_all_close(color(x, 0.3, 1.0, 1.0), x + 0.3, atol=1e-6)
  # Zero saturation makes every channel equal to the pixel mean.
  gray = color(x, 0.0, 0.0, 1.0)
  chex.assert_trees_all_close(gray, np.broadcast_to(x.mean(-1, keepdims=True), x.shape), atol=1e-6)
  # Zero contrast makes every image constant at its mean.
  flat = color(x, 0.0, 1.0, 0.0)
  chex.assert_trees_all_close(
    flat, np.broadcast_to(x.mean((1, 2, 3), keepdims=True), x.shape), atol=1e-6
  )


@pytest.mark.parametrize("shape", SHAPES)
def test_affine_identity_returns_image(shape):
  x = _images(shape)
  identity = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], np.float32)
  chex.assert_trees_all_close(affine_sample(x, identity), x, atol=1e-5)


def test_affine_scale_and_rotate_limits_are_identity():
  x = _images((4, 16, 16, 3))
  chex.assert_trees_all_close(affine_sample(x, scale_theta(1.0, 1.0)), x, atol=1e-5)
  chex.assert_trees_all_close(affine_sample(x, rotate_theta(0.0)), x, atol=1e-5)


def test_affine_rotate_quarter_turn():
  """A 90 degree rotation of a square image is an exact pixel permutation."""
  x = _images((4, 16, 16, 3))
  out = affine_sample(x, rotate_theta(math.pi / 2))
  chex.assert_trees_all_close(out, np.rot90(x, k=-1, axes=(1, 2)), atol=1e-5)


def test_affine_zero_padding_and_half_pixel_shift():
  x = _images((4, 16, 16, 3))
  step = 2.0 / (16 - 1)  # one pixel in normalised coordinates
  # Shift by one pixel in width: column 0 reads outside the image, so it is
  # zero; the rest is the shifted image.
  theta = np.array([[1.0, 0.0, -step], [0.0, 1.0, 0.0]], np.float32)
  out = np.asarray(affine_sample(x, theta))
  np.testing.assert_allclose(out[:, :, 0], 0.0, atol=1e-6)
  np.testing.assert_allclose(out[:, :, 1:], x[:, :, :-1], atol=1e-5)
  # Half a pixel gives the average of neighbours.
  theta = np.array([[1.0, 0.0, step / 2], [0.0, 1.0, 0.0]], np.float32)
  out = np.asarray(affine_sample(x, theta))
  xn = x
  np.testing.assert_allclose(out[:, :, :-1], 0.5 * (xn[:, :, :-1] + xn[:, :, 1:]), atol=1e-5)


def test_rotate_keeps_centre_pixel():
  x = _images((2, 17, 17, 3))
  for key in _keys(6):
    out = np.asarray(all_families(key, x)["rotate"])
    chex.assert_trees_all_close(out[:, 8, 8], x[:, 8, 8], atol=1e-5)
    assert not np.allclose(out, x, atol=1e-3)


def test_scale_keeps_centre_pixel_and_changes_image():
  x = _images((2, 17, 17, 3))
  for key in _keys(6):
    out = np.asarray(all_families(key, x)["scale"])
    chex.assert_trees_all_close(out[:, 8, 8], x[:, 8, 8], atol=1e-5)
    assert not np.allclose(out, x, atol=1e-3)


def test_scale_constant_image_inside_stays_constant():
  """Bilinear weights sum to one away from the border."""
  x = np.full((4, 16, 16, 3), 2.5, np.float32)
  for key in _keys(4):
    out = np.asarray(all_families(key, x)["scale"])
    np.testing.assert_allclose(out[:, 5:11, 5:11, :], 2.5, atol=1e-5)


# --------------------------------------------------------------------------
# Gradients and vmap
# --------------------------------------------------------------------------


def test_gradient_wrt_images_finite_nonzero():
  x = _images((4, 16, 16, 3))
  weights = _images(x.shape, seed=5)

  @jax.jit
  def grads(images, key):
    return {
      family: jax.grad(lambda im: jnp.sum(dsa.apply_family(key, im, family) * weights))(images)
      for family in dsa.FAMILIES
    }

  for key in _keys(3):
    for family, grad in grads(x, key).items():
      chex.assert_shape(grad, x.shape)
      chex.assert_tree_all_finite(grad)
      assert float(np.abs(np.asarray(grad)).sum()) > 0.0, family


def test_gradient_through_full_strategy():
  x = _images((4, 16, 16, 3))
  weights = _images(x.shape, seed=5)
  grad_fn = jax.jit(jax.grad(lambda im, k: jnp.sum(dsa.augment(k, im) * weights)))
  for key in _keys(4):
    grad = grad_fn(x, key)
    chex.assert_tree_all_finite(grad)
    assert float(np.abs(np.asarray(grad)).sum()) > 0.0


def test_vmap_over_clients():
  clients = 3
  x = _images((clients, 4, 16, 16, 3))
  keys = _keys(clients)
  batched = jax.jit(jax.vmap(dsa.make_augment_fn(dsa.DEFAULT_STRATEGY)))(keys, x)
  chex.assert_shape(batched, x.shape)
  for i in range(clients):
    chex.assert_trees_all_close(batched[i], augment(keys[i], x[i]), atol=1e-5)


# --------------------------------------------------------------------------
# The draw: batched, and equal to one jax.random call per parameter
# --------------------------------------------------------------------------


def _reference_params(param_key, h, w):
  """Every family's parameters as a family drawing its own would: one ``jax.random`` call
  per parameter, with the keys :func:`fedlap_jax.dsa.draw_params` names."""
  kb, ks, kc = jax.random.split(param_key, 3)
  ky, kx = jax.random.split(param_key)
  pad_h, pad_w = int(h * 0.125 + 0.5), int(w * 0.125 + 0.5)
  size_h, size_w = int(h * 0.5 + 0.5), int(w * 0.5 + 0.5)
  ksx, ksy = jax.random.split(param_key)
  limit = math.radians(15.0)
  return (
    (jax.random.uniform(kb) - 0.5) * 1.0,
    jax.random.uniform(ks) * 2.0,
    jax.random.uniform(kc) + 0.5,
    jax.random.randint(ky, (), -pad_h, pad_h + 1),
    jax.random.randint(kx, (), -pad_w, pad_w + 1),
    jax.random.randint(ky, (), 0, h + (1 - size_h % 2)),
    jax.random.randint(kx, (), 0, w + (1 - size_w % 2)),
    jax.random.uniform(param_key) < 0.5,
    jax.random.uniform(ksx, minval=1 / 1.2, maxval=1.2),
    jax.random.uniform(ksy, minval=1 / 1.2, maxval=1.2),
    jax.random.uniform(param_key, minval=-limit, maxval=limit),
  )


@pytest.mark.parametrize("hw", [(8, 8), (7, 9), (32, 32)])
def test_draw_params_equal_one_draw_per_parameter(hw):
  """The batched draw gives, bit for bit, the numbers of one jax.random call per parameter
  (the seeded numbers of the families drawing their own parameters)."""
  h, w = hw

  @jax.jit
  @jax.vmap
  def both(key, family_key):
    got = dsa.draw_params(key, (2, h, w, 1), family_key=family_key)
    choice_key, param_key = jax.random.split(key)
    index = jax.random.randint(family_key, (), 0, len(dsa.FAMILIES))
    own = jax.random.randint(choice_key, (), 0, len(dsa.FAMILIES))
    single = dsa.draw_params(key, (2, h, w, 1), "crop_scale_rotate")
    return got, (index, *_reference_params(param_key, h, w)), own, single

  keys, family_keys = _keys(64), _keys(64, seed=2)
  got, want, own, single = both(keys, family_keys)
  for field, a, b in zip(dsa.Params._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)
  np.testing.assert_array_equal(np.asarray(single.family), own % 3)  # family drawn from key
  assert len(set(np.asarray(got.family).tolist())) == len(dsa.FAMILIES)
  # One family: no choice, the parameters from the key itself.
  one = jax.jit(jax.vmap(lambda k: dsa.draw_params(k, (2, h, w, 1), "flip")))(keys)
  np.testing.assert_array_equal(np.asarray(one.family), 0)
  ref = jax.jit(jax.vmap(lambda k: _reference_params(k, h, w)))(keys)
  for field, a, b in zip(dsa.Params._fields[1:], one[1:], ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


def test_apply_of_drawn_params_is_augment():
  """augment = apply(draw_params(...)): a second batch given the same params gets the same
  transform without a draw of its own."""
  x = _images((4, 16, 16, 3))
  strategy = "color_crop_cutout_flip_scale_rotate"

  @jax.jit
  def both(key, x):
    params = dsa.draw_params(key, x.shape, strategy)
    return dsa.apply(params, x, strategy), dsa.augment(key, x, strategy)

  for key in _keys(8):
    a, b = both(key, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _switches(jaxpr):
  """``(number of branches, whether a branch draws random bits)`` of every cond in ``jaxpr``."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      branches = eqn.params["branches"]
      draws = any("random_bits" in str(b.jaxpr) or "threefry" in str(b.jaxpr) for b in branches)
      found.append((len(branches), draws))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found.extend(_switches(inner))
  return found


@pytest.mark.parametrize(
  "strategy, branches",
  [
    ("color_crop_cutout_flip_scale_rotate", 5),  # scale and rotate: one resampling branch
    ("crop_scale_rotate", 2),
    ("color_crop_flip", 3),
    ("scale_rotate", 2),  # no other family: kept apart (a one-branch switch is inlined)
  ],
)
def test_switch_branches_draw_nothing(strategy, branches):
  """The family switch holds transforms only: the draw comes before it, and scale and
  rotate share one branch when another family is enabled."""
  x = jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  jaxpr = jax.make_jaxpr(lambda k, im: dsa.augment(k, im, strategy))(key, x).jaxpr
  assert _switches(jaxpr) == [(branches, False)]


@pytest.mark.parametrize("first, second", [("scale", "rotate"), ("rotate", "scale")])
def test_merged_resampling_branch_is_each_family(first, second):
  """The shared scale/rotate branch applies the drawn family's own matrix, in either order."""
  x = _images((3, 16, 16, 3))
  strategy = f"flip_{first}_{second}"

  @jax.jit
  def both(key, x):
    p = dsa.draw_params(key, x.shape, strategy)
    param_key = jax.random.split(key)[1]
    return (
      p.family,
      dsa.augment(key, x, strategy),
      {f: dsa.apply_family(param_key, x, f) for f in ("flip", "scale", "rotate")},
    )

  seen = set()
  for key in _keys(24):
    index, out, each = both(key, x)
    family = strategy.split("_")[int(index)]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(each[family]))
    seen.add(family)
  assert seen == {"flip", "scale", "rotate"}


def test_draw_params_refuses_bad_input():
  with raises_field("strategy"):
    dsa.draw_params(jax.random.PRNGKey(0), (2, 8, 8, 1), "none")
  with raises_field("image_shape"):
    dsa.draw_params(jax.random.PRNGKey(0), (8, 8, 1), "flip")
