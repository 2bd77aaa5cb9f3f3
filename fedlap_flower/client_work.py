"""One client's round: marshalling around the library's client steps (no ``flwr``).

* :func:`fedlap_round` -- FedLAP / FedLAP-DP: the round's start set
  (:func:`start_synthetic`), then :func:`fedlap_jax.client.client_step` (real
  images re-drawn under ``synthetic_init='real'``, ``local_approx``, the
  upload), converted to NumPy with the diagnostics a non-DP client reports.
(The other registry methods' clients: :mod:`fedlap_flower.method_work`.)

The jitted steps are cached per (model, config), so a process that serves
several rounds or several clients (the simulation engine's workers) compiles
each once; a fresh process reads them back from the export cache
(:func:`fedlap_flower.task.kept_exported`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl
from fedlap_jax.client import client_step, shared_family_key

from fedlap_flower import task


class FedLAPReply(NamedTuple):
  """What a FedLAP client computed (its :class:`fedlap_jax.ClientUpdate` in NumPy).

  Attributes:
    synthetic: the :class:`fedlap_jax.SyntheticSet` after the round (NumPy),
      ``x`` ``(S, H, W, C)`` float32, ``y`` ``(S,)`` int32, ``mask`` ``(S,)`` bool.
    radius: ``r_k`` (the constant ``r`` under DP or without calibration).
    diagnostics: non-DP only (``{}`` under DP): matching loss over the executed
      iterations, real batches drawn, mean while-loop iterations.
    model_delta: with ``server.start='fedavg_delta'``, ``w_end - w_g``
      averaged over the ``R_i`` trajectories (a NumPy pytree shaped like the
      parameters, float32); ``None`` otherwise. Under DP it is post-processing:
      the client's model steps only along the released noisy gradients from the
      public ``w_g`` (:attr:`fedlap_jax.ClientUpdate.model_delta`), so sending
      it spends nothing beyond the round's ``T`` noisy accesses.
  """

  synthetic: Any
  radius: float
  diagnostics: dict
  model_delta: Any = None


@functools.lru_cache(maxsize=8)
def _client_step_fn(apply_fn, fedlap_config):
  def fedlap_client_step(key, params, synthetic, data, learning_rate, family_key, init_key):
    return client_step(
      key,
      apply_fn,
      params,
      synthetic,
      data,
      fedlap_config,
      learning_rate=learning_rate,
      family_key=family_key,
      init_key=init_key,
    )

  return task.kept_exported(jax.jit(fedlap_client_step))


def start_synthetic(partition, carried=None) -> fl.SyntheticSet:
  """The synthetic set a round starts from: the client's labels and mask, with the set
  carried from its previous round (``synthetic_init='noise'``) or else the initial N(0, 1)
  images (under ``'real'`` :func:`fedlap_jax.client.client_step` draws real ones over them)."""
  y, mask = jnp.asarray(partition.synthetic_y), jnp.asarray(partition.synthetic_mask)
  x = partition.initial_images if carried is None else carried
  return fl.SyntheticSet(jnp.asarray(x, jnp.float32), y, mask)


def fedlap_round(
  key,
  apply_fn,
  params,
  synthetic,
  partition,
  fedlap_config,
  learning_rate: float,
  family_key=None,
  init_key=None,
) -> FedLAPReply:
  """Runs :func:`fedlap_jax.client.client_step` for one client.

  Args:
    key: this client's key of the round (server-derived without DP, the
      client's secret under DP).
    apply_fn, params: the model and the received global parameters.
    synthetic: the start set (:func:`start_synthetic`).
    partition: the client's :class:`fedlap_flower.task.Partition`.
    fedlap_config: :class:`fedlap_jax.FedLAPConfig`.
    learning_rate: ``eta_m`` of the round (float32 value).
    family_key: with the server's keys, the round's shared DSA family key
      (:func:`fedlap_jax.client.shared_family_key` of ``k_clients``, as
      ``experiments.run`` draws it); ``None``: derived from ``key`` (the
      client's secret under DP) as :func:`fedlap_jax.local_approx` derives it
      for one client alone, passed explicitly so that one compiled function
      serves both cases.
    init_key: under ``synthetic_init='real'`` the client's key of the real
      images (``split(k_init, K)[k]``); ``None`` under ``'noise'``.
  """
  if family_key is None:
    family_key = shared_family_key(key)
  run = _client_step_fn(apply_fn, fedlap_config)
  update, metrics = run(
    key, params, synthetic, partition.data, jnp.float32(learning_rate), family_key, init_key
  )
  update = jax.tree.map(np.asarray, update)
  diagnostics = {}
  if fedlap_config.client.dp is None:  # under DP nothing but the update leaves
    loss = np.asarray(metrics.matching_loss, np.float64)  # (R_i, O, B, R_b)
    outer = np.asarray(metrics.outer_iterations)  # (R_i,)
    ran = np.arange(loss.shape[1])[None, :] < outer[:, None]
    ran = np.broadcast_to(ran[:, :, None, None], loss.shape)
    diagnostics = {
      "matching-loss": float(loss[ran].mean()) if ran.any() else math.nan,
      "real-accesses": int(metrics.real_accesses),
      "outer-iterations": float(outer.mean()),
    }
  return FedLAPReply(update.synthetic, float(update.radius), diagnostics, update.model_delta)
