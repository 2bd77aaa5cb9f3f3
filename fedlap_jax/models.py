"""The ConvNet of the dataset-condensation literature, as used by FedLAP-DP, and a ScatterNet
(a fixed wavelet scattering front end and a small trained head, :class:`ScatterNet`).

``depth x [Conv 3x3 (width filters, padding 1) -> norm -> ReLU -> AvgPool 2x2]``,
flatten, Dense to the classes. For 1-channel 28x28 inputs (MNIST, Fashion-MNIST)
the first convolution sees the image zero-padded by 3 (so the feature map is
32x32, as for CIFAR); we pad explicitly with ``jnp.pad`` and keep ``padding=1``
in the convolution, which is the same function and compiles to a much faster
kernel on XLA:CPU.

The default norm is instance norm (``GroupNorm`` with one channel per group):
it normalises each example on its own, so per-example gradients, and hence
record-level DP, are well defined. BatchNorm would mix examples and is not
offered.

Parameter counts with the default width 128, depth 3, 10 classes:
317,706 for 28x28x1 inputs and 320,010 for 32x32x3 inputs.

Implementation (``impl``), the same function and parameters either way:

* ``"flax"``: ``nn.Conv`` (XLA's convolution) and ``nn.GroupNorm``;
* ``"im2col"``: every convolution is one matrix product on image patches
  (:func:`conv_im2col`), forward and backward;
* ``"hybrid"``: XLA's convolution forward, matrix products on patches backward
  (:func:`conv_hybrid`, a ``custom_vjp``; reverse mode only, no ``jvp``);
* ``"auto"`` (default): ``"hybrid"`` on CPU, ``"flax"`` on other backends.

``"im2col"`` and ``"hybrid"`` compute instance norm in one fused pass
(:class:`InstanceNorm`, stored under the same ``GroupNorm_i`` names). On
XLA:CPU the convolution's weight gradient, and above all the
gradient-of-gradient of the synthetic-image update, are several times faster
as matrix products, while XLA's forward convolution is the fastest forward
(evaluation); docs/benchmarks.md has the measurements.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedlap_jax.checks import ConfigError
from fedlap_jax.setup_jit import setup_jit

NORMS = ("instance", "group", "none")
IMPLS = ("auto", "flax", "im2col", "hybrid")

_NHWC = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))


def im2col_patches(
  x: jax.Array,
  kernel_hw: tuple[int, int],
  *,
  strides: tuple[int, int] = (1, 1),
  dilation: tuple[int, int] = (1, 1),
  padding: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0)),
) -> jax.Array:
  """Image patches ``(N, H_out, W_out, kh * kw * C)`` of NHWC images.

  The last axis is ordered ``(kh, kw, C)``, matching an HWIO kernel reshaped
  to ``(kh * kw * C, O)``: ``conv(x, k) == patches @ k.reshape(-1, O)``.
  """
  kh, kw = kernel_hw
  xp = jnp.pad(x, ((0, 0), tuple(padding[0]), tuple(padding[1]), (0, 0)))
  ho = (xp.shape[1] - (kh - 1) * dilation[0] - 1) // strides[0] + 1
  wo = (xp.shape[2] - (kw - 1) * dilation[1] - 1) // strides[1] + 1
  cols = [
    lax.slice(
      xp,
      (0, u * dilation[0], v * dilation[1], 0),
      (
        xp.shape[0],
        u * dilation[0] + (ho - 1) * strides[0] + 1,
        v * dilation[1] + (wo - 1) * strides[1] + 1,
        xp.shape[3],
      ),
      (1, strides[0], strides[1], 1),
    )
    for u in range(kh)
    for v in range(kw)
  ]
  return cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)


def conv_im2col(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count=1,
  precision=None,
  **kwargs,
):
  """``lax.conv_general_dilated`` for 2-D NHWC/HWIO convolutions as a patch matmul.

  A drop-in ``conv_general_dilated`` for ``nn.Conv``: the same function, but
  forward and both backward passes (and the backward of the backward, which
  the synthetic-image update needs) become plain matrix products, which
  XLA:CPU runs several times faster than its convolution kernels. Anything
  else (other layouts, feature groups, input dilation, string padding) goes
  to ``lax.conv_general_dilated`` unchanged.
  """

  def canon(v):
    return (1, 1) if v is None else tuple(v)

  dn = dimension_numbers
  if (
    lhs.ndim != 4
    or rhs.ndim != 4
    or feature_group_count != 1
    or kwargs
    or canon(lhs_dilation) != (1, 1)
    or isinstance(padding, str)
    or not (dn == _NHWC or dn == ("NHWC", "HWIO", "NHWC"))
  ):
    return lax.conv_general_dilated(
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count,
      precision=precision,
      **kwargs,
    )
  kh, kw, c, o = rhs.shape
  patches = im2col_patches(
    lhs,
    (kh, kw),
    strides=canon(window_strides),
    dilation=canon(rhs_dilation),
    padding=tuple(padding),
  )
  n, ho, wo, k = patches.shape
  out = jnp.dot(patches.reshape(n * ho * wo, k), rhs.reshape(kh * kw * c, o), precision=precision)
  return out.reshape(n, ho, wo, o)


def _col2im(dpatches: jax.Array, x_shape, kernel_hw, padding) -> jax.Array:
  """Adjoint of :func:`im2col_patches` for stride 1, dilation 1: ``(N, Ho, Wo, kh kw C) -> x``."""
  n, h, w, c = x_shape
  kh, kw = kernel_hw
  (pt, pb), (pl, pr) = padding
  ho, wo = dpatches.shape[1:3]
  hp, wp = h + pt + pb, w + pl + pr
  d = dpatches.reshape(n, ho, wo, kh * kw, c)
  out = cast(
    jax.Array,
    sum(
      jnp.pad(d[:, :, :, u * kw + v, :], ((0, 0), (u, hp - ho - u), (v, wp - wo - v), (0, 0)))
      for u in range(kh)
      for v in range(kw)
    ),
  )
  return out[:, pt : pt + h, pl : pl + w, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_hybrid(x: jax.Array, kernel: jax.Array, padding) -> jax.Array:
  return lax.conv_general_dilated(
    x, kernel, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _conv_hybrid_fwd(x, kernel, padding):
  return _conv_hybrid(x, kernel, padding), (x, kernel)


def _conv_hybrid_bwd(padding, residuals, g):
  x, kernel = residuals
  kh, kw, c, o = kernel.shape
  patches = im2col_patches(x, (kh, kw), padding=padding)
  n, ho, wo, k = patches.shape
  g2 = g.reshape(-1, o)
  dkernel = (patches.reshape(-1, k).T @ g2).reshape(kernel.shape)
  dpatches = (g2 @ kernel.reshape(k, o).T).reshape(n, ho, wo, k)
  return _col2im(dpatches, x.shape, (kh, kw), padding), dkernel


_conv_hybrid.defvjp(_conv_hybrid_fwd, _conv_hybrid_bwd)


def conv_hybrid(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count=1,
  precision=None,
  **kwargs,
):
  """``lax.conv_general_dilated`` with XLA's forward and an im2col-matmul backward.

  A drop-in ``conv_general_dilated`` for ``nn.Conv`` (stride 1, no dilation,
  explicit padding, NHWC/HWIO; anything else goes to
  :func:`conv_im2col`). The backward pass (and the backward of the backward)
  are matrix products on patches; forward-mode differentiation (``jvp``) is
  not defined for it.
  """

  def canon(v):
    return (1, 1) if v is None else tuple(v)

  dn = dimension_numbers
  if (
    lhs.ndim != 4
    or rhs.ndim != 4
    or feature_group_count != 1
    or kwargs
    or precision is not None
    or canon(lhs_dilation) != (1, 1)
    or canon(rhs_dilation) != (1, 1)
    or canon(window_strides) != (1, 1)
    or isinstance(padding, str)
    or not (dn == _NHWC or dn == ("NHWC", "HWIO", "NHWC"))
  ):
    return conv_im2col(
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count,
      precision=precision,
      **kwargs,
    )
  return _conv_hybrid(lhs, rhs, tuple(tuple(int(q) for q in p) for p in padding))


class InstanceNorm(nn.Module):
  """Instance norm over H, W per example and channel, with a learned scale and bias.

  The same function as ``nn.GroupNorm(num_groups=C)`` (fast variance
  ``E[x^2] - E[x]^2`` clipped at 0), written as ``x * a + b`` with per-(example,
  channel) ``a, b`` so that XLA fuses it into one pass. Parameters ``scale``
  (ones) and ``bias`` (zeros), shaped ``(C,)`` like GroupNorm's.
  """

  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    axes = tuple(range(1, x.ndim - 1))
    mean = jnp.mean(x, axes, keepdims=True)
    mean2 = jnp.mean(jnp.square(x), axes, keepdims=True)
    var = jnp.maximum(0.0, mean2 - jnp.square(mean))
    a = lax.rsqrt(var + self.epsilon) * scale
    return x * a + (bias - mean * a)


def resolve_impl(impl: str) -> str:
  """``"auto"`` -> ``"hybrid"`` on the CPU backend, ``"flax"`` elsewhere."""
  if impl not in IMPLS:
    raise ConfigError(
      "ConvNet.impl", impl, str(IMPLS), message=f"ConvNet.impl={impl!r}; allowed: {IMPLS}"
    )
  if impl == "auto":
    return "hybrid" if jax.default_backend() == "cpu" else "flax"
  return impl


# The reference ConvNet uses padding 3 on 1-channel 28x28 inputs: 2 before the first block,
# 1 in the convolution.
_PADDED_SHAPE, _PAD = (28, 28, 1), 2


def max_depth(image_shape: tuple[int, ...]) -> int:
  """The most conv blocks a :class:`ConvNet` can stack on ``(H, W, C)`` images.

  Each block halves the side (2x2 average pooling) and must keep at least one pixel; 1-channel
  28x28 images are padded to 32x32 first.
  """
  h, w = image_shape[:2]
  if tuple(image_shape) == _PADDED_SHAPE:
    h, w = h + 2 * _PAD, w + 2 * _PAD
  return int(min(h, w)).bit_length() - 1


class ConvNet(nn.Module):
  """ConvNet-`width` with `depth` conv blocks.

  Attributes:
    num_classes: number of output logits.
    width: filters per convolution (128 in the paper).
    depth: number of conv blocks (3 in the paper).
    norm: ``"instance"`` (GroupNorm, one channel per group, default),
      ``"group"`` (GroupNorm with ``num_groups`` groups) or ``"none"``.
    num_groups: groups for ``norm="group"``.
    impl: ``"auto"`` (default), ``"flax"``, ``"im2col"`` or ``"hybrid"``; see the module
      docstring (the function and the parameters do not depend on it).
    conv_bias: give the convolutions a bias (default, as the authors' model).
      Before instance norm the bias does nothing (the norm subtracts each
      channel's mean), so ``False`` is the same function with ``width * depth``
      fewer parameters. Its gradient is then exactly zero instead of float
      noise: under DP that noise, divided by the tiny norm of the synthetic
      bias gradient in the cosine distance, makes a 14% error in the float32
      synthetic-image gradient (against float64; 6e-7 without the bias;
      docs/benchmarks.md).
    activation: the elementwise function after each norm (``nn.relu``, the paper's);
      ``jnp.tanh`` is the bounded activation Papernot et al. (2021) found better under
      DP-SGD.
  """

  num_classes: int = 10
  width: int = 128
  depth: int = 3
  norm: str = "instance"
  num_groups: int = 4
  impl: str = "auto"
  conv_bias: bool = True
  activation: Callable[[jax.Array], jax.Array] = nn.relu

  @nn.compact
  def __call__(self, x: jax.Array, return_features: bool = False):
    """Maps images ``(N, H, W, C)`` (float, normalised) to logits ``(N, classes)``.

    With ``return_features=True`` returns ``(features, logits)``, ``features``
    the flattened output of the last conv block ``(N, D)`` (the embedding of
    distribution matching; :func:`embed_fn`).
    """
    if self.norm not in NORMS:
      raise ConfigError(
        "ConvNet.norm",
        self.norm,
        str(NORMS),
        message=f"ConvNet.norm={self.norm!r}; allowed: {NORMS}",
      )
    for field, least in (("num_classes", 1), ("width", 1), ("depth", 0)):
      value = getattr(self, field)
      if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ConfigError(
          f"ConvNet.{field}",
          value,
          f"an integer >= {least}",
          message=f"ConvNet.{field}={value!r}; allowed: an integer >= {least}",
        )
    if x.ndim != 4:
      raise ConfigError(
        "x", x.shape, "NHWC images", message=f"ConvNet expects NHWC images, got shape {x.shape}"
      )
    given, allowed = f"{x.shape[1]}x{x.shape[2]}", max_depth(x.shape[1:])
    if x.shape[1:] == _PADDED_SHAPE:
      x = jnp.pad(x, ((0, 0), (_PAD, _PAD), (_PAD, _PAD), (0, 0)))
    if self.depth > allowed:
      raise ConfigError(
        "ConvNet.depth",
        self.depth,
        f"at most {allowed}",
        message=f"ConvNet.depth={self.depth} is too deep for {given} images (each block halves "
        f"the side of {x.shape[1]}x{x.shape[2]}); allowed: at most {allowed}",
      )
    impl = resolve_impl(self.impl)
    fast = impl != "flax"
    conv = {"flax": None, "im2col": conv_im2col, "hybrid": conv_hybrid}[impl]
    for i in range(self.depth):
      x = nn.Conv(
        self.width, (3, 3), padding=1, use_bias=self.conv_bias, conv_general_dilated=conv
      )(x)
      if self.norm == "instance" and fast:
        x = InstanceNorm(epsilon=1e-5, name=f"GroupNorm_{i}")(x)
      elif self.norm == "instance":
        x = nn.GroupNorm(num_groups=self.width, epsilon=1e-5)(x)
      elif self.norm == "group":
        x = nn.GroupNorm(num_groups=self.num_groups, epsilon=1e-5)(x)
      x = self.activation(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    logits = nn.Dense(self.num_classes)(x)
    return (x, logits) if return_features else logits


def embed_fn(model: nn.Module):
  """``embed(params, x) -> (features, logits)`` of a :class:`ConvNet`, both ``(N, ...)``.

  The embedding FedDM matches (:mod:`fedlap_jax.methods.feddm.distribution_matching`): the
  penultimate features and the logits, from one forward pass. Any model can supply its own
  function with per-example outputs of this form.
  """
  return lambda params, x: model.apply({"params": params}, x, return_features=True)


def init_fn(model: nn.Module, image_shape: tuple[int, ...]):
  """``init(key) -> params`` of a fresh ``model`` for images ``image_shape`` (jit-compatible).

  The freshly initialised networks DSC and PSG condense against
  (:mod:`fedlap_jax.methods.condensation.one_shot`).
  """
  dummy = jnp.zeros((1, *image_shape), jnp.float32)
  return lambda key: model.init(key, dummy)["params"]


def count_params(params: Any) -> int:
  """Total number of scalars in a parameter pytree."""
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


def init_convnet(
  key: jax.Array,
  image_shape: tuple[int, int, int],
  num_classes: int = 10,
  *,
  width: int = 128,
  depth: int = 3,
  norm: str = "instance",
  impl: str = "auto",
  conv_bias: bool = True,
) -> tuple[ConvNet, Any]:
  """Builds a ConvNet and its parameters for images of ``image_shape`` (H, W, C)."""
  model = ConvNet(
    num_classes=num_classes, width=width, depth=depth, norm=norm, impl=impl, conv_bias=conv_bias
  )
  return model, _init_params(model, key, tuple(image_shape))


@setup_jit(static_argnums=(0, 2))
def _init_params(model: nn.Module, key: jax.Array, image_shape: tuple[int, ...]) -> Any:
  """``model``'s parameters for images of ``image_shape``, as one compiled program.

  Run eagerly, Flax's initialisation compiles each of its operations on its own (some 30 for
  a ConvNet, 2-4 s on two CPU cores); under ``jit`` it is one program, shared by every
  equal model and image shape, and the same numbers. A set-up program
  (:func:`fedlap_jax.setup_jit.setup_jit`): LLVM's level 1 compiles it in 0.4-0.5 s instead of
  about 2 s, bit for bit the same parameters.
  """
  return model.init(key, jnp.zeros((1, *image_shape), jnp.float32))["params"]


# -- ScatterNet: a fixed wavelet scattering front end and a small trained head --------------------
#
# Tramer & Boneh, "Differentially private learning needs better features (or much more data)",
# ICLR 2021: DP-SGD on the 2-D scattering transform of the images (Bruna & Mallat, "Invariant
# scattering convolution networks", TPAMI 2013; J = 2 scales, L = 8 angles, order 2) beats
# end-to-end CNNs at the same epsilon. The transform has no parameters and reads no data: it is
# part of the model's function, so the DP accounting and the per-example paths are unchanged.

SCATTER_J = 2  # scales: the features are at 1 / 2**J of the image's side
SCATTER_L = 8  # angles
SCATTER_HEADS = ("linear", "cnn")
# Channels per input channel: order 0, 1 and 2 (j1 < j2).
SCATTER_CHANNELS = 1 + SCATTER_J * SCATTER_L + SCATTER_L**2 * SCATTER_J * (SCATTER_J - 1) // 2


def _gabor(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
  """A Gabor filter on a ``size x size`` periodic grid (origin at index 0), in space.

  Gaussian envelope of width ``sigma`` along the direction ``theta`` and ``sigma / slant``
  across it, carrier ``exp(i xi u)`` with ``u`` the coordinate along ``theta``; summed over
  the neighbouring periods so that the filter is periodic.
  """
  c, s = np.cos(theta), np.sin(theta)
  shifts = size * np.arange(-2, 3)
  grid = (np.arange(size)[:, None] + shifts[None, :]).ravel()
  x, y = grid[:, None], grid[None, :]
  u, v = c * x + s * y, -s * x + c * y
  g = np.exp(-(u**2 + (slant * v) ** 2) / (2 * sigma**2) + 1j * xi * u)
  g = g.reshape(size, len(shifts), size, len(shifts)).sum(axis=(1, 3))
  return g / (2 * np.pi * sigma**2 / slant)


@functools.lru_cache(maxsize=8)
def scattering_filters(size: int, J: int = SCATTER_J, L: int = SCATTER_L):
  """The fixed filter bank of :func:`scattering`, in the Fourier domain (built once, numpy).

  Returns ``(phi, psi)``: ``phi[r]`` the Gaussian low-pass of scale ``2**J`` and
  ``psi[j][r]`` the ``L`` Morlet band-passes of scale ``2**j`` (``(L, n, n)``), each at the
  resolution ``n = size / 2**r`` of a signal subsampled ``r`` times by 2. A Morlet filter is a
  Gabor filter less its mean's worth of envelope (zero mean); its spectrum is real (the
  filter is Hermitian), and at a coarser resolution it is the fold of the full spectrum
  (the filter sampled on the coarse grid, scaled to keep its gain).
  """

  def folded(f_hat, r):
    k = 2**r
    n = size // k
    *lead, _, _ = f_hat.shape
    return f_hat.reshape(*lead, k, n, k, n).sum(axis=(-4, -2)).astype(np.float32)

  def spectrum(f):
    return np.real(np.fft.fft2(f))

  phi_hat = spectrum(_gabor(size, 0.8 * 2 ** (J - 1), 0.0, 0.0, 1.0))
  psi = []
  for j in range(J):
    sigma, xi, slant = 0.8 * 2**j, 3 * np.pi / 4 / 2**j, 4 / L
    bank = []
    for t in range(L):
      theta = t * np.pi / L
      gabor = _gabor(size, sigma, theta, xi, slant)
      envelope = _gabor(size, sigma, theta, 0.0, slant)
      bank.append(spectrum(gabor - envelope * gabor.sum() / envelope.sum()))
    psi.append(tuple(folded(np.stack(bank), r) for r in range(j + 1)))
  phi = tuple(folded(phi_hat, r) for r in range(J + 1))
  return phi, tuple(psi)


def _modulus(z: jax.Array) -> jax.Array:
  """``|z|`` with gradient 0 (not NaN) where ``z == 0``."""
  sq = jnp.real(z) ** 2 + jnp.imag(z) ** 2
  nonzero = sq > 0
  return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, sq, 1.0)), 0.0)


def _subsample(z_hat: jax.Array, k: int) -> jax.Array:
  """The spectrum of a signal subsampled by ``k`` along both of its last two axes."""
  *lead, m, n = z_hat.shape
  return z_hat.reshape(*lead, k, m // k, k, n // k).mean(axis=(-4, -2))


def scattering(x: jax.Array, J: int = SCATTER_J, L: int = SCATTER_L) -> jax.Array:
  """The 2-D scattering transform (order 2) of images ``(N, H, W, C)``: ``(N, H / 2**J, W /
  2**J, C * K)``, ``K = 1 + J L + L**2 J (J - 1) / 2`` channels per input channel (81 for
  ``J = 2, L = 8``), ordered ``[S0, S1[j1, t1], S2[j1, t1, j2 > j1, t2]]`` per input channel.

  ``S0 = x * phi``, ``S1 = |x * psi_j1| * phi``, ``S2 = ||x * psi_j1| * psi_j2| * phi``,
  every output at ``1 / 2**J`` of the side; each intermediate is subsampled as far as its
  band allows. The image is mirror-padded by ``2**J`` on every side (convolutions are
  periodic, by FFT) and the padding cropped from the output. A fixed function: no
  parameters, no statistics; each example is transformed alone.

  Raises:
    ValueError: when ``H`` or ``W`` is not a multiple of ``2**J`` or they differ.
  """
  n, h, w, c = x.shape
  k = 2**J
  if h != w or h % k:
    raise ValueError(f"scattering needs square images with a side a multiple of {k}, got {h}x{w}")
  size = h + 2 * k
  phi, psi = scattering_filters(size, J, L)
  imgs = jnp.transpose(x, (0, 3, 1, 2)).reshape(n * c, h, w).astype(jnp.float32)
  imgs = jnp.pad(imgs, ((0, 0), (k, k), (k, k)), mode="reflect")

  def low_pass(u_hat, r):  # a signal at resolution r -> its S at resolution J
    return jnp.real(jnp.fft.ifft2(_subsample(u_hat * phi[r], 2 ** (J - r))))

  x_hat = jnp.fft.fft2(imgs)
  out = [low_pass(x_hat, 0)[:, None]]
  second = []
  for j1 in range(J):
    u1 = _modulus(jnp.fft.ifft2(_subsample(x_hat[:, None] * psi[j1][0], 2**j1)))
    u1_hat = jnp.fft.fft2(u1)  # (N C, L, n1, n1)
    out.append(low_pass(u1_hat, j1))
    for j2 in range(j1 + 1, J):
      band = u1_hat[:, :, None] * psi[j2][j1]  # (N C, L, L, n1, n1)
      u2 = _modulus(jnp.fft.ifft2(_subsample(band, 2 ** (j2 - j1))))
      s2 = low_pass(jnp.fft.fft2(u2), j2)
      second.append(s2.reshape(n * c, L * L, *s2.shape[-2:]))
  s = jnp.concatenate(out + second, axis=1)[:, :, 1:-1, 1:-1]  # crop the padding
  s = s.reshape(n, c * s.shape[1], h // k, w // k)
  return jnp.transpose(s, (0, 2, 3, 1))


class ScatterNet(nn.Module):
  """:func:`scattering` (fixed) -> GroupNorm -> a small head, Tramer & Boneh's "ScatterNet +
  linear" and "ScatterNet + CNN".

  The features are normalised per example (GroupNorm, ``num_groups`` groups of channels;
  BatchNorm would mix examples), then ``head="linear"``: one Dense layer; ``head="cnn"``:
  ``[Conv 3x3 -> tanh -> MaxPool 2] x 2`` (``width``, ``2 * width`` filters; the pool only
  where the side is at least 2), Dense ``width`` -> tanh -> Dense to the classes.

  Attributes:
    num_classes: number of output logits.
    head: ``"linear"`` or ``"cnn"``.
    width: the CNN head's filters.
    num_groups: GroupNorm's groups over the ``81 C`` feature channels (a divisor of 81).
    front_end: apply :func:`scattering` to the input; ``False``: the input already is its
      output ``(N, H / 4, W / 4, 81 C)`` (features computed once, before training: the
      same model, without the transform's cost at every step).
  """

  num_classes: int = 10
  head: str = "linear"
  width: int = 32
  num_groups: int = 27
  front_end: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, return_features: bool = False):
    """Images ``(N, H, W, C)`` (``H = W`` a multiple of 4; with ``front_end=False`` their
    scattering) -> logits ``(N, classes)``; with ``return_features=True``, ``(features,
    logits)`` (the head's last hidden layer)."""
    if self.head not in SCATTER_HEADS:
      raise ValueError(f"ScatterNet.head={self.head!r}; allowed: {SCATTER_HEADS}")
    x = scattering(x) if self.front_end else x
    x = nn.GroupNorm(num_groups=self.num_groups, epsilon=1e-5)(x)
    if self.head == "cnn":
      for features in (self.width, 2 * self.width):
        x = jnp.tanh(nn.Conv(features, (3, 3), padding=1)(x))
        if min(x.shape[1:3]) >= 2:
          x = nn.max_pool(x, (2, 2), strides=(2, 2))
      x = jnp.tanh(nn.Dense(self.width)(x.reshape((x.shape[0], -1))))
    x = x.reshape((x.shape[0], -1))
    logits = nn.Dense(self.num_classes)(x)
    return (x, logits) if return_features else logits
