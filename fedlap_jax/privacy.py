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
* :func:`poisson_gradient` is every method's one access to a client's records:
  the gradient of one Poisson batch at a model, under DP the Gaussian mechanism
  of Algorithm 3 (per-example gradients clipped to L2 norm ``C`` over the whole
  parameter pytree, summed over every chunk of the draw, ``N(0, sigma^2 C^2)``
  noise added to the sum, divided by the *expected* batch size ``B``). Its
  static query :class:`PoissonGradient` carries ``B``, ``C`` and ``sigma`` and
  declares the :class:`~fedlap_jax.accounting.DpMechanism` of ``T`` such
  accesses per round (:meth:`PoissonGradient.mechanism`): the noise drawn and
  the noise accounted are read from one value. :func:`privatise` is its noise.

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

import dataclasses
import numbers
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax import per_example as _per_example
from fedlap_jax import accounting, checks, dsa
from fedlap_jax.checks import ConfigError
from fedlap_jax.dp_config import PER_EXAMPLE_METHODS

# The buffer of poisson_sample, and the smallest one a config may ask for.
from fedlap_jax.dp_config import check_poisson_capacity  # noqa: F401
from fedlap_jax.dp_config import min_poisson_capacity  # noqa: F401
from fedlap_jax.dp_config import poisson_capacity  # noqa: F401
from fedlap_jax.client_data import ClientData
from fedlap_jax.losses import cross_entropy, masked_mean_loss  # noqa: F401
from fedlap_jax.types import ApplyFn, PyTree

