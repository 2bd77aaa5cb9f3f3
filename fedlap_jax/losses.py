"""Losses of the library: per-example softmax cross-entropy and its masked mean.

Every model step (client, server, radius calibration, baselines, auditing)
and every gradient (:mod:`fedlap_jax.privacy`, :mod:`fedlap_jax.per_example`)
uses these, so the loss is defined once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedlap_jax.types import ApplyFn, PyTree


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-example softmax cross-entropy, ``(N, K), (N,) -> (N,)`` in nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def masked_mean_loss(
  apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
  """Mean cross-entropy of ``apply_fn(params, x)`` weighted by ``weights``.

  ``weights`` (``(N,)``, e.g. a 0/1 validity mask) defaults to ones; the result
  is ``sum(w * loss) / max(sum(w), 1e-12)``.
  """
  losses = cross_entropy(apply_fn(params, x), y)
  if weights is None:
    return jnp.mean(losses)
  weights = weights.astype(losses.dtype)
  return jnp.sum(weights * losses) / jnp.maximum(jnp.sum(weights), 1e-12)
