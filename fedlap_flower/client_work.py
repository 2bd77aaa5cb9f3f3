"""One client's round, as a pure computation (no ``flwr``).

* :func:`fedlap_round` -- FedLAP / FedLAP-DP: optionally re-draw the synthetic
  images from real ones (``synthetic_init='real'``, non-DP), then
  :func:`fedlap_jax.local_approx` from the received global model; with
  ``client.model_steps='noisy_real'`` also the client's model delta (what a
  ``server.start='fedavg_delta'`` server starts from).
* :func:`fedavg_round` -- the FedAvg baseline's local training: ``epochs``
  epochs of plain SGD in shuffled batches of ``batch_size`` (the mean
  cross-entropy of a batch's real records), at the round's learning rate.

The jitted functions are cached per (model, config), so a process that serves
several rounds or several clients (the simulation engine's workers) compiles
each once.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl
from fedlap_jax.client import shared_family_key
from fedlap_jax.synthetic import real_images


class FedLAPReply(NamedTuple):
  """What a FedLAP client computed.

  Attributes:
    synthetic: the :class:`fedlap_jax.SyntheticSet` after the round (NumPy),
      ``x`` ``(S, H, W, C)`` float32, ``y`` ``(S,)`` int32, ``mask`` ``(S,)`` bool.
    radius: ``r_k`` (the constant ``r`` under DP or without calibration).
    diagnostics: non-DP only (``{}`` under DP): matching loss over the executed
      iterations, real batches drawn, mean while-loop iterations.
    model_delta: with ``client.model_steps='noisy_real'``, ``w_end - w_g``
      averaged over the ``R_i`` trajectories (a NumPy pytree shaped like the
      parameters, float32); ``None`` otherwise. Under DP it is post-processing:
      the client's model steps only along the released noisy gradients from the
      public ``w_g`` (:attr:`fedlap_jax.LocalApproxMetrics.model_delta`), so
      sending it spends nothing beyond the round's ``T`` noisy accesses.
  """

  synthetic: Any
  radius: float
  diagnostics: dict
  model_delta: Any = None


@functools.lru_cache(maxsize=8)
def _local_approx_fn(apply_fn, client_config):
  def run(key, params, synthetic, data, learning_rate, family_key):
    return fl.local_approx(key, apply_fn, params, synthetic, data, client_config,
                           learning_rate=learning_rate, family_key=family_key)
  return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _real_images_fn(ipc: int):
  return jax.jit(lambda key, data, y, mask: real_images(key, data, y, mask, ipc))


def start_synthetic(partition, fedlap_config, carried=None, init_key=None):
  """The synthetic set a round starts from.

  ``synthetic_init='real'``: ``ipc`` real images per class drawn with
  ``init_key`` (every round, as ``fedlap_round`` does). ``'noise'``: the set
  carried from the client's previous round, or the initial N(0, 1) images.
  """
  y, mask = jnp.asarray(partition.synthetic_y), jnp.asarray(partition.synthetic_mask)
  if fedlap_config.synthetic_init == "real":
    if init_key is None:
      raise ValueError("synthetic_init='real' needs the round's init key")
    x = _real_images_fn(fedlap_config.client.ipc)(init_key, partition.data, y, mask)
    return fl.SyntheticSet(x, y, mask)
  x = partition.initial_images if carried is None else carried
  return fl.SyntheticSet(jnp.asarray(x, jnp.float32), y, mask)


def fedlap_round(key, apply_fn, params, synthetic, partition, fedlap_config,
                 learning_rate: float, family_key=None) -> FedLAPReply:
  """Runs :func:`fedlap_jax.local_approx` for one client.

  Args:
    key: this client's key of the round (server-derived without DP, the
      client's secret under DP).
    apply_fn, params: the model and the received global parameters.
    synthetic: the start set (:func:`start_synthetic`).
    partition: the client's :class:`fedlap_flower.task.Partition`.
    fedlap_config: :class:`fedlap_jax.FedLAPConfig`.
    learning_rate: ``eta_m`` of the round (float32 value).
    family_key: with the server's keys, the round's shared DSA family key
      (:func:`fedlap_jax.federated.shared_family_key` of ``k_clients``, as
      ``experiments.run`` draws it); ``None``: derived from ``key`` (the
      client's secret under DP) as :func:`fedlap_jax.local_approx` derives it
      for one client alone, passed explicitly so that one compiled function
      serves both cases.
  """
  if family_key is None:
    family_key = shared_family_key(key)
  run = _local_approx_fn(apply_fn, fedlap_config.client)
  out, radius, metrics = run(key, params, synthetic, partition.data,
                             jnp.float32(learning_rate), family_key)
  synthetic = jax.tree.map(np.asarray, out)
  diagnostics = {}
  if fedlap_config.client.dp is None:  # under DP nothing but the synthetic set leaves
    loss = np.asarray(metrics.matching_loss, np.float64)        # (R_i, O, B, R_b)
    outer = np.asarray(metrics.outer_iterations)                # (R_i,)
    ran = np.arange(loss.shape[1])[None, :] < outer[:, None]
    ran = np.broadcast_to(ran[:, :, None, None], loss.shape)
    diagnostics = {
        "matching-loss": float(loss[ran].mean()) if ran.any() else math.nan,
        "real-accesses": int(metrics.real_accesses),
        "outer-iterations": float(outer.mean()),
    }
  delta = None if metrics.model_delta is None else jax.tree.map(np.asarray, metrics.model_delta)
  return FedLAPReply(synthetic, float(radius), diagnostics, delta)


@functools.lru_cache(maxsize=8)
def _fedavg_fn(apply_fn, epochs: int, batch_size: int, capacity: int):
  steps = math.ceil(capacity / batch_size)

  def run(key, params, data, learning_rate):
    def epoch(e, p):
      # Real records first, in a random order; padding last (its batches are no-ops).
      scores = jnp.where(data.mask, jax.random.uniform(jax.random.fold_in(key, e),
                                                       data.mask.shape), 2.0)
      order = jnp.argsort(scores)
      order = jnp.concatenate([order, jnp.zeros(steps * batch_size - capacity, order.dtype)])
      slot_ok = jnp.arange(steps * batch_size) < capacity

      def step(i, p):
        idx = jax.lax.dynamic_slice(order, (i * batch_size,), (batch_size,))
        ok = jnp.logical_and(data.mask[idx],
                             jax.lax.dynamic_slice(slot_ok, (i * batch_size,), (batch_size,)))
        g = fl.real_gradient(apply_fn, p, data.images(idx), data.y[idx], jnp.logical_not(ok))
        return jax.tree.map(lambda w, d: w - learning_rate * d, p, g)

      return jax.lax.fori_loop(0, steps, step, p)

    return jax.lax.fori_loop(0, epochs, epoch, params)

  return jax.jit(run)


def fedavg_round(key, apply_fn, params, partition, *, epochs: int, batch_size: int,
                 learning_rate: float):
  """FedAvg's local training on one client; returns the new parameters (NumPy pytree)."""
  run = _fedavg_fn(apply_fn, int(epochs), int(batch_size), int(partition.data.mask.shape[0]))
  out = run(key, params, partition.data, jnp.float32(learning_rate))
  return jax.tree.map(np.asarray, out)