# How the non-private gradient of a batch is normalised: by the records drawn, or by B.
GRADIENT_MEANS = ("realized", "expected")


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
  chunk_sum: Callable[[jax.Array, jax.Array], PyTree],
  batch: PoissonBatch,
  *,
  zeros: PyTree | None = None,
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

  ``zeros``: the accumulator's start, a pytree like ``chunk_sum``'s result (e.g. zeros like
  the model's parameters); ``None`` traces ``chunk_sum`` once more (in ``jax.eval_shape``)
  to find its shapes.
  """
  if zeros is None:
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


# --------------------------------------------------------------------------
# The one DP gradient.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoissonGradient:
  """One access to a client's records: the gradient of a Poisson batch, clipped and noised.

  The static query of :func:`poisson_gradient` (hashable: a jit static). In the spirit of
  ``jax_privacy``'s ``clipped_grad``, it carries what the accountant needs: ``B`` (the
  sampling rate ``q = B / N_k``), the clip ``C`` (one record moves the clipped sum by at most
  ``C``: its L2 sensitivity) and the noise multiplier ``sigma`` (noise std ``sigma * C`` on the
  sum); :meth:`mechanism` declares the :class:`~fedlap_jax.accounting.DpMechanism` of ``T``
  such accesses per round from those very fields.

  Attributes:
    batch_size: ``B``, expected records per batch, >= 1.
    capacity: the Poisson buffer (a chunk of the draw; a draw beyond it is read in further
      chunks, never dropped), >= 1.
    l2_clip_norm: ``C`` > 0: per-example clipping (the private path); ``None``: the
      non-private gradient (no clipping, no noise).
    noise_multiplier: ``sigma >= 0`` (only with ``l2_clip_norm``; 0 is clipped SGD without
      noise, for ablations and tests: no mechanism is declared for it).
    microbatch_size: per-example gradients this many examples at a time (private path;
      ``None``: the plan of :func:`fedlap_jax.per_example.auto_plan` under ``"auto"``, one
      pass otherwise); the non-private path always uses that plan.
    per_example_method: how per-example gradients are computed (:func:`clipped_gradient_sum`).
    gradient_mean: ``"realized"`` (the mean over the records drawn) or ``"expected"`` (the sum
      divided by ``B``); ``None``: ``"expected"`` on the private path, which requires it (the
      realised batch size would leak), ``"realized"`` otherwise.
    dsa_strategy: DSA families of the batch (one draw for the whole batch); ``""``: none.
    track_loss: also return the batch's summed loss (:attr:`BatchGradient.loss_sum`); on the
      private path it costs one more forward pass and is a non-private diagnostic.
  """

  batch_size: int
  capacity: int
  l2_clip_norm: float | None = None
  noise_multiplier: float = 0.0
  microbatch_size: int | None = None
  per_example_method: str = "auto"
  gradient_mean: str | None = None
  dsa_strategy: str = ""
  track_loss: bool = False

  def __post_init__(self):
    checks.positive_int("batch_size", self.batch_size)
    checks.positive_int("capacity", self.capacity)
    checks.require(
      self.l2_clip_norm is None or checks.is_real(self.l2_clip_norm) and self.l2_clip_norm > 0,
      "l2_clip_norm",
      self.l2_clip_norm,
      "None or a finite number > 0",
    )
    checks.nonneg_float("noise_multiplier", self.noise_multiplier)
    checks.require(
      self.private or self.noise_multiplier == 0,
      "noise_multiplier",
      self.noise_multiplier,
      "0 when l2_clip_norm is None (noise without clipping has no sensitivity bound)",
    )
    checks.require(
      self.microbatch_size is None
      or checks.is_int(self.microbatch_size)
      and self.microbatch_size >= 1,
      "microbatch_size",
      self.microbatch_size,
      "None or an integer >= 1",
    )
    checks.one_of("per_example_method", self.per_example_method, PER_EXAMPLE_METHODS)
    checks.require(
      self.gradient_mean is None or self.gradient_mean in GRADIENT_MEANS,
      "gradient_mean",
      self.gradient_mean,
      f"None or one of {GRADIENT_MEANS}",
    )
    checks.require(
      not self.private or self.gradient_mean in (None, "expected"),
      "gradient_mean",
      self.gradient_mean,
      "'expected' or None with clipping (dividing by the realised batch size would leak it)",
    )
    dsa.check_strategy("dsa_strategy", self.dsa_strategy)
    checks.require(isinstance(self.track_loss, bool), "track_loss", self.track_loss, "a bool")

  @classmethod
  def of(cls, dp, *, batch_size: int, capacity: int, **rest) -> "PoissonGradient":
    """The query of a method under ``dp`` (a :class:`~fedlap_jax.dp_config.DPConfig`, or ``None``
    for the non-private gradient): its clip, noise, microbatch and per-example method."""
    if dp is None:
      return cls(batch_size=batch_size, capacity=capacity, **rest)
    return cls(
      batch_size=batch_size,
      capacity=capacity,
      l2_clip_norm=dp.l2_clip_norm,
      noise_multiplier=dp.noise_multiplier,
      microbatch_size=dp.microbatch_size,
      per_example_method=dp.per_example_method,
      **rest,
    )

  @property
  def private(self) -> bool:
    """Whether per-example gradients are clipped (and noised)."""
    return self.l2_clip_norm is not None

  def check_model(self, apply_fn: ApplyFn, params: PyTree, x: Any) -> None:
    """On the private path, refuses a model :func:`fedlap_jax.per_example.check_dp_model`
    refuses (``x``: an array or a ``jax.ShapeDtypeStruct`` of model inputs).

    The entry points run it before any trace of ``apply_fn``: tracing an NNX ``BatchNorm``
    in train mode would otherwise fail first, in Flax's own check of where it mutates its
    statistics.

    Raises:
      fedlap_jax.per_example.NotDpSafe: as :func:`~fedlap_jax.per_example.check_dp_model`.
    """
    if self.private:
      _per_example.check_dp_model(apply_fn, params, x)

  @property
  def mean_by(self) -> str:
    """The resolved ``gradient_mean``."""
    if self.gradient_mean is not None:
      return self.gradient_mean
    return "expected" if self.private else "realized"

  @property
  def l2_sensitivity(self) -> float | None:
    """``C``: adding or removing one record moves the clipped sum by at most ``C`` (``None``
    off the private path). The accountant's PLD also reads replace-one (:mod:`accounting`)."""
    return self.l2_clip_norm

  @property
  def noise_stddev(self) -> float | None:
    """``sigma * C``, the standard deviation of the noise on the clipped sum."""
    return None if self.l2_clip_norm is None else self.noise_multiplier * self.l2_clip_norm

  def mechanism(
    self, *, steps_per_round: int, delta: float, adjacency: str = accounting.REPLACE_ONE
  ) -> accounting.DpMechanism:
    """The :class:`~fedlap_jax.accounting.DpMechanism` of ``T = steps_per_round`` such
    accesses per round: ``sigma`` and ``B`` of this query, ``delta`` of the report.

    Raises:
      ConfigError: off the private path, or ``sigma = 0`` (no guarantee to account for).
    """
    checks.require(
      self.private and self.noise_multiplier > 0,
      "noise_multiplier",
      self.noise_multiplier,
      "a number > 0 with l2_clip_norm set (a mechanism needs clipping and noise)",
    )
    return accounting.DpMechanism(
      noise_multiplier=self.noise_multiplier,
      batch_size=self.batch_size,
      steps_per_round=steps_per_round,
      delta=delta,
      adjacency=adjacency,
    )


