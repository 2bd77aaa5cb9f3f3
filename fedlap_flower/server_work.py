"""The server's round: marshalling around the library's server steps (no ``flwr``).

The clients' replies are stacked in partition order into what the library's
steps take: FedLAP's :class:`fedlap_jax.ClientUpdate` ``(K', ...)``
(:func:`stack_updates`) for :func:`fedlap_jax.server.server_step`, the other
methods' updates for their own server step (:func:`method_update`). Both steps are
jitted once per (model, config) and read back from the export cache in a fresh process
(:func:`fedlap_flower.task.kept_exported`). :func:`make_evaluate` evaluates on the test
split as ``experiments.run`` does.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl
from fedlap_jax.server import server_step

from fedlap_flower import method_work, task


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

  return fl.SyntheticSet(
    jnp.asarray(np.stack([pad(t.x) for t in sets])),
    jnp.asarray(np.stack([pad(t.y) for t in sets])),
    jnp.asarray(np.stack([pad(t.mask, False) for t in sets])),
  )


def stack_trees(trees: Sequence, what: str = "pytree"):
  """Stacks per-client pytrees shaped like the parameters into leaves ``(K', ...)``."""
  if not trees:
    raise ValueError(f"stacking needs at least one {what}")
  return jax.tree.map(lambda *d: jnp.asarray(np.stack(d)), *trees)


def stack_updates(
  sets: Sequence, radii: Sequence[float], deltas: Sequence | None = None
) -> fl.ClientUpdate:
  """The clients' replies as one stacked :class:`fedlap_jax.ClientUpdate` ``(K', ...)``.

  ``deltas``: the clients' model deltas in the order of ``sets`` (with
  ``server.start='fedavg_delta'``), or ``None``.
  """
  return fl.ClientUpdate(
    stack_synthetic(sets),
    jnp.asarray(np.asarray(radii, np.float32)),
    None if deltas is None else stack_trees(deltas, "model delta"),
  )


@functools.lru_cache(maxsize=8)
def _server_step_fn(apply_fn, fedlap_config):
  def fedlap_server_step(key, params, updates, learning_rate, num_records):
    return server_step(
      key,
      apply_fn,
      params,
      updates,
      fedlap_config,
      learning_rate=learning_rate,
      num_records=num_records,
    )

  return task.kept_exported(jax.jit(fedlap_server_step))


def server_update(
  key,
  apply_fn,
  params,
  updates: fl.ClientUpdate,
  learning_rate: float,
  fedlap_config,
  num_records: Sequence[int | None] | None = None,
):
  """:func:`fedlap_jax.server.server_step` on the stacked updates of the clients that replied.

  Args:
    key: ``k_server`` of the round.
    apply_fn, params: the model and the global parameters of the round.
    updates: :func:`stack_updates` of the usable replies, in partition order.
    learning_rate: the server's step size (float32 value).
    fedlap_config: :class:`fedlap_jax.FedLAPConfig`.
    num_records: the clients' reported ``N_k`` (``None`` entries: not reported,
      as by DP clients); passed on only when every client reported one.

  Returns:
    ``(params, fedlap_jax.ServerMetrics)``.
  """
  counts = None
  if num_records is not None and all(n is not None for n in num_records):
    counts = jnp.asarray(np.asarray(num_records, np.int32))
  run = _server_step_fn(apply_fn, fedlap_config)
  return run(key, params, updates, jnp.float32(learning_rate), counts)


def method_update(method, model, config, take_part, plan, state, updates, num_records):
  """A registry method's server step (:attr:`fedlap_jax.method.Method.server_step`, jitted) on
  the clients' updates (in partition order): ``(state, metrics)``."""
  run = method_work.server_fn(method, model, config, take_part)
  return run(
    plan.server_key,
    state,
    plan.message,
    stack_trees(updates, "client update"),
    jnp.asarray(np.asarray(num_records, np.int32)),
  )


def make_evaluate(apply_fn, test, chunk_size: int | None):
  """``params -> (loss, accuracy)`` on the test split, the jitted evaluation of ``experiments.run``."""
  scale = jnp.asarray(test.pixel_scale)
  offset = jnp.asarray(test.pixel_offset)

  def to_inputs(x):
    return x.astype(np.float32) * scale + offset

  def evaluate_test_split(p, x, y):
    return fl.evaluate(apply_fn, p, x, y, chunk_size=chunk_size, preprocess=to_inputs)

  fn = task.kept_exported(jax.jit(evaluate_test_split))

  def evaluate(params):
    ev = fn(params, test.x, test.y)
    return float(ev.loss), float(ev.accuracy)

  return evaluate
