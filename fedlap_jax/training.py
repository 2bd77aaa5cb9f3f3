"""Model steps shared by the client, the radius calibration and the server.

* :func:`cosine_learning_rate`: the round schedule ``eta_m``.
* :func:`train_epoch`: one epoch over a small (synthetic) set in shuffled
  batches, with DSA, as a ``lax.fori_loop``, with any optax optimiser;
  :func:`sgd_epoch` is the same with plain SGD.
* :func:`evaluate`: mean loss and accuracy over a large masked set in chunks.
* :func:`tree_distance`: ``||a - b||_2`` over the flattened pytrees.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import dsa, optim
from fedlap_jax.checks import ConfigError
from fedlap_jax.losses import cross_entropy
from fedlap_jax.types import ApplyFn, PyTree


LR_SCHEDULES = ("cosine", "cosine_open")  # fedlap_jax.training.cosine_learning_rate's

LR_FLOOR = 0.01
"""The smallest rate of a round, as a fraction of ``eta_0`` (round 1's): every round steps."""


def cosine_learning_rate(round_index, num_rounds: int, base_lr, *, schedule: str = "cosine"):
  """``max(eta_0 (1 + cos(pi (m - 1) / D)) / 2, 0.01 eta_0)`` for round ``m = 1..M``.

  ``schedule="cosine"`` (the reference): ``D = M - 1``, so the cosine reaches 0 at the last
  round; the floor of :data:`LR_FLOOR` ``eta_0`` (it binds only where the cosine is below it:
  the last round, and the second-to-last from ``M = 17``) keeps that round's step, which
  under DP spends its share of epsilon like any other (``M = 3``: a third of the budget).
  ``"cosine_open"``: ``D = M``, the cosine of ``M + 1`` rounds stopped after ``M`` (the last
  rate is ``eta_0 (1 + cos(pi (M - 1) / M)) / 2 > 0``, above the floor up to ``M = 15``).

  ``round_index`` is 1-based and may be traced. With ``M = 1`` the rate is ``eta_0``.
  """
  if schedule not in LR_SCHEDULES:
    raise ConfigError("lr_schedule", schedule, f"one of {LR_SCHEDULES}")
  m = jnp.asarray(round_index, jnp.float32)
  denom = max(num_rounds - 1, 1) if schedule == "cosine" else max(num_rounds, 1)
  lr = base_lr * (1.0 + jnp.cos(jnp.pi * (m - 1.0) / denom)) / 2.0
  return jnp.maximum(lr, LR_FLOOR * base_lr)


def tree_distance(a: PyTree, b: PyTree) -> jax.Array:
  """Euclidean distance between two pytrees of the same structure."""
  # Written out: optax.global_norm is deprecated and its successor needs optax >= 0.2.5.
  squares = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.sum(jnp.square(x - y)), a, b))
  return jnp.sqrt(sum(squares, jnp.float32(0.0)))


def train_epoch(
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  opt_state: optax.OptState,
  x: jax.Array,
  y: jax.Array,
  weights: jax.Array,
  *,
  optimizer: optax.GradientTransformation,
  batch_size: int,
  dsa_strategy: str,
  family_key: jax.Array | None = None,
) -> tuple[PyTree, optax.OptState, jax.Array]:
  """One epoch over ``(x, y)`` in shuffled batches of ``batch_size``.

  Args:
    key: PRNG key (shuffle and one DSA draw per batch).
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: model parameters; opt_state: ``optimizer``'s state for them.
    x: ``(S, H, W, C)`` images; y: ``(S,)`` int labels.
    weights: ``(S,)`` per-example weights; 0 marks padding. A batch's loss is
      ``sum(w * loss) / (number of examples with w > 0 in the batch)``.
    optimizer: an optax transformation (e.g. :func:`fedlap_jax.optim.with_rate`).
    batch_size: static batch size; the epoch has ``ceil(S / batch_size)``
      batches (the last one padded).
    dsa_strategy: DSA families applied to each batch.
    family_key: optional key that draws each batch's DSA family (shared by
      clients run side by side; :func:`fedlap_jax.dsa.augment`), derived
      per batch as ``key`` is.

  Returns:
    ``(params, opt_state, steps)``: updated parameters and optimiser state,
    and the number of non-empty batches.
  """
  n = x.shape[0]
  bs = min(batch_size, n)
  num_batches = math.ceil(n / bs)
  padded = num_batches * bs
  k_perm, k_aug = jax.random.split(key)
  perm = jax.random.permutation(k_perm, n)
  perm = jnp.concatenate([perm, jnp.zeros((padded - n,), perm.dtype)])
  slot_valid = jnp.arange(padded) < n
  augment = dsa.make_augment_fn(dsa_strategy)
  f_aug = None if family_key is None else jax.random.split(family_key)[1]

  def body(b, carry):
    params, opt_state, steps = carry
    idx = jax.lax.dynamic_slice_in_dim(perm, b * bs, bs)
    w = weights[idx] * jax.lax.dynamic_slice_in_dim(slot_valid, b * bs, bs)
    xb = augment(
      jax.random.fold_in(k_aug, b),
      x[idx],
      family_key=None if f_aug is None else jax.random.fold_in(f_aug, b),
    )
    count = jnp.sum(w > 0)

    def loss_fn(p):
      losses = cross_entropy(apply_fn(p, xb), y[idx])
      return jnp.sum(w * losses) / jnp.maximum(count, 1)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, steps + (count > 0).astype(jnp.int32)

  return jax.lax.fori_loop(0, num_batches, body, (params, opt_state, jnp.int32(0)))


