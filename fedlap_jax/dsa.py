"""Differentiable Siamese Augmentation (DSA).

JAX port of the augmentation used for dataset condensation by gradient
matching, from Zhao & Bilen, "Dataset Condensation with Differentiable
Siamese Augmentation", ICML 2021 (the ``DiffAugment`` / ``ParamDiffAug`` code
of the authors, in its single-transform ``'S'`` mode with Siamese parameter
sharing).

Every call of :func:`augment` picks **one** family uniformly at random among
the enabled ones and draws that family's parameters **once per batch**: every
image of the batch gets the identical transform.  Callers that match gradients
between a real and a synthetic batch pass the *same* key for both batches so
the two are augmented identically ("Siamese"), which is what makes the
matching loss meaningful.

Families (strategy tokens, joined with ``"_"``):

``color``
    brightness ``x + U(-0.5, 0.5)``, then saturation ``(x - m) * U(0, 2) + m``
    with ``m`` the per-pixel mean over channels, then contrast
    ``(x - m) * U(0.5, 1.5) + m`` with ``m`` the per-image mean over H, W, C.
``crop``
    integer translation by ``(dy, dx)``, each uniform in ``[-s, s]`` with
    ``s = int(side * 0.125 + 0.5)`` per axis, zero fill.
``cutout``
    zero an axis-aligned ``int(H * 0.5 + 0.5) x int(W * 0.5 + 0.5)`` square at
    a random centre; the parts falling outside the image are clipped.
``flip``
    horizontal (width-axis) flip with probability 0.5.
``scale``
    independent x/y scale factors ``U(1/1.2, 1.2)`` about the image centre.
``rotate``
    rotation by ``U(-15, 15)`` degrees about the image centre.

``scale`` and ``rotate`` resample bilinearly with zero padding outside the
image, using the normalised-coordinate affine grid convention of PyTorch's
``affine_grid`` / ``grid_sample`` with ``align_corners=True`` (as the authors
do).  All transforms are differentiable with respect to the images; the
random parameters themselves are not differentiated.

Images are ``(N, H, W, C)`` floating-point arrays (NHWC, already normalised).
The dispatch uses :func:`jax.random.randint` + :func:`jax.lax.switch`, so
:func:`augment` works under :func:`jax.jit` and :func:`jax.vmap` (e.g. over a
leading client axis of keys and image batches).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fedlap_jax.checks import ConfigError, require

__all__ = [
  "FAMILIES",
  "DEFAULT_STRATEGY",
  "parse_strategy",
  "check_strategy",
  "augment",
  "apply_family",
  "make_augment_fn",
]

FAMILIES: tuple[str, ...] = ("color", "crop", "cutout", "flip", "scale", "rotate")
DEFAULT_STRATEGY = "color_crop_cutout_flip_scale_rotate"

# Hyper-parameters of the authors' ``ParamDiffAug``.
PROB_FLIP = 0.5  # probability of a horizontal flip
RATIO_SCALE = 1.2  # scale factors are drawn from U(1 / RATIO_SCALE, RATIO_SCALE)
RATIO_ROTATE = 15.0  # rotation angles are drawn from U(-RATIO_ROTATE, RATIO_ROTATE) degrees
RATIO_CROP_PAD = 0.125  # maximal translation, as a fraction of the side length
RATIO_CUTOUT = 0.5  # cutout side, as a fraction of the image side
BRIGHTNESS = 1.0  # brightness offset drawn from U(-BRIGHTNESS / 2, BRIGHTNESS / 2)
SATURATION = 2.0  # saturation factor drawn from U(0, SATURATION)
CONTRAST = 0.5  # contrast factor drawn from U(CONTRAST, CONTRAST + 1)

AugmentFn = Callable[[jax.Array, jax.Array], jax.Array]


# --------------------------------------------------------------------------
# Strategy parsing
# --------------------------------------------------------------------------


def parse_strategy(strategy: str) -> tuple[str, ...]:
  """Splits a DSA strategy string into its family names.

  Args:
    strategy: family names joined by ``"_"``, e.g. ``"color_crop"``.  The
      empty string and ``"none"`` (any case) mean "no augmentation".

  Returns:
    The family names in the given order, e.g. ``("color", "crop")``; ``()``
    for no augmentation.

  Raises:
    ValueError: if a token is not one of :data:`FAMILIES` (the message names
      the bad token and the allowed ones), or a family is repeated.
  """
  stripped = strategy.strip()
  if stripped == "" or stripped.lower() == "none":
    return ()
  tokens = tuple(stripped.split("_"))
  for token in tokens:
    if token not in FAMILIES:
      raise ValueError(
        f"Unknown DSA augmentation family {token!r} in strategy "
        f"{strategy!r}; allowed families are {', '.join(FAMILIES)} "
        "(joined by '_'), or '' / 'none' for no augmentation."
      )
  if len(set(tokens)) != len(tokens):
    raise ValueError(
      f"DSA strategy {strategy!r} repeats a family; each of "
      f"{', '.join(FAMILIES)} may appear at most once."
    )
  return tokens


# --------------------------------------------------------------------------
# Deterministic transforms (explicit parameters)
# --------------------------------------------------------------------------


def check_strategy(field: str, value) -> None:
  """Refuses ``value`` for config field ``field`` unless :func:`parse_strategy` accepts it.

  Raises:
    ConfigError: naming ``field``, the value and what is allowed (the bad family named).
  """
  allowed = "a string of DSA families joined by '_'"
  require(isinstance(value, str), field, value, allowed)
  try:
    parse_strategy(value)
  except ValueError as e:
    raise ConfigError(field, value, allowed, message=f"{field}={value!r} is invalid: {e}") from None


def _check_images(x: jax.Array) -> None:
  if x.ndim != 4:
    raise ValueError(f"DSA expects NHWC images of rank 4, got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"DSA expects floating-point images, got dtype {x.dtype}.")


def _color(
  x: jax.Array, brightness: jax.Array, saturation: jax.Array, contrast: jax.Array
) -> jax.Array:
  """Brightness, saturation then contrast jitter with scalar parameters.

  Args:
    x: ``(N, H, W, C)`` images.
    brightness: scalar offset added to every value.
    saturation: scalar factor on the deviation from the per-pixel channel mean.
    contrast: scalar factor on the deviation from the per-image mean.

  Returns:
    ``(N, H, W, C)`` images.
  """
  x = x + brightness
  pixel_mean = jnp.mean(x, axis=3, keepdims=True)
  x = (x - pixel_mean) * saturation + pixel_mean
  image_mean = jnp.mean(x, axis=(1, 2, 3), keepdims=True)
  return (x - image_mean) * contrast + image_mean


def _translate(x: jax.Array, dy: jax.Array, dx: jax.Array, pad_h: int, pad_w: int) -> jax.Array:
  """Integer translation with zero fill: ``out[:, i, j] = x[:, i + dy, j + dx]``.

  Args:
    x: ``(N, H, W, C)`` images.
    dy, dx: integer scalars (pixels), ``|dy| <= pad_h`` and ``|dx| <= pad_w``.
    pad_h, pad_w: static zero-padding (pixels) that bounds the shift.

  Returns:
    ``(N, H, W, C)`` images; pixels shifted in from outside are zero.
  """
  padded = jnp.pad(x, ((0, 0), (pad_h, pad_h), (pad_w, pad_w), (0, 0)))
  zero = jnp.zeros((), jnp.int32)
  start = (zero, pad_h + dy.astype(jnp.int32), pad_w + dx.astype(jnp.int32), zero)
  return lax.dynamic_slice(padded, start, x.shape)


def _cutout(x: jax.Array, cy: jax.Array, cx: jax.Array, size_h: int, size_w: int) -> jax.Array:
  """Zeros the ``size_h x size_w`` rectangle centred at row ``cy``, column ``cx``.

  The rectangle covers rows ``[cy - size_h // 2, cy - size_h // 2 + size_h)``
  and the analogous columns; the part outside the image is clipped.

  Args:
    x: ``(N, H, W, C)`` images.
    cy, cx: integer scalars, the centre (pixels).
    size_h, size_w: static side lengths (pixels).

  Returns:
    ``(N, H, W, C)`` images, the same rectangle zeroed in every image.
  """
  _, h, w, _ = x.shape
  top = cy - size_h // 2
  left = cx - size_w // 2
  rows = lax.broadcasted_iota(jnp.int32, (h, w), 0)
  cols = lax.broadcasted_iota(jnp.int32, (h, w), 1)
  inside = (rows >= top) & (rows < top + size_h) & (cols >= left) & (cols < left + size_w)
  mask = jnp.where(inside, 0, 1).astype(x.dtype)
  return x * mask[None, :, :, None]


def _flip(x: jax.Array, do_flip: jax.Array) -> jax.Array:
  """Flips the width axis of every image when the boolean scalar ``do_flip`` holds."""
  return jnp.where(do_flip, jnp.flip(x, axis=2), x)


def _affine_sample(x: jax.Array, theta: jax.Array) -> jax.Array:
  """Bilinear affine resampling with zero padding (``grid_sample`` semantics).

  Follows PyTorch's ``affine_grid`` + ``grid_sample(align_corners=True)``:
  output pixel ``(i, j)`` has normalised coordinates
  ``u = 2 j / (W - 1) - 1`` (width) and ``v = 2 i / (H - 1) - 1`` (height),
  both in ``[-1, 1]`` with ``0`` at the image centre, and reads the input at
  the normalised coordinates ``theta @ (u, v, 1)``.  Sampling points outside
  the image contribute zeros.  ``theta = [[1, 0, 0], [0, 1, 0]]`` is the
  identity.

  Args:
    x: ``(N, H, W, C)`` images.
    theta: ``(2, 3)`` affine matrix acting on (width, height, 1) normalised
      coordinates.

  Returns:
    ``(N, H, W, C)`` images of ``x.dtype``.
  """
  _, h, w, _ = x.shape
  theta = jnp.asarray(theta, jnp.float32)
  v, u = jnp.meshgrid(
    jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32),
    jnp.linspace(-1.0, 1.0, w, dtype=jnp.float32),
    indexing="ij",
  )
  src_u = theta[0, 0] * u + theta[0, 1] * v + theta[0, 2]
  src_v = theta[1, 0] * u + theta[1, 1] * v + theta[1, 2]
  # Back to pixel coordinates (align_corners=True).
  px = (src_u + 1.0) * (w - 1) / 2.0
  py = (src_v + 1.0) * (h - 1) / 2.0

  x0 = jnp.floor(px)
  y0 = jnp.floor(py)
  wx1 = px - x0
  wy1 = py - y0
  wx0 = 1.0 - wx1
  wy0 = 1.0 - wy1
  x0 = x0.astype(jnp.int32)
  y0 = y0.astype(jnp.int32)

  def tap(yi: jax.Array, xi: jax.Array, weight: jax.Array) -> jax.Array:
    valid = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
    weight = jnp.where(valid, weight, 0.0).astype(x.dtype)
    values = x[:, jnp.clip(yi, 0, h - 1), jnp.clip(xi, 0, w - 1), :]
    return values * weight[None, :, :, None]

  return (
    tap(y0, x0, wy0 * wx0)
    + tap(y0, x0 + 1, wy0 * wx1)
    + tap(y0 + 1, x0, wy1 * wx0)
    + tap(y0 + 1, x0 + 1, wy1 * wx1)
  )


def _scale_theta(sx: jax.Array, sy: jax.Array) -> jax.Array:
  """``(2, 3)`` affine matrix scaling sampling coordinates by ``sx`` (width), ``sy`` (height).

  Factors above one sample a larger region, i.e. shrink the content.
  """
  sx = jnp.asarray(sx, jnp.float32)
  sy = jnp.asarray(sy, jnp.float32)
  zero = jnp.zeros((), jnp.float32)
  return jnp.stack([jnp.stack([sx, zero, zero]), jnp.stack([zero, sy, zero])])


def _rotate_theta(angle: jax.Array) -> jax.Array:
  """``(2, 3)`` affine matrix rotating about the image centre; ``angle`` in radians."""
  angle = jnp.asarray(angle, jnp.float32)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  zero = jnp.zeros((), jnp.float32)
  return jnp.stack([jnp.stack([cos, sin, zero]), jnp.stack([-sin, cos, zero])])


# --------------------------------------------------------------------------
# Random families (parameters drawn once per batch from the key)
# --------------------------------------------------------------------------


def _random_color(key: jax.Array, x: jax.Array) -> jax.Array:
  kb, ks, kc = jax.random.split(key, 3)
  brightness = (jax.random.uniform(kb) - 0.5) * BRIGHTNESS
  saturation = jax.random.uniform(ks) * SATURATION
  contrast = jax.random.uniform(kc) + CONTRAST
  return _color(x, brightness.astype(x.dtype), saturation.astype(x.dtype), contrast.astype(x.dtype))


def _random_crop(key: jax.Array, x: jax.Array) -> jax.Array:
  _, h, w, _ = x.shape
  pad_h = int(h * RATIO_CROP_PAD + 0.5)
  pad_w = int(w * RATIO_CROP_PAD + 0.5)
  ky, kx = jax.random.split(key)
  dy = jax.random.randint(ky, (), -pad_h, pad_h + 1)
  dx = jax.random.randint(kx, (), -pad_w, pad_w + 1)
  return _translate(x, dy, dx, pad_h, pad_w)


def _random_cutout(key: jax.Array, x: jax.Array) -> jax.Array:
  _, h, w, _ = x.shape
  size_h = int(h * RATIO_CUTOUT + 0.5)
  size_w = int(w * RATIO_CUTOUT + 0.5)
  ky, kx = jax.random.split(key)
  # Centre range as in the authors' code: [0, side] for an even cutout side,
  # [0, side - 1] for an odd one, so that both image borders are reached
  # symmetrically.
  cy = jax.random.randint(ky, (), 0, h + (1 - size_h % 2))
  cx = jax.random.randint(kx, (), 0, w + (1 - size_w % 2))
  return _cutout(x, cy, cx, size_h, size_w)


def _random_flip(key: jax.Array, x: jax.Array) -> jax.Array:
  return _flip(x, jax.random.uniform(key) < PROB_FLIP)


def _random_scale(key: jax.Array, x: jax.Array) -> jax.Array:
  ksx, ksy = jax.random.split(key)
  low, high = 1.0 / RATIO_SCALE, RATIO_SCALE
  sx = jax.random.uniform(ksx, minval=low, maxval=high)
  sy = jax.random.uniform(ksy, minval=low, maxval=high)
  return _affine_sample(x, _scale_theta(sx, sy))


def _random_rotate(key: jax.Array, x: jax.Array) -> jax.Array:
  limit = math.radians(RATIO_ROTATE)
  angle = jax.random.uniform(key, minval=-limit, maxval=limit)
  return _affine_sample(x, _rotate_theta(angle))


_FAMILY_FNS: dict[str, AugmentFn] = {
  "color": _random_color,
  "crop": _random_crop,
  "cutout": _random_cutout,
  "flip": _random_flip,
  "scale": _random_scale,
  "rotate": _random_rotate,
}


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def apply_family(key: jax.Array, x: jax.Array, family: str) -> jax.Array:
  """Applies one named DSA family with parameters drawn from ``key``.

  Args:
    key: PRNG key; the same key gives the same transform for any batch.
    x: ``(N, H, W, C)`` floating-point images.
    family: one of :data:`FAMILIES` (static Python string).

  Returns:
    ``(N, H, W, C)`` augmented images of ``x.dtype``.

  Raises:
    ValueError: if ``family`` is unknown or ``x`` is not rank 4.
  """
  if family not in _FAMILY_FNS:
    raise ValueError(
      f"Unknown DSA augmentation family {family!r}; allowed families are {', '.join(FAMILIES)}."
    )
  _check_images(x)
  return _FAMILY_FNS[family](key, x).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _branches(families: tuple[str, ...]) -> tuple[AugmentFn, ...]:
  """The ``lax.switch`` branches for ``families``.

  Cached so that the same function objects are reused on every call, which
  lets JAX reuse its traced branches when :func:`augment` runs eagerly.
  """
  return tuple(functools.partial(apply_family, family=f) for f in families)


def augment(
  key: jax.Array,
  x: jax.Array,
  strategy: str = DEFAULT_STRATEGY,
  family_key: jax.Array | None = None,
) -> jax.Array:
  """Applies one randomly chosen DSA family to a batch of images.

  The family is drawn uniformly among those enabled by ``strategy`` and its
  parameters are drawn once for the whole batch, so that two batches
  augmented with the same key receive the identical transform (Siamese
  augmentation).  The choice uses ``jax.random.randint`` + ``lax.switch``,
  so the function can be jitted and vmapped (over keys and images).  With a
  single enabled family no choice is drawn: ``augment(key, x, "flip")``
  equals ``apply_family(key, x, "flip")``.

  ``family_key`` (optional) draws the family instead of ``key``; the
  family's parameters still come from ``key``. Clients run side by side
  under ``vmap`` pass one ``family_key`` shared by all of them (not mapped)
  and their own ``key``: the family index is then not batched and
  ``lax.switch`` computes one family, not all of them. Each client still
  gets every family with probability ``1 / len(families)`` and its own
  parameters; only the choice of family is common to the clients.

  Args:
    key: PRNG key (raw ``uint32[2]`` or typed key).
    x: ``(N, H, W, C)`` floating-point images (NHWC, already normalised).
    strategy: static DSA strategy string, e.g.
      ``"color_crop_cutout_flip_scale_rotate"``; ``""`` or ``"none"`` gives
      the identity.
    family_key: PRNG key that draws the family (default: drawn from ``key``).

  Returns:
    ``(N, H, W, C)`` augmented images of ``x.dtype``.
  """
  families = parse_strategy(strategy)
  _check_images(x)
  if not families:
    return x
  if len(families) == 1:
    return apply_family(key, x, families[0])
  choice_key, param_key = jax.random.split(key)
  if family_key is not None:
    choice_key = family_key
  index = jax.random.randint(choice_key, (), 0, len(families))
  return lax.switch(index, _branches(families), param_key, x)


def make_augment_fn(strategy: str = DEFAULT_STRATEGY) -> AugmentFn:
  """Returns ``fn(key, x, family_key=None) -> x'`` applying :func:`augment` with a fixed strategy.

  The strategy is parsed (and validated) once, here.  For an empty strategy
  (``""`` or ``"none"``) the returned function is the identity and ignores
  the key.

  Args:
    strategy: DSA strategy string.

  Returns:
    A function mapping a PRNG key and ``(N, H, W, C)`` images to augmented
    ``(N, H, W, C)`` images of the same dtype.
  """
  if not parse_strategy(strategy):

    def identity(key, x, family_key=None):
      del key, family_key
      return x

    return identity
  return functools.partial(augment, strategy=strategy)
