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
A draw is two steps: :func:`draw_params` draws the family and every family's
parameters (:class:`Params`, a handful of scalars, in a few batched PRNG calls), then
:func:`apply` runs the chosen family's transform in a :func:`jax.lax.switch` whose cases
draw nothing (``scale`` and ``rotate`` share one resampling case). :func:`augment` is the
two together; it works under :func:`jax.jit` and :func:`jax.vmap` (e.g. over a leading
client axis of keys and image batches). The draws are those of one ``jax.random`` call per
parameter (:func:`draw_params` names the keys), so the numbers are those of a family drawing
its own parameters.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

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
  "Params",
  "draw_params",
  "apply",
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
    ConfigError: if a token is not one of :data:`FAMILIES` (the message names
      the bad token and the allowed ones), or a family is repeated.
  """
  stripped = strategy.strip()
  if stripped == "" or stripped.lower() == "none":
    return ()
  tokens = tuple(stripped.split("_"))
  for token in tokens:
    if token not in FAMILIES:
      raise ConfigError(
        "strategy",
        strategy,
        f"families of {FAMILIES}",
        message=f"Unknown DSA augmentation family {token!r} in strategy "
        f"{strategy!r}; allowed families are {', '.join(FAMILIES)} "
        "(joined by '_'), or '' / 'none' for no augmentation.",
      )
  if len(set(tokens)) != len(tokens):
    raise ConfigError(
      "strategy",
      strategy,
      "each family at most once",
      message=f"DSA strategy {strategy!r} repeats a family; each of "
      f"{', '.join(FAMILIES)} may appear at most once.",
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
    raise ConfigError(
      "x",
      x.shape,
      "NHWC images",
      message=f"DSA expects NHWC images of rank 4, got shape {x.shape}.",
    )
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
# The random parameters of a draw
# --------------------------------------------------------------------------


class Params(NamedTuple):
  """The random parameters of one DSA draw: the family and every family's parameters.

  All fields are scalars (under ``vmap``, one per mapped draw). The family's own fields are
  the ones its transform reads; the others are drawn too (from the same bits) and ignored.

  Attributes:
    family: int32, the position of the chosen family in the strategy's families.
    brightness, saturation, contrast: float32, ``color``'s offset and factors.
    dy, dx: int32, ``crop``'s translation (pixels).
    cy, cx: int32, ``cutout``'s centre (pixels).
    flip: bool, whether ``flip`` flips.
    sx, sy: float32, ``scale``'s factors (width, height).
    angle: float32, ``rotate``'s angle (radians).
  """

  family: jax.Array
  brightness: jax.Array
  saturation: jax.Array
  contrast: jax.Array
  dy: jax.Array
  dx: jax.Array
  cy: jax.Array
  cx: jax.Array
  flip: jax.Array
  sx: jax.Array
  sy: jax.Array
  angle: jax.Array


def _family_params(param_key: jax.Array, height: int, width: int) -> tuple[jax.Array, ...]:
  """Every family's parameters from ``param_key``, in the fields' order after ``family``.

  The values are those of one ``jax.random`` call per parameter with the keys below (each
  family on its own would draw them so), computed in three batched draws instead of one or
  three per parameter: ``k0, k1, k2 = split(param_key, 3)`` (``split(param_key, 2)`` is its
  first two keys); ``color``: ``uniform(k0)``, ``uniform(k1)``, ``uniform(k2)``; ``crop`` and
  ``cutout``: ``randint(k0)``, ``randint(k1)`` over their ranges; ``flip``:
  ``uniform(param_key)``; ``scale``: ``uniform(k0)``, ``uniform(k1)`` over ``[1 / 1.2, 1.2)``;
  ``rotate``: ``uniform(param_key)`` over ``[-15, 15)`` degrees.
  """
  k0, k1, k2 = jax.random.split(param_key, 3)
  low, high = 1.0 / RATIO_SCALE, RATIO_SCALE
  limit = math.radians(RATIO_ROTATE)
  # color (3), flip, scale (2), rotate: one batched uniform draw with per-draw bounds.
  uniform_keys = jnp.stack([k0, k1, k2, param_key, k0, k1, param_key])
  lows = jnp.asarray([0.0, 0.0, 0.0, 0.0, low, low, -limit], jnp.float32)
  highs = jnp.asarray([1.0, 1.0, 1.0, 1.0, high, high, limit], jnp.float32)
  u = jax.vmap(lambda k, lo, hi: jax.random.uniform(k, minval=lo, maxval=hi))(
    uniform_keys, lows, highs
  )
  pad_h = int(height * RATIO_CROP_PAD + 0.5)
  pad_w = int(width * RATIO_CROP_PAD + 0.5)
  size_h = int(height * RATIO_CUTOUT + 0.5)
  size_w = int(width * RATIO_CUTOUT + 0.5)
  # crop's shift, then cutout's centre. The centre's range is the authors': [0, side] for an
  # even cutout side, [0, side - 1] for an odd one, so that both borders are reached
  # symmetrically.
  int_keys = jnp.stack([k0, k1, k0, k1])
  int_lows = jnp.asarray([-pad_h, -pad_w, 0, 0], jnp.int32)
  int_highs = jnp.asarray(
    [pad_h + 1, pad_w + 1, height + (1 - size_h % 2), width + (1 - size_w % 2)], jnp.int32
  )
  n = jax.vmap(lambda k, lo, hi: jax.random.randint(k, (), lo, hi))(int_keys, int_lows, int_highs)
  return (
    (u[0] - 0.5) * BRIGHTNESS,
    u[1] * SATURATION,
    u[2] + CONTRAST,
    n[0],
    n[1],
    n[2],
    n[3],
    u[3] < PROB_FLIP,
    u[4],
    u[5],
    u[6],
  )


def draw_params(
  key: jax.Array,
  image_shape: tuple[int, ...],
  strategy: str = DEFAULT_STRATEGY,
  family_key: jax.Array | None = None,
) -> Params:
  """The random parameters :func:`augment` draws from ``key`` for images of ``image_shape``.

  With two or more families, ``choice_key, param_key = split(key)``; the family is
  ``randint(family_key or choice_key, (), 0, len(families))`` and every family's parameters
  come from ``param_key``. With one family there is no choice: ``family`` is 0 and the
  parameters come from ``key`` itself.

  Args:
    key: PRNG key (raw ``uint32[2]`` or typed key).
    image_shape: ``(N, H, W, C)``, the batch's shape (the crop's and cutout's ranges
      depend on ``H`` and ``W``).
    strategy: static DSA strategy string with at least one family.
    family_key: PRNG key that draws the family (default: drawn from ``key``).

  Returns:
    :class:`Params`.

  Raises:
    ConfigError: if ``strategy`` is invalid or enables no family.
  """
  families = parse_strategy(strategy)
  if not families:
    raise ConfigError(
      "strategy",
      strategy,
      "at least one family",
      message=f"DSA strategy {strategy!r} enables no family: there is nothing to draw.",
    )
  if len(image_shape) != 4:
    raise ConfigError(
      "image_shape",
      tuple(image_shape),
      "NHWC, rank 4",
      message=f"DSA expects NHWC images of rank 4, got shape {tuple(image_shape)}.",
    )
  _, h, w, _ = image_shape
  if len(families) == 1:
    return Params(jnp.zeros((), jnp.int32), *_family_params(key, h, w))
  choice_key, param_key = jax.random.split(key)
  if family_key is not None:
    choice_key = family_key
  index = jax.random.randint(choice_key, (), 0, len(families))
  return Params(index, *_family_params(param_key, h, w))


# --------------------------------------------------------------------------
# The families' transforms with drawn parameters
# --------------------------------------------------------------------------


def _apply_color(p: Params, x: jax.Array) -> jax.Array:
  return _color(
    x, p.brightness.astype(x.dtype), p.saturation.astype(x.dtype), p.contrast.astype(x.dtype)
  )


def _apply_crop(p: Params, x: jax.Array) -> jax.Array:
  _, h, w, _ = x.shape
  return _translate(x, p.dy, p.dx, int(h * RATIO_CROP_PAD + 0.5), int(w * RATIO_CROP_PAD + 0.5))


def _apply_cutout(p: Params, x: jax.Array) -> jax.Array:
  _, h, w, _ = x.shape
  return _cutout(x, p.cy, p.cx, int(h * RATIO_CUTOUT + 0.5), int(w * RATIO_CUTOUT + 0.5))


def _apply_flip(p: Params, x: jax.Array) -> jax.Array:
  return _flip(x, p.flip)


def _apply_scale(p: Params, x: jax.Array) -> jax.Array:
  return _affine_sample(x, _scale_theta(p.sx, p.sy))


def _apply_rotate(p: Params, x: jax.Array) -> jax.Array:
  return _affine_sample(x, _rotate_theta(p.angle))


_APPLY_FNS: dict[str, Callable[[Params, jax.Array], jax.Array]] = {
  "color": _apply_color,
  "crop": _apply_crop,
  "cutout": _apply_cutout,
  "flip": _apply_flip,
  "scale": _apply_scale,
  "rotate": _apply_rotate,
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
    ConfigError: if ``family`` is unknown or ``x`` is not rank 4.
  """
  if family not in _APPLY_FNS:
    raise ConfigError(
      "family",
      family,
      str(FAMILIES),
      message=f"Unknown DSA augmentation family {family!r}; allowed families are "
      f"{', '.join(FAMILIES)}.",
    )
  _check_images(x)
  return _APPLY_FNS[family](draw_params(key, x.shape, family), x).astype(x.dtype)


