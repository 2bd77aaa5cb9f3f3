"""Matching distances: gradient matching ``L_dis`` (FedLAP, DSC, PSG) and distribution matching.

For every parameter tensor the gradient is viewed as a matrix with one row per
output unit; the layer distance is the mean over rows of ``1 - cos(row_real,
row_syn)``; the total is the sum over tensors, plus ``lambda`` times the squared
Euclidean distance over all parameters.

Row convention (``rows_of``): for ``ndim >= 2`` the *last* axis indexes output
units (Flax stores Dense kernels as ``(in, out)`` and Conv kernels as
``(h, w, in, out)``); a 1-D tensor (bias, norm scale or shift) is one row; a
scalar is one row of length 1. Pass ``row_axis`` (a pytree of ints matching the
gradients, or one int for all) to override, e.g. ``0`` for PyTorch-style
``(out, in, h, w)`` kernels.

Two options give the distance of the dataset-condensation code (DSC, Zhao et
al.; PSG, Chen et al., which reuses it): ``row_reduction="sum"`` sums ``1 - cos``
over the rows of a tensor instead of averaging it, and ``include_vectors=False``
leaves out 1-D tensors (biases, norm scales and shifts), which that code scores
as 0. Its ``1e-6`` on the norm product is kept at our ``1e-8``.

:func:`mean_embedding_distance` is the distribution-matching distance (Zhao &
Bilen, "Dataset Condensation with Distribution Matching", WACV 2023; FedDM,
Xiong et al., arXiv 2207.09653): the squared distance between the mean
embeddings of a real and a synthetic batch.

:func:`matching_step` is ``L_dis`` between a real gradient and the gradient
on a synthetic set, with its gradient with respect to the synthetic images
(a gradient of a gradient): the image update of FedLAP, DSC and PSG.

Reference: Zhao, Mopuri & Bilen, "Dataset Condensation with Gradient Matching",
ICLR 2021 (the layer-wise distance); FedLAP-DP adds the MSE term and averages
over rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import dsa, privacy
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.types import ApplyFn, PyTree

EPS = 1e-8
ROW_REDUCTIONS = ("mean", "sum")


def rows_of(g: jax.Array, row_axis: int | None = -1) -> jax.Array:
  """Reshapes one gradient tensor to ``(n_rows, row_length)``.

  ``row_axis`` is the axis of output units for ``ndim >= 2`` tensors (default
  last, Flax's layout); ``None`` treats the whole tensor as one row. Tensors of
  ``ndim <= 1`` are always one row.
  """
  if g.ndim <= 1 or row_axis is None:
    return g.reshape(1, -1)
  return jnp.moveaxis(g, row_axis, 0).reshape(g.shape[row_axis], -1)


def layer_distance(
  g_real: jax.Array, g_syn: jax.Array, row_axis: int | None = -1, row_reduction: str = "mean"
) -> jax.Array:
  """Mean (or sum) over output units of ``1 - cos`` between two gradients of one tensor.

  ``cos = <a, b> / (|a| |b| + 1e-8)`` per row, as in the dataset-condensation
  code FedLAP builds on. The constant sits on the product: rows whose gradient
  is structurally zero (e.g. a conv bias followed by instance norm, whose
  gradient is float noise of order 1e-9) then give ``cos ~ 0`` and a constant,
  gradient-free distance of 1, instead of a random cosine between two noise
  vectors with an exploding gradient. Scalar result in ``[0, 2]``.
  """
  a = rows_of(g_real, row_axis)
  b = rows_of(g_syn, row_axis)
  # safe_norm keeps the gradient finite at an all-zero row.
  na = optax.safe_norm(a, 0.0, axis=-1)
  nb = optax.safe_norm(b, 0.0, axis=-1)
  cos = jnp.sum(a * b, axis=-1) / (na * nb + EPS)
  if row_reduction == "sum":
    return jnp.sum(1.0 - cos)
  return jnp.mean(1.0 - cos)


def matching_distance(
  g_real: PyTree,
  g_syn: PyTree,
  *,
  mse_weight: float | jax.Array = 0.0,
  row_axis: int | None | PyTree = -1,
  row_reduction: str = "mean",
  include_vectors: bool = True,
) -> jax.Array:
  """``L_dis(g_real, g_syn)``: layer-wise cosine distance plus ``lambda`` MSE.

  Args:
    g_real: gradient pytree from the real (possibly privatised) batch.
    g_syn: gradient pytree from the synthetic set, same structure.
    mse_weight: ``lambda`` (0.1 in the non-DP configuration, 0 for DP).
    row_axis: axis of output units, one int for all tensors or a pytree of
      ints / None matching the gradients.
    row_reduction: ``"mean"`` (FedLAP) or ``"sum"`` (DSC / PSG) over the rows
      of a tensor.
    include_vectors: ``False`` leaves tensors of ``ndim <= 1`` out of the
      cosine part (DSC / PSG); the MSE part always covers every tensor.

  Returns:
    A scalar: ``sum_l d_l + lambda * sum (g_syn - g_real)^2``.

  Raises:
    ConfigError: ``row_reduction`` is not one of :data:`ROW_REDUCTIONS`.
  """
  if row_reduction not in ROW_REDUCTIONS:
    raise ConfigError("row_reduction", row_reduction, f"one of {ROW_REDUCTIONS}")
  if not isinstance(row_axis, (int, type(None))):
    axes = jax.tree.leaves(row_axis, is_leaf=lambda v: v is None)
  else:
    axes = [row_axis] * len(jax.tree.leaves(g_real))
  reals, syns = jax.tree.leaves(g_real), jax.tree.leaves(g_syn)
  if len(reals) != len(syns) or len(axes) != len(reals):
    raise ValueError(
      f"gradient pytrees differ: {len(reals)} real leaves, {len(syns)} synthetic"
      f" leaves, {len(axes)} row axes"
    )
  cosine = sum(
    (
      layer_distance(a, b, ax, row_reduction)
      for a, b, ax in zip(reals, syns, axes)
      if include_vectors or a.ndim >= 2
    ),
    jnp.float32(0.0),
  )
  mse = sum(jnp.sum((b - a) ** 2) for a, b in zip(reals, syns))
  return cosine + mse_weight * mse


def mean_embedding_distance(
  real: PyTree, syn: PyTree, real_weights: jax.Array, syn_weights: jax.Array
) -> jax.Array:
  """Distribution matching: ``sum_leaves || mean_w real - mean_w syn ||^2``.

  Args:
    real, syn: pytrees of the same structure whose leaves are per-example
      embeddings with a leading example axis, ``(N, ...)`` and ``(S, ...)``
      (e.g. ``(features, logits)`` of a network, as FedDM matches both).
    real_weights, syn_weights: ``(N,)`` and ``(S,)`` example weights (0 for
      padding); each mean is ``sum_i w_i e_i / max(sum_i w_i, 1e-12)``.

  Returns:
    A scalar, the squared Euclidean distance between the weighted means summed
    over the leaves (each leaf's non-example axes flattened).
  """

  def mean(e, w):
    w = w.astype(e.dtype).reshape(-1, *([1] * (e.ndim - 1)))
    return jnp.sum(w * e, axis=0) / jnp.maximum(jnp.sum(w), 1e-12)

  reals, syns = jax.tree.leaves(real), jax.tree.leaves(syn)
  if len(reals) != len(syns):
    raise ValueError(
      f"embedding pytrees differ: {len(reals)} real leaves, {len(syns)} synthetic leaves"
    )
  return sum(
    (
      jnp.sum(jnp.square(mean(a, real_weights) - mean(b, syn_weights))) for a, b in zip(reals, syns)
    ),
    jnp.float32(0.0),
  )


def synthetic_gradient(
  apply_fn: ApplyFn, params: PyTree, synthetic: SyntheticSet, x: jax.Array | None = None
) -> PyTree:
  """Gradient of the mean loss on the synthetic set (images ``x`` if given)."""
  x = synthetic.x if x is None else x
  return privacy.real_gradient(apply_fn, params, x, synthetic.y, jnp.logical_not(synthetic.mask))


def matching_step(
  apply_fn: ApplyFn,
  params: PyTree,
  synthetic: SyntheticSet,
  g_real: PyTree,
  aug_key: jax.Array,
  *,
  dsa_strategy: str,
  mse_weight,
  family_key: jax.Array | None = None,
  row_reduction: str = "mean",
  include_vectors: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """``L_dis`` and its gradient with respect to the synthetic images (grad of grad).

  ``aug_key`` (and ``family_key``, if given: :func:`fedlap_jax.dsa.augment`)
  must be those of the real batch, so both batches get the same transform.
  ``row_reduction`` and ``include_vectors`` select the distance's variant
  (:func:`matching_distance`; FedLAP's by default, DSC /
  PSG pass ``"sum"`` and ``False``).

  Returns:
    ``(loss, grad_x)`` with ``grad_x`` shaped like ``synthetic.x``.
  """
  augment = dsa.make_augment_fn(dsa_strategy)

  def loss_fn(x):
    g_syn = synthetic_gradient(
      apply_fn, params, synthetic, augment(aug_key, x, family_key=family_key)
    )
    return matching_distance(
      g_real,
      g_syn,
      mse_weight=mse_weight,
      row_reduction=row_reduction,
      include_vectors=include_vectors,
    )

  return jax.value_and_grad(loss_fn)(synthetic.x)
