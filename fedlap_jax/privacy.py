"""Device-side privacy primitives: Poisson sampling, per-example clipping, noise.

Everything here runs under ``jit`` and ``vmap``. Host-side accounting lives in
:mod:`fedlap_jax.accounting`.

* :func:`poisson_sample` draws a Poisson batch (each valid record independently
  with probability ``q``) and lays it out in chunks of a fixed ``capacity``
  (index arrays with an ``is_padding`` mask, so shapes stay static under jit).
  No sampled record is ever dropped: :func:`sum_over_chunks` adds up a
  per-chunk sum (clipped gradients, losses, counts) over the chunks of the
  draw in a ``lax.while_loop``: one chunk, plus extra ones only when the draw
  exceeds the buffer (at most ``ceil(N / capacity) - 1`` of them). Sums over
  examples are additive, so the result equals one pass over a buffer holding
  the whole batch: sampling is exact and the accountant needs no extra delta.
* :func:`real_gradient` is the gradient of the mean loss on a batch (non-DP).
* :func:`private_gradient` is the Gaussian mechanism of Algorithm 3: per-example
  gradients clipped to L2 norm ``C`` over the whole parameter pytree, summed,
  ``N(0, sigma^2 C^2)`` noise added to the sum, divided by the *expected* batch
  size ``B``.

Per-example clipping (``method`` of :func:`clipped_gradient_sum`), all exact:
``"layerwise"`` (:mod:`fedlap_jax.per_example`: one batched backward pass and
per-layer per-example gradients, for models built from Flax layers),
``"vmap"`` (``vmap(grad)``, any ``apply_fn``), ``"jax_privacy"``
(``jax_privacy.clipping.clipped_grad``, imported only when used) and
``"auto"`` (default: :func:`fedlap_jax.per_example.auto_plan`, decided at
trace time: ``vmap`` for models whose convolutions are matrix products, such
as the ConvNet on CPU, ``layerwise`` for other flax.linen models, ``vmap`` for
anything else, Flax NNX, Equinox and plain-JAX models included; for matmul-convolution models on the CPU backend also
microbatches of 16 (`per_example.CPU_MICROBATCH`) when none is given, which skip the all-padding tail of a
Poisson buffer). A model with BatchNorm (or other state outside its parameters) is refused
under every method (:func:`fedlap_jax.per_example.check_dp_model`). Every
method gives the same result up to float rounding;
docs/benchmarks.md compares their speed. The loss is
:func:`fedlap_jax.losses.cross_entropy` (also importable from here).

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov et al., "Renyi Differential Privacy of the Sampled Gaussian
  Mechanism", 2019.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax import per_example as _per_example
from fedlap_jax import checks
from fedlap_jax.checks import ConfigError
from fedlap_jax.config import PER_EXAMPLE_METHODS

# The buffer of poisson_sample, and the smallest one a config may ask for.
from fedlap_jax.config import check_poisson_capacity  # noqa: F401
from fedlap_jax.config import min_poisson_capacity  # noqa: F401
from fedlap_jax.config import poisson_capacity  # noqa: F401
from fedlap_jax.losses import cross_entropy, masked_mean_loss  # noqa: F401
from fedlap_jax.types import ApplyFn, PyTree


def _given(value: Any) -> bool:
  """Whether a DP parameter is a Python or NumPy number, checked when the function is traced.

  The primitives take them as numbers (a config's, static) or as arrays (e.g. a rate computed
  from a traced mask); an array is the caller's to check.
  """
  return isinstance(value, numbers.Real)


class PoissonBatch(NamedTuple):
  """A Poisson draw, read in chunks of ``capacity`` slots.

  Attributes:
    indices: ``(capacity,)`` int32, the first chunk: the sampled record indices
      of rank ``0 .. capacity - 1`` in increasing order; padding slots point at 0.
    is_padding: ``(capacity,)`` bool, True for empty slots of the first chunk.
    size: scalar int32, records sampled in total (all chunks; may exceed
      ``capacity``).
    extra_chunks: scalar int32, chunks beyond the first that hold sampled
      records, ``ceil(size / capacity) - 1`` (0 unless ``size > capacity``).
    chosen: ``(N,)`` bool, the whole draw (:func:`poisson_chunk` reads chunk
      ``j`` from it).
  """

  indices: jax.Array
  is_padding: jax.Array
  size: jax.Array
  extra_chunks: jax.Array
  chosen: jax.Array


def include(key: jax.Array, shape: tuple[int, ...], rate: jax.Array | float) -> jax.Array:
  """Independent inclusions with a probability never above ``rate`` (``shape`` bools).

  Each entry compares 32 random bits with the integer threshold
  ``floor(r' 2^32)``, ``r'`` the float32 ``rate`` stepped one unit in the last
  place toward zero: the probability ``floor(r' 2^32) / 2^32`` is then below
  the exact rate the float32 was rounded from (``B / N_k`` in float64, as the
  accountant uses it), however it was rounded to nearest. A rate of 1 or more
  includes every entry, 0 or less none. ``uniform(float32) < rate`` instead
  includes with probability ``ceil(rate 2^23) / 2^23``, up to ``2^-23`` above
  the rate; the two agree on the same bits except in the one bucket of width
  ``2^-23`` at the threshold.
  """
  r = jnp.asarray(rate, jnp.float32)
  below = jnp.nextafter(r, jnp.float32(0.0))
  threshold = jnp.floor(jnp.clip(below, 0.0, 1.0) * jnp.float32(2.0**32))
  threshold = jnp.minimum(threshold, jnp.float32(2.0**32 - 256)).astype(jnp.uint32)
  bits = jax.random.bits(key, shape, jnp.uint32)
  return jnp.where(r >= 1.0, True, jnp.logical_and(r > 0.0, bits < threshold))


def poisson_sample(
  key: jax.Array, valid: jax.Array, rate: jax.Array | float, capacity: int
) -> PoissonBatch:
  """Samples each valid record independently with probability at most ``rate`` (:func:`include`).

  Args:
    key: PRNG key.
    valid: ``(N,)`` bool mask of real (non-padding) records of the client.
    rate: sampling probability ``q`` in ``[0, 1]`` (may be traced).
    capacity: static size of one chunk (the index buffer).

  Returns:
    A :class:`PoissonBatch` whose first chunk holds the first ``min(size,
    capacity)`` sampled indices in increasing order; read every chunk with
    :func:`sum_over_chunks` (or :func:`poisson_chunk`).
  """
  checks.positive_int("capacity", capacity)
  if _given(rate):
    q_ok = checks.is_real(rate) and 0 <= float(rate) <= 1
    checks.require(q_ok, "rate", rate, "a probability in [0, 1]")
  chosen = jnp.logical_and(include(key, valid.shape, rate), valid)
  size = jnp.sum(chosen, dtype=jnp.int32)
  extra = jnp.maximum((size + capacity - 1) // capacity - 1, 0).astype(jnp.int32)
  batch = PoissonBatch(
    jnp.zeros((capacity,), jnp.int32), jnp.ones((capacity,), bool), size, extra, chosen
  )
  indices, is_padding = poisson_chunk(batch, 0)
  return batch._replace(indices=indices, is_padding=is_padding)


def poisson_chunk(batch: PoissonBatch, j: jax.Array | int) -> tuple[jax.Array, jax.Array]:
  """Chunk ``j`` (may be traced) of a draw: the sampled records of rank
  ``j * capacity .. (j + 1) * capacity - 1``.

  Returns:
    ``(indices, is_padding)``, both ``(capacity,)``, as the first chunk of
    :class:`PoissonBatch`.
  """
  capacity = batch.indices.shape[0]
  first = j * capacity
  rank = jnp.cumsum(batch.chosen, dtype=jnp.int32) - 1
  in_chunk = batch.chosen & (rank >= first) & (rank < first + capacity)
  (indices,) = jnp.nonzero(in_chunk, size=capacity, fill_value=0)
  is_padding = jnp.arange(capacity) >= batch.size - first
  return indices.astype(jnp.int32), is_padding


def sum_over_chunks(
  chunk_sum: Callable[[jax.Array, jax.Array], PyTree], batch: PoissonBatch
) -> PyTree:
  """``sum_j chunk_sum(indices_j, is_padding_j)`` over every chunk of a draw.

  ``chunk_sum`` must return sums over the chunk's examples (padding slots
  contributing zero), e.g. a clipped gradient sum, a loss sum or a count; the
  total is then the sum over the whole Poisson batch, exactly as one pass over
  a buffer large enough for it (up to float summation order). The chunks run
  in one ``lax.while_loop``: the first always (an empty draw gives zero sums),
  further ones only when the draw overflowed the buffer
  (``batch.extra_chunks`` of them, at most ``ceil(N / capacity) - 1``). One
  copy of ``chunk_sum`` in the program: measured on the quickstart's FedLAP-DP
  client, the same XLA compile time as a single unlooped pass. Not
  reverse-differentiable (the loop length depends on the draw).
  """
  zeros = jax.tree.map(
    lambda a: jnp.zeros(a.shape, a.dtype),
    jax.eval_shape(chunk_sum, batch.indices, batch.is_padding),
  )

  def body(carry):
    j, acc = carry
    return j + 1, jax.tree.map(jnp.add, acc, chunk_sum(*poisson_chunk(batch, j)))

  _, total = jax.lax.while_loop(lambda c: c[0] <= batch.extra_chunks, body, (jnp.int32(0), zeros))
  return total


def real_gradient(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  microbatch_size: int | Literal["auto"] | None = None,
) -> PyTree:
  """Non-private gradient of the mean loss over the non-padding examples.

  Args:
    apply_fn, params: the model.
    x, y: ``(N, ...)`` inputs and ``(N,)`` labels.
    is_padding: ``(N,)`` bool; padding examples do not count.
    microbatch_size: ``None``: one pass over all ``N``. An integer: the summed
      loss's gradient chunk by chunk, only up to the last chunk holding a real
      example (a Poisson buffer keeps its real examples first, so its padding
      tail costs nothing), divided by the number of real examples; the same
      result up to float summation order, for models whose outputs depend on
      their own example only. ``"auto"``: the microbatch
      :func:`fedlap_jax.per_example.auto_plan` picks for the DP gradient
      (chunks of 16 for matrix-product convolutions on the CPU backend, one
      pass otherwise; docs/benchmarks.md has the timings). With chunks the result
      is not reverse-differentiable (data-dependent loop length).

  Returns:
    The gradient, a pytree like ``params``.
  """
  return real_gradient_and_loss(
    apply_fn, params, x, y, is_padding, microbatch_size=microbatch_size
  )[0]


def real_gradient_and_loss(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  microbatch_size: int | Literal["auto"] | None = None,
) -> tuple[PyTree, jax.Array]:
  """:func:`real_gradient` and the mean loss (nats) over the non-padding examples."""
  total, loss_sum = real_gradient_sum(
    apply_fn, params, x, y, is_padding, microbatch_size=microbatch_size
  )
  count = jnp.maximum(jnp.sum(jnp.logical_not(is_padding)), 1).astype(jnp.float32)
  return jax.tree.map(lambda g: g / count, total), loss_sum / count


def real_gradient_sum(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  microbatch_size: int | Literal["auto"] | None = None,
) -> tuple[PyTree, jax.Array]:
  """Gradient of the *summed* loss over the non-padding examples, and that sum (nats).

  Sums add up over the chunks of a Poisson draw (:func:`sum_over_chunks`);
  :func:`real_gradient_and_loss` divides them by the number of examples.
  ``microbatch_size`` as in :func:`real_gradient`.
  """
  if microbatch_size == "auto":
    microbatch_size = _per_example.auto_plan(apply_fn, params, x)[1]

  def chunk(xc, yc, pc):
    def summed(p):
      losses = cross_entropy(apply_fn(p, xc), yc) * jnp.logical_not(pc)
      return jnp.sum(losses), losses

    g, losses = jax.grad(summed, has_aux=True)(params)
    return g, losses.astype(jnp.float32)

  total, losses = _per_example.microbatched(chunk, params, x, y, is_padding, microbatch_size)
  return total, jnp.sum(losses)


def per_example_gradients(apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array) -> PyTree:
  """Per-example gradients with ``vmap``: every leaf gains a leading ``(N,)`` axis."""
  return _per_example.per_example_gradients(apply_fn, params, x, y, cross_entropy)


def clipped_gradient_sum(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  l2_clip_norm: float,
  microbatch_size: int | None = None,
  method: str = "auto",
) -> tuple[PyTree, jax.Array]:
  """Sum over examples of per-example gradients clipped to ``l2_clip_norm``.

  The clipping is over the flattened parameter pytree of each example. Padding
  examples contribute exactly zero.

  Args:
    method: how per-example gradients are computed (same result): ``auto``,
      ``layerwise``, ``vmap`` or ``jax_privacy`` (see the module docstring).
      ``layerwise`` raises :class:`fedlap_jax.per_example.Unsupported` (a
      ``ConfigError``) for models outside its scope (it serves flax.linen
      models built from Flax layers), where ``auto`` uses ``vmap``.

  Returns:
    ``(clipped_sum, norms)``: a pytree like ``params`` and the ``(N,)``
    pre-clipping per-example gradient norms.

  Raises:
    fedlap_jax.per_example.NotDpSafe: for every ``method``, a model that
      mixes examples or holds state outside its parameters (BatchNorm in
      flax.linen, NNX or Equinox; :func:`fedlap_jax.per_example.check_dp_model`
      says what is detected), whose per-example gradients would not bound one
      record's influence.
  """
  if method not in PER_EXAMPLE_METHODS:
    raise ConfigError("method", method, f"{PER_EXAMPLE_METHODS}")
  if _given(l2_clip_norm):
    checks.positive_float("l2_clip_norm", l2_clip_norm)
  _per_example.check_dp_model(apply_fn, params, x)  # every method, auto included
  if method == "auto":
    method, auto_microbatch = _per_example.auto_plan(apply_fn, params, x)
    if microbatch_size is None:
      microbatch_size = auto_microbatch
  kwargs: dict[str, Any] = dict(l2_clip_norm=l2_clip_norm, microbatch_size=microbatch_size)
  if method == "layerwise":
    return _per_example.clipped_gradient_sum(apply_fn, params, x, y, is_padding, **kwargs)
  if method == "vmap":
    return _per_example.clipped_gradient_sum_vmap(apply_fn, params, x, y, is_padding, **kwargs)
  from jax_privacy import clipping  # optional dependency, imported when asked for

  def loss(p, xb, yb):
    return jnp.sum(cross_entropy(apply_fn(p, xb), yb))

  grad_fn = clipping.clipped_grad(
    loss,
    l2_clip_norm=l2_clip_norm,
    batch_argnums=(1, 2),
    return_grad_norms=True,
    microbatch_size=microbatch_size,
  )
  clipped_sum, aux = grad_fn(params, x, y, is_padding_example=is_padding)
  return clipped_sum, aux.grad_norms


def add_gaussian_noise(key: jax.Array, tree: PyTree, stddev: jax.Array | float) -> PyTree:
  """Adds i.i.d. ``N(0, stddev^2)`` to every scalar of ``tree``."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noisy = [
    leaf + stddev * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)
  ]
  return jax.tree.unflatten(treedef, noisy)


