"""Trust-region radii: client calibration of ``r_k`` and the server's ``r_g``.

Non-DP clients measure how far the global model can move on their synthetic set
before the loss on their *real* data turns up (paper Fig. 2): train a copy of
the global model on the synthetic set, record after every epoch the distance
from the global model and the mean real loss, and report the distance at the
epoch of lowest real loss, capped at ``r``. Under DP ``r_k`` must not depend on
data and the constant ``r`` is used.

The server combines the ``r_k`` with one of the strategies ``min`` (paper),
``max``, ``median``, ``mean``, ``constant`` (``r``) or ``fixed`` (no radius:
the server runs its epoch cap).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.methods.fedlap.config import RADIUS_STRATEGIES
from fedlap_jax.training import evaluate, sgd_epoch, tree_distance
from fedlap_jax.types import PyTree


class CalibrationTrace(NamedTuple):
  """Per-epoch record of a radius calibration.

  Attributes:
    distances: ``(epochs,)`` ``||w_e - w_global||`` after each epoch.
    real_losses: ``(epochs,)`` mean real-data loss after each epoch (nats).
    best_epoch: 0-based index of the lowest real loss.
  """

  distances: jax.Array
  real_losses: jax.Array
  best_epoch: jax.Array


def calibrate_radius(
  key: jax.Array,
  apply_fn: Callable,
  params: PyTree,
  synthetic: SyntheticSet,
  real: ClientData,
  *,
  learning_rate,
  max_radius,
  epochs: int = 100,
  batch_size: int = 512,
  dsa_strategy: str = "",
  eval_size: int | None = None,
  family_key: jax.Array | None = None,
) -> tuple[jax.Array, CalibrationTrace]:
  """Measures the client radius ``r_k`` (non-DP only: it reads real data freely).

  Args:
    key: PRNG key.
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the global model ``w_g`` of this round.
    synthetic: the client's :class:`SyntheticSet` (``(S, ...)`` leaves).
    real: the client's :class:`ClientData` (``(N, ...)`` leaves), read through
      :meth:`ClientData.normalise` (stored pixels become model inputs chunk by
      chunk).
    learning_rate: model step size ``eta_m``.
    max_radius: the cap ``r``.
    epochs: static number of epochs (100 in the reference).
    batch_size: model batch size on the synthetic set.
    dsa_strategy: DSA during the synthetic-set epochs.
    eval_size: if set, evaluate the real loss on this many records (drawn once,
      without replacement among valid records) instead of all ``N``.
    family_key: optional key that draws the DSA families of the epochs
      (shared by clients run side by side; :func:`fedlap_jax.training.sgd_epoch`).

  Returns:
    ``(r_k, trace)``.
  """
  k_sub, k_train = jax.random.split(key)
  if eval_size is not None and eval_size < real.x.shape[0]:
    p = real.mask / jnp.maximum(jnp.sum(real.mask), 1)
    idx = jax.random.choice(k_sub, real.x.shape[0], (eval_size,), replace=False, p=p)
    real = real._replace(x=real.x[idx], y=real.y[idx], mask=real.mask[idx])
  weights = synthetic.mask.astype(jnp.float32)

  def epoch(w, keys):
    k, fk = keys
    w, _ = sgd_epoch(
      k,
      apply_fn,
      w,
      synthetic.x,
      synthetic.y,
      weights,
      learning_rate,
      batch_size=batch_size,
      dsa_strategy=dsa_strategy,
      family_key=fk,
    )
    loss = evaluate(apply_fn, w, real.x, real.y, real.mask, preprocess=real.normalise).loss
    return w, (tree_distance(w, params), loss)

  family_keys = (
    None if family_key is None else jax.random.split(jax.random.split(family_key)[1], epochs)
  )
  _, (dists, losses) = jax.lax.scan(epoch, params, (jax.random.split(k_train, epochs), family_keys))
  best = jnp.argmin(losses)
  return jnp.minimum(dists[best], max_radius), CalibrationTrace(dists, losses, best)


def server_radius(radii: jax.Array, strategy: str, radius, valid: jax.Array | None = None):
  """Combines client radii ``(K,)`` into the server radius ``r_g``.

  Args:
    radii: ``(K,)`` client radii ``r_k``.
    strategy: one of ``min | max | median | mean | constant | fixed``.
    radius: ``r``, returned by ``constant``.
    valid: optional ``(K,)`` bool mask of participating clients.

  Returns:
    Scalar ``r_g``; ``+inf`` for ``fixed`` (the server runs its epoch cap).
  """
  if strategy not in RADIUS_STRATEGIES:
    raise ConfigError("radius_strategy", strategy, f"one of {RADIUS_STRATEGIES}")
  radii = jnp.asarray(radii, jnp.float32)
  if valid is None:
    valid = jnp.ones(radii.shape, bool)
  if strategy == "constant":
    return jnp.asarray(radius, jnp.float32)
  if strategy == "fixed":
    return jnp.asarray(jnp.inf, jnp.float32)
  if strategy == "min":
    return jnp.min(jnp.where(valid, radii, jnp.inf))
  if strategy == "max":
    return jnp.max(jnp.where(valid, radii, -jnp.inf))
  if strategy == "mean":
    return jnp.sum(jnp.where(valid, radii, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
  return jnp.nanmedian(jnp.where(valid, radii, jnp.nan))
