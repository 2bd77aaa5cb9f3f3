"""Record-level DP settings shared by every DP method: :class:`DPConfig` (the noise, the
clipping bound, ``delta``), :class:`DpAccesses` (what a method's config tells the
accountant about one round of a client) and the Poisson batch buffer
(:func:`poisson_capacity`) that every DP gradient draws into.

Every constructor validates its fields and raises
:class:`~fedlap_jax.checks.ConfigError` (a ``ValueError``) naming the field,
the value and what is allowed. Nothing is clamped silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from fedlap_jax import accounting
from fedlap_jax.checks import (
  ConfigError,
  is_int,
  is_real,
  one_of,
  positive_float,
  positive_int,
  require,
)

PER_EXAMPLE_METHODS = ("auto", "layerwise", "vmap", "jax_privacy")


def poisson_capacity(batch_size: int, num_std: float = 6.0) -> int:
  """A static buffer size for Poisson batches of expected size ``batch_size``.

  A Poisson batch has mean ``B`` and variance ``B (1 - q) <= B``; ``B + 6 sqrt(B)``
  (plus a small constant) is exceeded with probability below ``1e-8``.
  """
  if batch_size < 1:
    raise ConfigError("batch_size", batch_size, "an integer >= 1")
  return int(math.ceil(batch_size + num_std * math.sqrt(batch_size) + 4))


def min_poisson_capacity(batch_size: int) -> int:
  """The smallest buffer a config may ask for: ``ceil(B + 3 sqrt(B))``.

  Below it, a draw overflows the buffer often (at ``capacity = B`` in about
  half of the steps), and every overflow costs another pass over a chunk of
  ``capacity`` slots (:func:`fedlap_jax.privacy.sum_over_chunks`). Sampling
  stays exact either way; this bound is about speed.
  """
  return int(math.ceil(batch_size + 3.0 * math.sqrt(batch_size)))


def check_poisson_capacity(capacity, batch_size: int, field: str = "poisson_capacity") -> None:
  """Refuses a buffer below :func:`min_poisson_capacity` (``None``, the default, passes)."""
  if capacity is None:
    return
  low = min_poisson_capacity(batch_size)
  require(
    is_int(capacity) and capacity >= low,
    field,
    capacity,
    f"None (the default, {poisson_capacity(batch_size)} slots for batch_size="
    f"{batch_size}) or an integer >= {low} = batch_size + 3 sqrt(batch_size): a smaller "
    f"buffer overflows often (about half of the steps at {field} = batch_size) and every "
    "overflow costs an extra pass over a chunk of that size (no record is dropped, but "
    "the run gets slow)",
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPConfig:
  """Record-level DP of the real-data gradients (Algorithm 3).

  All fields are required: a default could silently weaken the guarantee.

  Attributes:
    noise_multiplier: ``sigma``; the noise std on the clipped sum is
      ``sigma * l2_clip_norm``. Must be > 0 (sigma = 0 voids the guarantee).
    l2_clip_norm: ``C``, per-example clipping bound on the full gradient.
    delta: target ``delta`` in (0, 1) for reporting epsilon.
    microbatch_size: optional, bounds the memory of per-example gradients.
    per_example_method: how per-example gradients are computed, all exact:
      ``"auto"`` (default), ``"layerwise"``, ``"vmap"`` or ``"jax_privacy"``
      (see :func:`fedlap_jax.privacy.clipped_gradient_sum`). ``"layerwise"``
      serves flax.linen models built from Flax layers only; Flax NNX,
      Equinox and plain-JAX models get ``"vmap"`` (which ``"auto"`` picks for
      them; ``"layerwise"`` refuses them). Under every method a model with
      BatchNorm or other state outside its parameters is refused
      (:func:`fedlap_jax.per_example.check_dp_model`).

  Refused when built, as accounting (:mod:`fedlap_jax.accounting`) would refuse them after
  training: a ``noise_multiplier`` below
  :data:`~fedlap_jax.accounting.MIN_NOISE_MULTIPLIER` (0.3), and a ``delta`` of at least
  ``1 / 2`` (every client holds ``N_k >= 2`` records and needs ``delta < 1 / N_k``;
  :func:`fedlap_jax.methods.fedlap.client.local_approx` checks that bound on the ``N_k`` it sees).
  """

  noise_multiplier: float
  l2_clip_norm: float
  delta: float
  microbatch_size: int | None = None
  per_example_method: str = "auto"

  def __post_init__(self):
    require(
      is_real(self.noise_multiplier) and self.noise_multiplier > 0,
      "dp.noise_multiplier",
      self.noise_multiplier,
      "a number > 0 (sigma = 0 with DP on gives no privacy guarantee; turn DP off instead)",
    )
    accounting.check_accountable_sigma(self.noise_multiplier, "dp.noise_multiplier")
    positive_float("dp.l2_clip_norm", self.l2_clip_norm)
    require(
      is_real(self.delta) and 0 < self.delta < 0.5,
      "dp.delta",
      self.delta,
      "a number in the open interval (0, 1/2): delta < 1 / N_k, N_k >= 2 the records of a "
      "client (a delta of 1 / N_k allows releasing a whole record)",
    )
    if self.microbatch_size is not None:
      positive_int("dp.microbatch_size", self.microbatch_size)
    one_of("dp.per_example_method", self.per_example_method, PER_EXAMPLE_METHODS)


class DpAccesses(NamedTuple):
  """What a DP method's library config tells the accountant about one round of a client.

  Every library config of a method has ``dp_accesses() -> DpAccesses | None``;
  :meth:`fedlap_jax.accounting.DpMechanism.from_config` turns it into the
  method's mechanism (the one place ``B`` and ``T`` become one).

  Attributes:
    dp: the noise (``sigma``) and ``delta``.
    batch_size: ``B``, the expected Poisson batch size (``q_k = B / N_k``).
    steps_per_round: ``T``, the worst-case noisy accesses to a client's
      records per round.
  """

  dp: DPConfig
  batch_size: int
  steps_per_round: int
