"""The server's round: marshalling around the methods' server steps (no ``flwr``).

The clients' replies, in partition order, are stacked into what a method's server step takes
(:func:`method_update`: :attr:`fedlap_jax.method.Method.server_step`, jitted once per (method,
model, config) and read back from the export cache in a fresh process,
:func:`fedlap_flower.task.kept_exported`). :func:`make_evaluate` evaluates on the test
split as ``experiments.run`` does.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl

from fedlap_flower import method_work, task


def stack_trees(trees: Sequence, what: str = "pytree"):
  """Stacks per-client pytrees shaped like the parameters into leaves ``(K', ...)``."""
  if not trees:
    raise ValueError(f"stacking needs at least one {what}")
  return jax.tree.map(lambda *d: jnp.asarray(np.stack(d)), *trees)


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
