"""Server side of FedLAP: global optimisation in a trust region (Algorithm 2).

The server trains the global model by SGD on the union of the clients'
synthetic sets (client ``k`` weighted by ``N_k / N``, or ``1 / K`` under DP),
in shuffled batches of 512 with DSA, epoch after epoch, and stops after the
first epoch that leaves the ball ``||w - w_start|| < r_g`` (or at the epoch
cap). The optimiser is SGD re-created every round: plain for FedLAP, with
``momentum`` and ``weight_decay`` for the synthetic-data comparison systems
(FedDM's server; DSC's and PSG's training of a fresh model on the synthetic
sets), which also run here, with ``r_g = inf``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.config import ServerConfig
from fedlap_jax.training import model_optimizer, train_epoch, tree_distance
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
    config: :class:`ServerConfig` (static): batch size, epoch cap, DSA, and
      the optimiser's momentum and weight decay (:func:`model_optimizer`).

  Returns:
    ``(params, ServerMetrics)``.
  """
  weights = example_weights(synthetic.mask, client_weights).reshape(-1)
  x = synthetic.x.reshape(-1, *synthetic.x.shape[2:])
  y = synthetic.y.reshape(-1)
  radius = jnp.asarray(radius, jnp.float32)
  optimizer = model_optimizer(learning_rate, momentum=config.momentum,
                              weight_decay=config.weight_decay)

  def cond(s):
    epoch, _, _, dist, _ = s
    return jnp.logical_and(epoch < config.max_epochs, dist < radius)

  def body(s):
    epoch, w, opt_state, _, steps = s
    w, opt_state, n = train_epoch(jax.random.fold_in(key, epoch), apply_fn, w, opt_state, x, y,
                                  weights, optimizer=optimizer, batch_size=config.batch_size,
                                  dsa_strategy=config.dsa_strategy)
    return epoch + 1, w, opt_state, tree_distance(w, params), steps + n

  epochs, w, _, dist, steps = jax.lax.while_loop(
      cond, body,
      (jnp.int32(0), params, optimizer.init(params), jnp.float32(0.0), jnp.int32(0)))
  return w, ServerMetrics(epochs, steps, dist, radius)
