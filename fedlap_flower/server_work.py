"""The server's round, as a pure computation (no ``flwr``).

:func:`server_update` is the one place the Flower app calls
:func:`fedlap_jax.server_radius` and :func:`fedlap_jax.global_update`: the
union of the received synthetic sets, stacked in client order ``(K', S, ...)``
(``K'``: the clients that replied), trained on inside the radius ``r_g``.
With ``server.start='fedavg_delta'`` the descent starts from ``w_g`` plus the
clients' model deltas averaged with the server's weights
(:func:`fedlap_jax.server.fedavg_delta_start`, as ``experiments.run``).
:func:`make_evaluate` evaluates on the test split as ``experiments.run`` does.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl
from fedlap_jax.server import fedavg_delta_start


def stack_synthetic(sets: Sequence) -> fl.SyntheticSet:
  """Stacks per-client synthetic sets ``(S_k, ...)`` into ``(K', S, ...)``, padding to the largest.

  Padding slots are masked out (zero images, label 0), as ``synthetic_labels``
  pads clients owning fewer classes.
  """
  if not sets:
    raise ValueError("stack_synthetic needs at least one synthetic set")
  s = max(len(t.y) for t in sets)

  def pad(a, fill=0):
    a = np.asarray(a)
    return np.concatenate([a, np.full((s - len(a), *a.shape[1:]), fill, a.dtype)])

  return fl.SyntheticSet(jnp.asarray(np.stack([pad(t.x) for t in sets])),
                         jnp.asarray(np.stack([pad(t.y) for t in sets])),
                         jnp.asarray(np.stack([pad(t.mask, False) for t in sets])))


def stack_deltas(deltas: Sequence):
  """Stacks per-client model deltas (pytrees like the parameters) into leaves ``(K', ...)``."""
  if not deltas:
    raise ValueError("stack_deltas needs at least one model delta")
  return jax.tree.map(lambda *d: jnp.asarray(np.stack(d)), *deltas)


@functools.lru_cache(maxsize=8)
def _server_fn(apply_fn, fedlap_config):
  def run(key, params, synthetic, client_weights, radii, learning_rate, deltas):
    r_g = fl.server_radius(radii, fedlap_config.server.radius_strategy,
                           fedlap_config.client.radius)
    start = params
    if fedlap_config.server.start == "fedavg_delta":
      start = fedavg_delta_start(params, deltas, client_weights)
    return fl.global_update(key, apply_fn, start, synthetic, client_weights, r_g,
                            learning_rate=learning_rate, config=fedlap_config.server)
  return jax.jit(run)


def client_weights(weighting: str, num_records: Sequence[int | None]) -> np.ndarray:
  """``(K',)`` weights: ``N_k`` for ``size`` (needs every ``N_k``), ones for ``uniform``."""
  if weighting == "uniform":
    return np.ones(len(num_records), np.float32)
  if any(n is None for n in num_records):
    raise ValueError("server.weighting='size' needs every client's num-examples")
  return np.asarray(num_records, np.float32)


def server_update(key, apply_fn, params, synthetic: fl.SyntheticSet, weights, radii,
                  learning_rate: float, fedlap_config, deltas=None):
  """Algorithm 2 on the union of the received synthetic sets.

  Args:
    key: ``k_server`` of the round.
    apply_fn, params: the model and the global parameters of the round.
    synthetic: stacked sets of the clients that replied, ``(K', S, ...)``.
    weights: ``(K',)`` client weights (:func:`client_weights`).
    radii: ``(K',)`` the clients' ``r_k``.
    learning_rate: ``eta_m`` (float32 value).
    fedlap_config: :class:`fedlap_jax.FedLAPConfig`.
    deltas: with ``server.start='fedavg_delta'`` (required then) the clients'
      model deltas, stacked in the order of ``synthetic`` (:func:`stack_deltas`,
      leaves ``(K', ...)``); the descent starts from ``params + sum_k w_k
      delta_k / sum_k w_k``. Ignored (may be ``None``) with ``'global'``.

  Returns:
    ``(params, fedlap_jax.ServerMetrics)``.

  Raises:
    ValueError: ``server.start='fedavg_delta'`` without ``deltas``.
  """
  if fedlap_config.server.start == "fedavg_delta":
    if deltas is None:
      raise ValueError("server.start='fedavg_delta' needs the clients' model deltas")
  else:
    deltas = None
  run = _server_fn(apply_fn, fedlap_config)
  return run(key, params, synthetic, jnp.asarray(weights, jnp.float32),
             jnp.asarray(radii, jnp.float32), jnp.float32(learning_rate), deltas)


def make_evaluate(apply_fn, test, chunk_size: int | None):
  """``params -> (loss, accuracy)`` on the test split, the jitted evaluation of ``experiments.run``."""
  scale = jnp.asarray(test.pixel_scale)
  offset = jnp.asarray(test.pixel_offset)

  def to_inputs(x):
    return x.astype(np.float32) * scale + offset

  fn = jax.jit(lambda p, x, y: fl.evaluate(apply_fn, p, x, y, chunk_size=chunk_size,
                                           preprocess=to_inputs))

  def evaluate(params):
    ev = fn(params, test.x, test.y)
    return float(ev.loss), float(ev.accuracy)

  return evaluate