def _apply_affine(families: tuple[str, ...], p: Params, x: jax.Array) -> jax.Array:
  """``scale`` or ``rotate`` as one resampling: the family's matrix, then one bilinear pass."""
  theta = jnp.where(
    p.family == families.index("scale"), _scale_theta(p.sx, p.sy), _rotate_theta(p.angle)
  )
  return _affine_sample(x, theta)


@functools.lru_cache(maxsize=None)
def _switch_cases(families: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[Callable, ...]]:
  """``(the switch case of each family, the case functions for lax.switch)`` for ``families``.

  ``scale`` and ``rotate``, when both are enabled with another family, share one case (:func:`_apply_affine`:
  one copy of the bilinear resampling, and of its gradient, instead of two). Cached so that
  the same function objects are reused on every call, which lets JAX reuse its traced
  cases when :func:`apply` runs eagerly.
  """
  # Merged only where another family keeps the switch a switch: a one-case switch is no
  # conditional, and XLA would fuse the resampling into the caller's program.
  merged = "scale" in families and "rotate" in families and len(families) > 2
  case_of: list[int] = []
  fns: list[Callable] = []
  for f in families:
    if merged and f in ("scale", "rotate"):
      other = families.index("rotate" if f == "scale" else "scale")
      if other < len(case_of):  # the affine case exists already
        case_of.append(case_of[other])
        continue
      case_of.append(len(fns))
      fns.append(functools.partial(_apply_affine, families))
      continue
    case_of.append(len(fns))
    fns.append(_APPLY_FNS[f])

  def cast(fn):
    return lambda p, x: fn(p, x).astype(x.dtype)

  return tuple(case_of), tuple(cast(fn) for fn in fns)


