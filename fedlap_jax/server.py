"""Server side of FedLAP: global optimisation in a trust region (Algorithm 2).

The server trains the global model by SGD on the union of the clients'
synthetic sets (client ``k`` weighted by ``N_k / N``, or ``1 / K`` under DP),
in shuffled batches of 512 with DSA, epoch after epoch, and stops after the
first epoch that leaves the ball ``||w - w_start|| < r_g`` (or at the epoch
cap). The optimiser is plain SGD re-created every round.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.config import ServerConfig
from fedlap_jax.training import sgd_epoch, tree_distance
from fedlap_jax.types import PyTree


class ServerMetrics(NamedTuple):
  """Diagnostics of :func:`global_update`.

  Attributes:
    epochs: epochs run (``<= max_epochs``).
    steps: SGD steps taken.
    distance: final ``||w - w_start||``.
    radius: the ``r_g`` used (``inf`` for the ``fixed`` strategy).
  """

  epochs: jax.Array
  steps: jax.Array
  distance: jax.Array
  radius: jax.Array


def example_weights(mask: jax.Array, client_weights: jax.Array) -> jax.Array:
  """Per-example weights on the union of synthetic sets.

  Args:
    mask: ``(K, S)`` bool, valid synthetic examples.
    client_weights: ``(K,)`` non-negative client weights (e.g. ``N_k / N``).

  Returns:
    ``(K, S)`` weights such that the mean loss over a full pass equals
    ``sum_k client_weights_k * mean loss on S_k`` (normalised weights); with
    equal weights and equal set sizes every weight is 1.
  """
  mask = mask.astype(jnp.float32)
  counts = jnp.sum(mask, axis=1)
  cw = client_weights / jnp.maximum(jnp.sum(client_weights), 1e-12)
  per_example = cw / jnp.maximum(counts, 1.0)
  return mask * per_example[:, None] * jnp.sum(mask)


def global_update(
    key: jax.Array,
    apply_fn: Callable,
    params: PyTree,
    synthetic: SyntheticSet,
    client_weights: jax.Array,
    radius,
    *,
    learning_rate,
    config: ServerConfig,
) -> tuple[PyTree, ServerMetrics]:
  """Algorithm 2: SGD on the union of synthetic sets until ``||w - w_0|| >= r_g``.

  Args:
    key: PRNG key (shuffling and DSA).
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the global model at the start of the round.
    synthetic: the clients' :class:`SyntheticSet` s stacked: images
      ``(K, S, H, W, C)``, labels ``(K, S)``, mask ``(K, S)`` bool.
    client_weights: ``(K,)`` weights (``N_k`` or ones); normalised inside.
    radius: ``r_g`` (``inf`` runs ``config.max_epochs`` epochs).
    learning_rate: ``eta_m`` (may be traced).
    config: :class:`ServerConfig` (static).

  Returns:
    ``(params, ServerMetrics)``.
  """
  weights = example_weights(synthetic.mask, client_weights).reshape(-1)
  x = synthetic.x.reshape(-1, *synthetic.x.shape[2:])
  y = synthetic.y.reshape(-1)
  radius = jnp.asarray(radius, jnp.float32)

  def cond(s):
    epoch, _, dist, _ = s
    return jnp.logical_and(epoch < config.max_epochs, dist < radius)

  def body(s):
    epoch, w, _, steps = s
    w, n = sgd_epoch(jax.random.fold_in(key, epoch), apply_fn, w, x, y, weights,
                     learning_rate, batch_size=config.batch_size,
                     dsa_strategy=config.dsa_strategy)
    return epoch + 1, w, tree_distance(w, params), steps + n

  epochs, w, dist, steps = jax.lax.while_loop(
      cond, body, (jnp.int32(0), params, jnp.float32(0.0), jnp.int32(0)))
  return w, ServerMetrics(epochs, steps, dist, radius)