def private_gradient(
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  expected_batch_size: jax.Array | float,
  microbatch_size: int | None = None,
  method: str = "auto",
) -> tuple[PyTree, jax.Array]:
  """The Gaussian mechanism on clipped per-example gradients (Algorithm 3).

  ``(sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / B`` with ``B`` the expected
  batch size ``q N_k`` (not the realised one, which would leak the batch size).

  Args:
    key: PRNG key for the noise.
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: model parameters.
    x: ``(capacity, ...)`` batch buffer; y: ``(capacity,)`` int labels.
    is_padding: ``(capacity,)`` bool, True for empty slots.
    l2_clip_norm: clipping bound ``C`` (> 0).
    noise_multiplier: ``sigma`` (noise std divided by ``C``).
    expected_batch_size: ``B``.
    microbatch_size: optional microbatching to bound memory.
    method: per-example gradient method of :func:`clipped_gradient_sum`.

  Returns:
    ``(noisy_mean_gradient, per_example_norms)``.
  """
  clipped_sum, norms = clipped_gradient_sum(
    apply_fn,
    params,
    x,
    y,
    is_padding,
    l2_clip_norm=l2_clip_norm,
    microbatch_size=microbatch_size,
    method=method,
  )
  return privatise(
    key,
    clipped_sum,
    l2_clip_norm=l2_clip_norm,
    noise_multiplier=noise_multiplier,
    expected_batch_size=expected_batch_size,
  ), norms


def privatise(
  key: jax.Array,
  clipped_sum: PyTree,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  expected_batch_size: jax.Array | float,
) -> PyTree:
  """``(clipped_sum + N(0, sigma^2 C^2 I)) / B``: the noise of Algorithm 3 on a clipped sum.

  ``clipped_sum`` is the sum over the *whole* Poisson batch of per-example
  gradients clipped to ``C`` (e.g. :func:`clipped_gradient_sum` added up by
  :func:`sum_over_chunks`), so adding or removing one record moves it by at
  most ``C``; ``B`` is the expected batch size.

  Raises:
    ConfigError: a number (not a traced value) outside ``C > 0``, ``sigma >= 0``, ``B > 0``.
  """
  for field, value in (
    ("l2_clip_norm", l2_clip_norm),
    ("expected_batch_size", expected_batch_size),
  ):
    if _given(value):
      checks.positive_float(field, value)
  if _given(noise_multiplier):
    checks.nonneg_float("noise_multiplier", noise_multiplier)  # 0: clipping only, no noise
  noisy = add_gaussian_noise(key, clipped_sum, noise_multiplier * l2_clip_norm)
  return jax.tree.map(lambda g: g / expected_batch_size, noisy)