def sgd_epoch(
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  weights: jax.Array,
  learning_rate,
  *,
  batch_size: int,
  dsa_strategy: str,
  family_key: jax.Array | None = None,
) -> tuple[PyTree, jax.Array]:
  """:func:`train_epoch` with plain SGD at ``learning_rate`` (may be traced).

  Returns:
    ``(params, steps)``: updated parameters and the number of non-empty batches.
  """
  optimizer = optim.with_rate(optim.sgd(), learning_rate)
  params, _, steps = train_epoch(
    key,
    apply_fn,
    params,
    optimizer.init(params),
    x,
    y,
    weights,
    optimizer=optimizer,
    batch_size=batch_size,
    dsa_strategy=dsa_strategy,
    family_key=family_key,
  )
  return params, steps


class Evaluation(NamedTuple):
  """Mean loss (nats) and accuracy (fraction) over the valid examples."""

  loss: jax.Array
  accuracy: jax.Array


def default_eval_chunk_size() -> int:
  """Examples per evaluation chunk: 16 on the CPU backend, 1000 elsewhere.

  On CPU a small chunk's activations stay in cache; accelerators want large
  chunks. The chunk sizes were chosen from the timings in docs/benchmarks.md.
  """
  return 16 if jax.default_backend() == "cpu" else 1000


def evaluate(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  mask: jax.Array | None = None,
  *,
  chunk_size: int | None = None,
  preprocess: Callable[[jax.Array], jax.Array] | None = None,
) -> Evaluation:
  """Loss and accuracy over ``(N, ...)`` inputs, at most ``chunk_size`` at a time (``lax.map``).

  ``chunk_size`` defaults to :func:`default_eval_chunk_size` (16 on CPU, 1000
  elsewhere). The ``ceil(N / chunk_size)`` chunks are made as equal as possible,
  so at most ``chunks - 1`` padding rows are computed (2,048 records in chunks
  of at most 1000: 3 chunks of 683, not 3 of 1000). ``mask`` ``(N,)`` marks the
  records that count (all by default). ``preprocess`` maps each chunk of ``x``
  to model inputs (e.g. :meth:`fedlap_jax.client_data.ClientData.normalise` for
  stored uint8 pixels), so only a chunk is ever materialised as float32;
  identity if None.
  """
  n = x.shape[0]
  if mask is None:
    mask = jnp.ones((n,), bool)
  if chunk_size is None:
    chunk_size = default_eval_chunk_size()
  if chunk_size < 1:
    raise ConfigError(
      "chunk_size",
      chunk_size,
      "an integer >= 1",
      message=f"evaluate: chunk_size={chunk_size!r} is invalid; allowed: an integer >= 1",
    )
  if n == 0:
    raise ConfigError(
      "x", 0, "at least 1 record", message="evaluate: x has 0 records; allowed: at least 1"
    )
  chunks = math.ceil(n / chunk_size)
  cs = math.ceil(n / chunks)
  pad = chunks * cs - n
  xp = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(chunks, cs, *x.shape[1:])
  yp = jnp.pad(y, (0, pad)).reshape(chunks, cs)
  mp = jnp.pad(mask, (0, pad)).reshape(chunks, cs)

  def one(args):
    xc, yc, mc = args
    logits = apply_fn(params, xc if preprocess is None else preprocess(xc))
    losses = cross_entropy(logits, yc)
    correct = jnp.argmax(logits, -1) == yc
    return jnp.sum(losses * mc), jnp.sum(correct * mc)

  loss_sum, correct_sum = jax.lax.map(one, (xp, yp, mp))
  total = jnp.maximum(jnp.sum(mask), 1)
  return Evaluation(jnp.sum(loss_sum) / total, jnp.sum(correct_sum) / total)