def apply(params: Params, x: jax.Array, strategy: str = DEFAULT_STRATEGY) -> jax.Array:
  """Applies the family ``params.family`` of ``strategy`` with the drawn ``params``.

  ``apply(draw_params(key, x.shape, strategy, family_key), x, strategy)`` is
  :func:`augment`; two batches of one shape given the same ``params`` get the identical
  transform (Siamese augmentation) without drawing twice.

  Args:
    params: :class:`Params` from :func:`draw_params` for ``x``'s shape and ``strategy``.
    x: ``(N, H, W, C)`` floating-point images.
    strategy: static DSA strategy string; ``""`` or ``"none"`` gives the identity.

  Returns:
    ``(N, H, W, C)`` augmented images of ``x.dtype``.
  """
  families = parse_strategy(strategy)
  _check_images(x)
  if not families:
    return x
  if len(families) == 1:
    return _APPLY_FNS[families[0]](params, x).astype(x.dtype)
  case_of, cases = _switch_cases(families)
  index = params.family
  if case_of != tuple(range(len(families))):
    index = jnp.asarray(case_of, jnp.int32)[index]
  return lax.switch(index, cases, params, x)


def augment(
  key: jax.Array,
  x: jax.Array,
  strategy: str = DEFAULT_STRATEGY,
  family_key: jax.Array | None = None,
) -> jax.Array:
  """Applies one randomly chosen DSA family to a batch of images: :func:`apply` of
  :func:`draw_params` (module docstring: one family and one draw of its parameters per batch,
  so two batches augmented with one key get the identical transform). Jit- and vmap-able.

  ``family_key`` (optional) draws the family instead of ``key`` (its parameters still come
  from ``key``): clients run side by side under ``vmap`` pass one shared ``family_key`` and
  their own ``key``, so ``lax.switch`` computes one family, not all of them; each client still
  gets every family with probability ``1 / len(families)``. With a single enabled family no
  choice is drawn: ``augment(key, x, "flip")`` equals ``apply_family(key, x, "flip")``.

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
  return apply(draw_params(key, x.shape, strategy, family_key), x, strategy)


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