class BatchGradient(NamedTuple):
  """What :func:`poisson_gradient` returns.

  Attributes:
    gradient: a pytree like the model: on the private path the sum of per-example gradients
      clipped to ``C`` plus ``N(0, sigma^2 C^2)`` noise, divided by the expected batch size
      ``B`` (:func:`privatise`); otherwise the summed gradient divided by the records drawn
      (``"realized"``) or by ``B`` (``"expected"``).
    aug_key, family_key: the batch's DSA draw (FedLAP's and PSG's synthetic batch reuse it);
      ``family_key`` is ``None`` without a shared family key.
    batch_size: int32, records drawn (all chunks).
    extra_chunks: int32, chunks of the draw beyond the first.
    clipped: float32, per-example gradients clipped (0 off the private path).
    loss_sum: float32, the summed loss over the batch with ``track_loss``; ``None`` without.

  On the private path ``gradient`` is the mechanism's output; the fields of
  :attr:`NONPRIVATE` are raw statistics of the records: diagnostics, not to be released.
  """

  NONPRIVATE = ("batch_size", "extra_chunks", "clipped", "loss_sum")  # type: ignore[misc]  # a class constant, not a field

  gradient: PyTree
  aug_key: jax.Array
  family_key: jax.Array | None
  batch_size: jax.Array
  extra_chunks: jax.Array
  clipped: jax.Array
  loss_sum: jax.Array | None = None


def poisson_gradient(
  query: PoissonGradient,
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  data: ClientData,
  *,
  family_key: jax.Array | None = None,
) -> BatchGradient:
  """The gradient of one Poisson batch of ``data`` at ``params``: a method's access to records.

  Each valid record is drawn with probability ``q = B / N_k`` (:func:`poisson_sample`; every
  record drawn counts, also when the draw overflows the buffer: :func:`sum_over_chunks`),
  the batch gets one DSA draw of ``query.dsa_strategy``, and on the private path each
  example's gradient is clipped to ``C``, the sum over the whole draw noised and divided by
  ``B`` (:func:`privatise`, Algorithm 3); otherwise the summed gradient is divided by the
  records drawn or by ``B`` (``query.gradient_mean``).

  Keys: ``k_sample, k_aug, k_noise = split(key, 3)``; with a shared family key the batch's
  family is drawn with ``split(family_key, 3)[1]``. Pure, jit- and vmap-compatible
  (``query`` static). The per-example gradient is one copy in the program: the first chunk
  and any overflow chunk run through one ``lax.while_loop`` body.

  Args:
    query: the static :class:`PoissonGradient`.
    key: this access's PRNG key.
    apply_fn, params: the model and the parameters the gradient is taken at.
    data: the client's records, padded with a mask (no client axis).
    family_key: the DSA family key shared by the clients of a round, or ``None``.

  Returns:
    :class:`BatchGradient`.
  """
  q = query
  k_sample, k_aug, k_noise = jax.random.split(key, 3)
  f_aug = None if family_key is None else jax.random.split(family_key, 3)[1]
  rate = q.batch_size / jnp.maximum(jnp.sum(data.mask), 1).astype(jnp.float32)
  batch = poisson_sample(k_sample, data.mask, rate, q.capacity)
  augment = dsa.make_augment_fn(q.dsa_strategy)
  f32 = jnp.float32

  def chunk(indices, is_padding):
    # One DSA draw per batch (every chunk gets the same transform).
    xb = augment(k_aug, data.images(indices), family_key=f_aug)
    yb = data.y[indices]
    if not q.private:
      # Chunked on CPU for matmul-convolution models (the plan of the DP gradient).
      g, loss = real_gradient_sum(apply_fn, params, xb, yb, is_padding, microbatch_size="auto")
      return (g, loss, f32(0.0)) if q.track_loss else (g, f32(0.0))
    g, norms = clipped_gradient_sum(
      apply_fn,
      params,
      xb,
      yb,
      is_padding,
      l2_clip_norm=q.l2_clip_norm,
      microbatch_size=q.microbatch_size,
      method=q.per_example_method,
    )
    clipped = jnp.sum(jnp.logical_and(norms > q.l2_clip_norm, ~is_padding)).astype(f32)
    if not q.track_loss:
      return g, clipped
    weights = jnp.logical_not(is_padding).astype(f32)
    loss = jnp.sum(weights * cross_entropy(apply_fn(params, xb), yb))
    return g, loss, clipped

  grad_zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
  zeros = (grad_zeros, f32(0.0), f32(0.0)) if q.track_loss else (grad_zeros, f32(0.0))
  sums = sum_over_chunks(chunk, batch, zeros=zeros)
  total, loss_sum, clipped = sums if q.track_loss else (sums[0], None, sums[1])
  if q.l2_clip_norm is not None:  # the private path
    g = privatise(
      k_noise,
      total,
      l2_clip_norm=q.l2_clip_norm,
      noise_multiplier=q.noise_multiplier,
      expected_batch_size=q.batch_size,
    )
  else:
    if q.mean_by == "realized":
      denominator = jnp.maximum(batch.size, 1).astype(f32)
    else:
      denominator = f32(q.batch_size)
    g = jax.tree.map(lambda t: t / denominator, total)
  return BatchGradient(  # type: ignore[call-arg]  # (NONPRIVATE is no field)
    gradient=g,
    aug_key=k_aug,
    family_key=f_aug,
    batch_size=batch.size,
    extra_chunks=batch.extra_chunks,
    clipped=clipped,
    loss_sum=loss_sum,
  )
