"""Gradient-sharing baselines: FedSGD, FedAvg, FedProx, SCAFFOLD, DP-FedAvg, DP-FedProx.

The baselines FedLAP is compared against (Tables 1 and 2 of the paper), on the
same model convention (``apply_fn(params, x) -> logits``), the same stacked
:class:`~fedlap_jax.client_data.ClientData`, the same Poisson sampling and privacy
primitives (:mod:`fedlap_jax.privacy`) and the same accounting
(:mod:`fedlap_jax.accounting`, ``T`` = local DP-SGD steps scheduled per round).

One round, every client taking part (as in the reference)::

  for every client k (jax.vmap over the stacked client axis):
    y <- x                                        # the global model
    for s in 0..T_static-1 (lax.fori_loop; steps s >= T_k are skipped):
      Poisson batch, q = B / N_k                  # privacy.poisson_sample
      g = grad of the mean loss at y              # DP: clip to C, N(0, sigma^2 C^2), / B
      g += 2 mu (y - x)                           # FedProx
      g += c - c_k                                # SCAFFOLD
      y <- y - eta_m g
    SCAFFOLD: c_k <- c_k - c + (x - y) / (T_k eta_m)          (option II)
  x <- x + eta_s sum_k w_k (y_k - x)              # w_k = N_k / N (1 / K under DP)
  SCAFFOLD: c <- c + sum_k w_k (c_k^+ - c_k)

The two halves are :func:`client_step` (what one client computes and sends,
its model ``y_k``) and :func:`server_step_with_state` (the weighted FedAvg step), as in
FedJAX's ``FederatedAlgorithm`` and Flower's baselines. The methods of
:mod:`fedlap_jax.methods.fedavg` run them, and their rounds are the one generic round
(:func:`fedlap_jax.rounds.algorithm` of ``fedlap_jax.methods.REGISTRY["fedavg"]``, ...),
which ``experiments.run`` and the Flower app's FedAvg run too.

Optimisers. The client's local steps and the server's step are SGD written out by default;
:class:`BaselineConfig`'s ``client_optimizer`` and ``server_optimizer`` (or the optax
transformations given to :func:`fedlap_jax.methods.fedavg.family`) replace either. The server's
(FedOpt: Reddi et al., ICLR 2021) steps on ``-sum_k w_k (y_k - x)`` and its state is carried
across rounds in :attr:`BaselineState.opt_state`.

Methods (hyperparameters as in the reference implementation):

* ``fedavg`` (McMahan et al., 2017): ``local_epochs`` epochs of SGD with Poisson
  batches of expected size ``B``; client learning rate ``eta_m`` from the cosine
  schedule over rounds (:func:`~fedlap_jax.training.cosine_learning_rate`);
  the server adds the weighted mean client delta (server learning rate 1).
* ``fedprox`` (Li et al., 2020): FedAvg with ``mu * ||w - w_g||^2`` added to the
  client loss. Note: the reference adds ``mu ||.||^2``, not the ``mu / 2`` of
  the FedProx paper; we follow the reference, so the proximal gradient is
  ``2 mu (w - w_g)`` (``mu = 0.1``).
* ``fedsgd``: one local step on one Poisson batch per round (``local_epochs``
  is ignored).
* ``scaffold`` (Karimireddy et al., 2020): control variates, option II; with
  client sampling (``clients_per_round = m``) only the sampled clients update
  their ``c_k`` and the server's step is scaled by ``m / K``; the upload is
  the model delta *and* the control delta, ``2 x num_params`` floats. ``T_k`` in ``c_k^+`` is the number of steps
  the client actually took. The server moves ``c`` by the same weights ``w_k``
  as the model, so ``c`` stays the weighted mean of the ``c_k``; with uniform
  weights (or balanced clients) this is the paper's ``c += (|S|/N) mean dc_k``.
* ``dp_fedavg`` / ``dp_fedprox``: local DP-SGD (per-example clipping to ``C``
  over the whole gradient, ``N(0, sigma^2 C^2)`` on the sum, divided by the
  *expected* batch size ``B``; :func:`~fedlap_jax.privacy.poisson_gradient`).
  The proximal term does not touch data and is added after privatisation.
  The server weights clients uniformly by default (as FedLAP-DP's Algorithm 3:
  ``N_k`` is not released).

Local step counts. An epoch of client ``k`` is ``round(N_k / B)`` Poisson steps
(at least 1; ``round`` half up), as in the reference (195 steps over 5 epochs
for ``N_k = 10,000``, ``B = 256``). Loop bounds must be static, so every client
runs a loop of ``T = local_epochs * round(N_max / B)`` steps and skips (masks)
the steps beyond its own ``T_k = local_epochs * round(N_k / B)``; ``N_max`` is
``max_client_size`` (or the padded client size when that is not given). ``T``
is the ``dp_steps_per_round`` the accountant charges every client: an upper
bound of every ``T_k`` (and exact for the largest client). Because ``T_k``
depends on ``N_k``, ``uniform_steps=True`` makes every client run exactly ``T``
steps (a data-independent count) for a strict record-level reading.

Gradient normalisation (:attr:`LocalTraining.gradient_mean`): non-DP steps use the mean loss
over the realised Poisson batch (the reference), DP steps divide the noisy clipped sum by the
expected ``B`` (the realised size would leak).

No DSA by default (``dsa_strategy=""``): the reference trains the baselines on
plain batches.

References:
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017.
  Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.
  Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
  Learning", ICML 2020.
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import dsa, optim, privacy
from fedlap_jax.checks import ConfigError, is_int, is_real, nonneg_float, one_of, require
from fedlap_jax.client_data import (
  ClientData,
  check_batch_size,
  check_finite,
  check_labels,
  check_records,
  num_classes_of,
  on_device,
  poison_unless,
)
from fedlap_jax.dispatch import WEIGHTINGS, resolve_weighting
from fedlap_jax.dp_config import DpAccesses, PER_EXAMPLE_METHODS, DPConfig, check_poisson_capacity
from fedlap_jax.training import LR_SCHEDULES
from fedlap_jax.dispatch import client_weights
from fedlap_jax.training import cosine_learning_rate, tree_distance
from fedlap_jax.types import ApplyFn, PyTree


class BaselineFacts(NamedTuple):
  """What a gradient-sharing baseline's name implies; its config checks these facts, not
  the name (:class:`fedlap_jax.baselines.BaselineConfig`, and the registry's methods).

  Attributes:
    private: a DP method: local DP-SGD, a ``dp`` config, ``uniform`` server weights (the
      default weighting; ``size`` otherwise).
    prox: the FedProx term ``mu ||w - w_g||^2`` is allowed (``prox_mu > 0``).
    control_variates: SCAFFOLD's correction ``c - c_k``; it sends the control delta too.
    fixed_steps: every client takes exactly this many local steps (FedSGD: 1); ``None``:
      ``local_epochs`` epochs.
  """

  private: bool = False
  prox: bool = False
  control_variates: bool = False
  fixed_steps: int | None = None


BASELINE_FACTS = {
  "fedavg": BaselineFacts(),
  "fedprox": BaselineFacts(prox=True),
  "fedsgd": BaselineFacts(fixed_steps=1),
  "scaffold": BaselineFacts(control_variates=True),
  "dp_fedavg": BaselineFacts(private=True),
  "dp_fedprox": BaselineFacts(private=True, prox=True),
}
METHODS = tuple(BASELINE_FACTS)
DP_METHODS = tuple(n for n, f in BASELINE_FACTS.items() if f.private)

__all__ = [
  "METHODS",
  "BaselineConfig",
  "BaselineState",
  "BaselineRoundMetrics",
  "ClientMetrics",
  "LocalTraining",
  "baseline_config",
  "client_step",
  "client_update",
  "init_baseline_state",
  "learning_rate",
  "round_key",
  "round_keys",
  "server_state",
  "server_step_with_state",
  "step_keys",
  "steps_per_epoch",
]


def steps_per_epoch(num_records, batch_size: int):
  """Poisson steps in one local epoch: ``max(1, round(N / B))``, rounding half up.

  Works on Python ints (static) and on traced arrays alike.
  """
  if isinstance(num_records, (jax.Array, np.ndarray)):
    return jnp.maximum(jnp.floor(num_records / batch_size + 0.5).astype(jnp.int32), 1)
  return max(1, math.floor(num_records / batch_size + 0.5))


# --------------------------------------------------------------------------
# Configuration.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalTraining:
  """Static settings of local training on one client (hashable: a jit static).

  Attributes:
    epochs: local epochs ``E``; each is ``round(N_k / B)`` steps.
    batch_size: expected Poisson batch size ``B``; the sampling rate is
      ``q = B / N_k``.
    fixed_steps: if set, every client takes exactly this many steps whatever
      its size (FedSGD: 1; ``uniform_steps``: ``T``); ``epochs`` is then unused.
    max_client_size: ``N_max``, records of the largest client, for the static
      loop bound ``T = E * round(N_max / B)``; ``None`` uses the padded client
      size of the data the round is traced with.
    poisson_capacity: static Poisson buffer; ``None`` picks
      :func:`~fedlap_jax.privacy.poisson_capacity` of ``B``; at least
      ``B + 3 sqrt(B)``. A draw beyond it is processed in extra chunks
      (:func:`~fedlap_jax.privacy.sum_over_chunks`), never dropped.
    prox_mu: ``mu`` of the FedProx term ``mu ||w - w_g||^2`` (0: none).
    l2_clip_norm: per-example clip ``C``; ``None`` trains without clipping or
      noise (non-DP).
    noise_multiplier: ``sigma`` (noise std / ``C``) of the private path, >= 0.
      0 is allowed *here* (clipped SGD without noise, for ablations and tests);
      :func:`baseline_config` builds the private path from a
      :class:`~fedlap_jax.dp_config.DPConfig` only, which requires ``sigma > 0``.
    microbatch_size: optional bound on per-example-gradient memory (DP).
    per_example_method: how the private path computes per-example gradients
      (:func:`~fedlap_jax.privacy.clipped_gradient_sum`; ``dp.per_example_method``).
    gradient_mean: ``"realized"`` (mean over the sampled batch) or
      ``"expected"`` (sum / ``B``); ``None`` picks ``"expected"`` when clipping
      and ``"realized"`` otherwise. The private path requires ``"expected"``.
    control_variates: SCAFFOLD's correction ``c - c_k`` is added to every
      gradient (supplied by the caller).
    dsa_strategy: DSA families applied to each real batch; ``""`` for none.
    track_loss: record the mean batch loss per client. On the private path it
      costs an extra forward pass per step and is a non-private diagnostic
      (:attr:`ClientMetrics.NONPRIVATE`).
  """

  epochs: int = 5
  batch_size: int = 256
  fixed_steps: int | None = None
  max_client_size: int | None = None
  poisson_capacity: int | None = None
  prox_mu: float = 0.0
  l2_clip_norm: float | None = None
  noise_multiplier: float = 0.0
  microbatch_size: int | None = None
  per_example_method: str = "auto"
  gradient_mean: str | None = None
  control_variates: bool = False
  dsa_strategy: str = ""
  track_loss: bool = True

  def __post_init__(self):
    require(
      is_int(self.epochs) and self.epochs >= 1, "local_epochs", self.epochs, "an integer >= 1"
    )
    require(
      is_int(self.batch_size) and self.batch_size >= 1,
      "batch_size",
      self.batch_size,
      "an integer >= 1",
    )
    for f in ("fixed_steps", "max_client_size", "microbatch_size"):
      v = getattr(self, f)
      require(v is None or (is_int(v) and v >= 1), f, v, "None or an integer >= 1")
    check_poisson_capacity(self.poisson_capacity, self.batch_size)
    nonneg_float("prox_mu", self.prox_mu)
    one_of("per_example_method", self.per_example_method, PER_EXAMPLE_METHODS)
    require(
      self.l2_clip_norm is None or (is_real(self.l2_clip_norm) and self.l2_clip_norm > 0),
      "l2_clip_norm",
      self.l2_clip_norm,
      "None or a finite number > 0",
    )
    nonneg_float("noise_multiplier", self.noise_multiplier)
    require(
      self.l2_clip_norm is not None or self.noise_multiplier == 0,
      "noise_multiplier",
      self.noise_multiplier,
      "0 when l2_clip_norm is None (noise without clipping has no sensitivity bound)",
    )
    require(
      self.gradient_mean is None or self.gradient_mean in privacy.GRADIENT_MEANS,
      "gradient_mean",
      self.gradient_mean,
      f"None or one of {privacy.GRADIENT_MEANS}",
    )
    require(
      self.l2_clip_norm is None or self.gradient_mean in (None, "expected"),
      "gradient_mean",
      self.gradient_mean,
      "'expected' or None with clipping (dividing by the realised batch size would leak it)",
    )
    dsa.check_strategy("dsa_strategy", self.dsa_strategy)

  @property
  def private(self) -> bool:
    """Whether gradients are clipped per example (and noised)."""
    return self.l2_clip_norm is not None

  @property
  def capacity(self) -> int:
    """Static size of the Poisson batch buffer."""
    return self.poisson_capacity or privacy.poisson_capacity(self.batch_size)

  @property
  def gradient(self) -> privacy.PoissonGradient:
    """The query of every local step (:func:`fedlap_jax.privacy.poisson_gradient`): ``B``, the
    buffer, the clip, noise and microbatch of the private path, ``gradient_mean``, the DSA and
    the loss (always on the non-private path, where it is free; ``track_loss`` on the private
    path, one more forward pass)."""
    return privacy.PoissonGradient(
      batch_size=self.batch_size,
      capacity=self.capacity,
      l2_clip_norm=self.l2_clip_norm,
      noise_multiplier=self.noise_multiplier,
      microbatch_size=self.microbatch_size if self.private else None,
      per_example_method=self.per_example_method,
      gradient_mean=self.gradient_mean,
      dsa_strategy=self.dsa_strategy,
      track_loss=self.track_loss or not self.private,
    )

  def scheduled_steps(self, padded_size: int | None = None) -> int:
    """Static loop bound ``T``: ``fixed_steps`` or ``E * round(N_max / B)``.

    Args:
      padded_size: the padded client size, used when ``max_client_size`` is None.
    """
    if self.fixed_steps is not None:
      return self.fixed_steps
    n_max = self.max_client_size or padded_size
    if n_max is None:
      raise ConfigError(
        "max_client_size",
        None,
        "an integer >= 1 (the static step count needs the largest client's size)",
      )
    return self.epochs * steps_per_epoch(int(n_max), self.batch_size)

  def client_steps(self, num_records: jax.Array) -> jax.Array:
    """Steps ``T_k`` client ``k`` takes (traced int32): ``E * round(N_k / B)``."""
    if self.fixed_steps is not None:
      return jnp.int32(self.fixed_steps)
    return self.epochs * steps_per_epoch(num_records, self.batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineConfig:
  """A whole baseline run (hashable: a jit static).

  Attributes:
    method: one of :data:`METHODS`; what it implies (DP, the FedProx term, control variates,
      a fixed step count) is its :data:`fedlap_jax.baselines.BASELINE_FACTS` entry, which the
      checks read (not the name).
    rounds: ``M``, also the length of the cosine schedule.
    learning_rate: ``eta_0`` of the client's cosine schedule.
    server_lr: ``eta_s``, the server's step on the weighted mean delta (1).
    weighting: ``size`` (``w_k = N_k / N``) or ``uniform`` (``1 / K``); DP
      methods require ``uniform`` (Algorithm 3). ``None`` (default): ``uniform``
      for DP methods, ``size`` otherwise.
    local: :class:`LocalTraining`. What the method's name implies is taken from it when
      ``local`` leaves it at its default (``control_variates=True`` for ``scaffold``,
      ``fixed_steps=1`` for ``fedsgd``); a value set otherwise is refused.
    dp: the :class:`~fedlap_jax.dp_config.DPConfig` whose clip, noise, microbatch
      and per-example method ``local`` uses, for DP methods (the guarantee the accountant
      reports); ``None`` for the others, and for a private path outside ``DPConfig``'s
      range (e.g. ``sigma = 0`` in tests), which then runs only through :func:`client_step`
      (no method's round takes it: the registry's DP methods require ``dp``). ``dp`` is the source of those
      four fields: a ``local`` that leaves them at their non-private defaults takes them
      from ``dp``; one that sets them must set ``dp``'s values.
    lr_schedule: ``cosine`` (reference; its last round at the floor, 1 % of ``eta_0``) or
      ``cosine_open`` (:func:`~fedlap_jax.training.cosine_learning_rate`).
    client_optimizer: the direction of the clients' local steps at ``eta_m``
      (:class:`~fedlap_jax.optim.Optimizer`; its state fresh per client and round). Default
      plain SGD, written out (``w - eta_m g``).
    server_optimizer: the server's direction at ``server_lr`` on the negated weighted mean
      delta (FedOpt: ``name='adam'`` / ``'yogi'`` / ``'adagrad'`` are FedAdam / FedYogi /
      FedAdagrad; its state carried across rounds in :attr:`BaselineState.opt_state`).
      Default plain SGD, written out (``x + server_lr d``).
  """

  method: str
  rounds: int
  learning_rate: float = 0.1
  server_lr: float = 1.0
  weighting: str | None = None
  local: LocalTraining = dataclasses.field(default_factory=LocalTraining)
  dp: DPConfig | None = None
  lr_schedule: str = "cosine"
  client_optimizer: optim.Optimizer = optim.SGD
  server_optimizer: optim.Optimizer = optim.SGD

  def __post_init__(self):
    one_of("method", self.method, METHODS)
    for f in ("client_optimizer", "server_optimizer"):
      v = getattr(self, f)
      require(isinstance(v, optim.Optimizer), f, v, "a fedlap_jax.optim.Optimizer")
    facts = BASELINE_FACTS[self.method]  # what the name implies
    private = facts.private
    require(is_int(self.rounds) and self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
    for f in ("learning_rate", "server_lr"):
      v = getattr(self, f)
      require(is_real(v) and v > 0, f, v, "a finite number > 0")
    if self.weighting is not None:
      one_of("weighting", self.weighting, WEIGHTINGS)
    object.__setattr__(self, "weighting", resolve_weighting(self.weighting, private))
    require(isinstance(self.local, LocalTraining), "local", self.local, "a LocalTraining")
    one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
    # dp is the source of the private path's clip, noise, microbatch and per-example method,
    # the name of the control variates and the fixed step count: a local that leaves them at
    # their defaults takes them (one that sets them must agree, below).
    implied = {}
    if private and isinstance(self.dp, DPConfig) and _dp_fields_unset(self.local):
      implied.update(_dp_fields(self.dp))
    if facts.control_variates and self.local.control_variates is False:
      implied["control_variates"] = True
    if facts.fixed_steps is not None and self.local.fixed_steps is None:
      implied["fixed_steps"] = facts.fixed_steps
    if implied:
      object.__setattr__(self, "local", dataclasses.replace(self.local, **implied))
    loc = self.local
    require(
      loc.private == private,
      "local.l2_clip_norm",
      loc.l2_clip_norm,
      "a clip norm for DP methods, None otherwise" + f" (method={self.method!r})",
    )
    require(
      facts.prox or loc.prox_mu == 0,
      "local.prox_mu",
      loc.prox_mu,
      f"0 for method={self.method!r} (use 'fedprox' or 'dp_fedprox')",
    )
    require(
      loc.control_variates == facts.control_variates,
      "local.control_variates",
      loc.control_variates,
      f"True exactly for 'scaffold' (method={self.method!r})",
    )
    require(
      facts.fixed_steps is None or loc.fixed_steps == facts.fixed_steps,
      "local.fixed_steps",
      loc.fixed_steps,
      "1 for 'fedsgd' (one local batch per round)",
    )
    if private:
      require(
        loc.fixed_steps is not None or loc.max_client_size is not None,
        "max_client_size",
        loc.max_client_size,
        f"an integer >= 1 for method={self.method!r} (the accountant needs the static "
        "step count T = local_epochs * round(max_client_size / batch_size))",
      )
    if self.dp is not None:
      require(isinstance(self.dp, DPConfig), "dp", self.dp, "a DPConfig or None")
      # A local path set by hand must be dp's: the accountant reports dp.
      require(
        private,
        "dp",
        self.dp,
        f"None for method={self.method!r} (use 'dp_fedavg' or 'dp_fedprox' for DP)",
      )
      for f in _DP_FIELDS:
        require(
          getattr(loc, f) == getattr(self.dp, f),
          f"local.{f}",
          getattr(loc, f),
          f"dp.{f} ({getattr(self.dp, f)!r}), the value the accountant reports",
        )

  def dp_accesses(self) -> DpAccesses | None:
    """DP-FedAvg / DP-FedProx's noisy accesses: ``T = local.scheduled_steps()`` local steps
    (the largest client's count, every client charged with it) on Poisson batches of
    expected size ``B`` per round; ``None`` for the non-DP methods."""
    if not BASELINE_FACTS[self.method].private or self.dp is None:
      return None
    return DpAccesses(self.dp, self.local.batch_size, self.local.scheduled_steps())


_DP_FIELDS = ("l2_clip_norm", "noise_multiplier", "microbatch_size", "per_example_method")
_NON_PRIVATE = {
  f.name: f.default for f in dataclasses.fields(LocalTraining) if f.name in _DP_FIELDS
}


def _dp_fields(dp: DPConfig) -> dict:
  """The :class:`LocalTraining` fields of the private path that ``dp`` sets."""
  return {f: getattr(dp, f) for f in _DP_FIELDS}


def _dp_fields_unset(local: LocalTraining) -> bool:
  """``local``'s private-path fields are all at their non-private defaults (and its
  ``gradient_mean`` allows clipping), so :class:`BaselineConfig` may take them from ``dp``."""
  return local.gradient_mean in (None, "expected") and all(
    getattr(local, f) == v for f, v in _NON_PRIVATE.items()
  )


# --------------------------------------------------------------------------
# State and metrics.
# --------------------------------------------------------------------------


class BaselineState(NamedTuple):
  """Server state between rounds.

  Attributes:
    params: the global model ``x``.
    round: int32, rounds completed so far.
    key: PRNG key for the next round.
    control: SCAFFOLD's server control variate ``c`` (like ``params``);
      ``None`` for the other methods.
    client_controls: SCAFFOLD's ``c_k``, leaves ``(K, ...)``; ``None`` otherwise.
    opt_state: the server optimiser's state, carried across rounds
      (:func:`server_step_with_state`); ``()`` for the default (SGD written out: nothing to carry). Last, so the checkpoint
      leaves of the other fields keep their names and a checkpoint written before the
      field restores.
  """

  params: PyTree
  round: jax.Array
  key: jax.Array
  control: PyTree = None
  client_controls: PyTree = None
  opt_state: PyTree = ()


class ClientMetrics(NamedTuple):
  """Diagnostics of :func:`client_update` (scalars; ``(K,)`` after vmap).

  Attributes:
    loss: mean over the steps taken of the batch's mean cross-entropy (nats),
      before the step, without the proximal term (0 if ``track_loss`` is off).
    steps: local steps taken, ``T_k``.
    update_norm: ``||y_k - x||``, L2 over all parameters.
    poisson_extra_chunks: extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is dropped).
    mean_batch_size: mean realised Poisson batch size (records).
    clip_fraction: fraction of per-example gradients clipped (0 without DP).

  On the private path ``update_norm`` is post-processing of the noised steps
  and ``steps`` depends only on the client size (public, as ``q = B / N_k``);
  the fields of :attr:`NONPRIVATE` are raw statistics of the real records,
  outside the DP mechanism: diagnostics, not to be released.
  """

  NONPRIVATE = ("loss", "poisson_extra_chunks", "mean_batch_size", "clip_fraction")  # type: ignore[misc]  # a class constant, not a field

  loss: jax.Array
  steps: jax.Array
  update_norm: jax.Array
  poisson_extra_chunks: jax.Array
  mean_batch_size: jax.Array
  clip_fraction: jax.Array


class BaselineRoundMetrics(NamedTuple):
  """Diagnostics of one round.

  Attributes:
    client: :class:`ClientMetrics` with ``(K,)`` leaves.
    learning_rate: the client learning rate ``eta_m`` of the round.
    server_update_norm: ``||x_new - x||``.
    control_norm: ``||c||`` after the round (SCAFFOLD; 0 otherwise).
  """

  client: ClientMetrics
  learning_rate: jax.Array
  server_update_norm: jax.Array
  control_norm: jax.Array


# --------------------------------------------------------------------------
# Keys (exposed so that a batch can be reproduced outside the loop).
# --------------------------------------------------------------------------


def round_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(next_state_key, k_clients)`` of a round; client ``k`` of ``K`` uses
  ``split(k_clients, K)[k]`` (:func:`round_keys`)."""
  key, k_clients = jax.random.split(key)
  return key, k_clients


def round_keys(key: jax.Array, num_clients: int) -> tuple[jax.Array, jax.Array]:
  """``(next_state_key, client_keys)`` of a round; ``client_keys`` is ``(K, ...)``."""
  key, k_clients = round_key(key)
  return key, jax.random.split(k_clients, num_clients)


def learning_rate(round_index, config: BaselineConfig):
  """The clients' ``eta_m`` in round ``m`` (1-based, may be traced): the cosine schedule."""
  return cosine_learning_rate(
    round_index, config.rounds, config.learning_rate, schedule=config.lr_schedule
  )


def step_keys(client_key: jax.Array, step) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(k_sample, k_augment, k_noise)`` of local step ``step`` (0-based) of a client."""
  k_sample, k_aug, k_noise = jax.random.split(jax.random.fold_in(client_key, step), 3)
  return k_sample, k_aug, k_noise


# --------------------------------------------------------------------------
# One client.
# --------------------------------------------------------------------------


def client_update(
  key: jax.Array,
  apply_fn: ApplyFn,
  global_params: PyTree,
  data: ClientData,
  *,
  learning_rate,
  local: LocalTraining,
  num_steps: int,
  correction: PyTree | None = None,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, ClientMetrics]:
  """Local training of one client from the global model ``x``.

  Pure and jit-compatible (``local`` and ``num_steps`` static); vmap it over a
  stacked client axis of ``key``, ``data`` and ``correction``.

  Step ``s`` takes the gradient of one Poisson batch
  (:func:`fedlap_jax.privacy.poisson_gradient` with ``local.gradient`` and the key
  ``fold_in(key, s)``, whose split is ``step_keys(key, s)``: the batch's draw, its
  augmentation and (DP) its noise), rate ``B / N_k`` and buffer ``local.capacity``.

  Args:
    key: PRNG key of this client and round.
    apply_fn: ``apply_fn(params, x) -> logits``.
    global_params: ``x``.
    data: the client's :class:`ClientData` (``(N, H, W, C)``, padded, masked).
    learning_rate: ``eta_m`` (may be traced).
    local: :class:`LocalTraining`.
    num_steps: static loop bound ``T``; steps ``s >= T_k`` are skipped.
    correction: SCAFFOLD's ``c - c_k`` (like ``params``), added to every
      gradient; required iff ``local.control_variates``.
    optimizer: the local steps' direction, an ``optax.GradientTransformation`` before the
      rate ``eta_m`` (:mod:`fedlap_jax.optim`), its state fresh for this client and round;
      ``None``: SGD written out, ``y <- y - eta_m g``. Static under jit (hashes by identity).

  Returns:
    ``(y_k, ClientMetrics)``.

  Labels: every valid record's label must lie in ``[0, K)``, ``K`` the
  model's logits: refused on concrete arrays; inside ``jit`` or ``vmap`` the
  client's model and float metrics are NaN instead
  (:func:`~fedlap_jax.client_data.check_labels`). So are images holding NaN or infinite
  values (:func:`~fedlap_jax.client_data.check_finite`).

  Raises:
    ConfigError: ``data`` that :func:`~fedlap_jax.client_data.check_records` refuses, a
      ``local.batch_size`` larger than its record slots, or concrete labels outside
      ``[0, K)``.
  """
  shape = check_records("data", data)
  check_batch_size("local.batch_size", local.batch_size, data)
  dtype = jnp.result_type(data.x) if data.pixel_scale is None else jnp.float32
  local.gradient.check_model(apply_fn, global_params, jax.ShapeDtypeStruct(shape, dtype))
  ok = check_labels(
    num_classes_of(apply_fn, global_params, shape[1:], dtype), ("data.y", data.y, data.mask)
  ) & check_finite(("data.x", data.x))
  if (correction is not None) != local.control_variates:
    raise ValueError(
      f"correction given={correction is not None} is invalid with "
      f"local.control_variates={local.control_variates}; allowed: a "
      "correction exactly when control variates are on"
    )
  n_k = jnp.sum(data.mask)
  active_steps = local.client_steps(n_k)
  query = local.gradient
  f32 = jnp.float32
  opt = None if optimizer is None else optim.with_rate(optimizer, learning_rate)

  def step(s, carry):
    w, loss_sum, extra, sampled, clipped, opt_state = carry
    # Every sampled record counts, also when the draw overflows the buffer.
    real = privacy.poisson_gradient(query, jax.random.fold_in(key, s), apply_fn, w, data)
    g = real.gradient
    realised = jnp.maximum(real.batch_size, 1).astype(f32)
    if local.prox_mu > 0:
      g = jax.tree.map(lambda gi, wi, xi: gi + 2.0 * local.prox_mu * (wi - xi), g, w, global_params)
    if correction is not None:
      g = jax.tree.map(jnp.add, g, correction)
    if opt is None:
      w = jax.tree.map(lambda wi, gi: wi - learning_rate * gi, w, g)
    else:
      updates, opt_state = opt.update(g, opt_state, w)
      w = optax.apply_updates(w, updates)
    batch_loss = f32(0.0) if real.loss_sum is None else real.loss_sum
    return (
      w,
      loss_sum + batch_loss / realised,
      extra + real.extra_chunks,
      sampled + real.batch_size,
      clipped + real.clipped,
      opt_state,
    )

  def body(s, carry):
    # Skipped steps (s >= T_k) draw nothing; under vmap both branches run and
    # the result is selected, under lax.map the skip saves the work.
    return jax.lax.cond(s < active_steps, functools.partial(step, s), lambda c: c, carry)

  opt_state = () if opt is None else opt.init(global_params)
  init = (global_params, f32(0.0), jnp.int32(0), jnp.int32(0), f32(0.0), opt_state)
  w, loss_sum, extra, sampled, clipped, _ = jax.lax.fori_loop(0, num_steps, body, init)
  taken = jnp.minimum(active_steps, num_steps).astype(jnp.int32)
  metrics = ClientMetrics(  # type: ignore[call-arg]  # (NONPRIVATE is no field)
    loss=loss_sum / jnp.maximum(taken, 1),
    steps=taken,
    update_norm=tree_distance(w, global_params),
    poisson_extra_chunks=extra,
    mean_batch_size=sampled / jnp.maximum(taken, 1),
    clip_fraction=clipped / jnp.maximum(sampled, 1),
  )
  return poison_unless(ok, (w, metrics))


def client_step(
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  data: ClientData,
  config: BaselineConfig,
  *,
  learning_rate,
  num_steps: int | None = None,
  correction: PyTree | None = None,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, ClientMetrics]:
  """What one client of a baseline computes and sends: its model ``y_k`` after local training.

  :func:`client_update` with ``config.local``; ``num_steps`` (the static
  ``T``) defaults to ``config.local.scheduled_steps`` of the padded client
  size ``data.mask.shape[0]``; ``optimizer``: the local steps' direction (``None``:
  ``config.client_optimizer``'s, SGD written out by default; :func:`client_update`). Pure and jit-compatible (``config`` static).
  The counterpart of :func:`server_step_with_state`.
  NumPy arguments are copied to the device first (:func:`~fedlap_jax.client_data.on_device`).
  """
  key, params, data, correction = on_device(key, params, data, correction)
  if num_steps is None:
    num_steps = config.local.scheduled_steps(data.mask.shape[0])
  if optimizer is None:
    optimizer = optim.written_out_or(config.client_optimizer)
  return client_update(
    key,
    apply_fn,
    params,
    data,
    learning_rate=learning_rate,
    local=config.local,
    num_steps=num_steps,
    correction=correction,
    optimizer=optimizer,
  )


# --------------------------------------------------------------------------
# The server, and one round.
# --------------------------------------------------------------------------


def _weighted_sum(weights: jax.Array, stacked: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jnp.tensordot(weights, a, axes=1), stacked)


def server_step_with_state(
  params: PyTree,
  client_params: PyTree,
  config: BaselineConfig,
  opt_state: optax.OptState,
  *,
  num_records: jax.Array | None = None,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, optax.OptState, jax.Array]:
  """The server's step on the weighted mean delta ``d = sum_k w_k (y_k - x)``, ``sum_k w_k = 1``.

  Default (``optimizer=None``): ``config.server_optimizer``'s direction; for plain SGD (its
  default) FedAvg's ``x + eta_s d``, written out, ``opt_state`` back unchanged. Otherwise one step of ``optim.with_rate(optimizer, eta_s)`` on the
  pseudo-gradient ``-d`` from ``opt_state`` (FedOpt; :func:`fedlap_jax.optim.sgd` gives
  ``x + eta_s d`` again, bit for bit).

  Args:
    params: the global model ``x``.
    client_params: the clients' models ``y_k`` (:func:`client_step`), leaves ``(K, ...)``.
    config: :class:`BaselineConfig` (static): ``weighting`` and ``server_lr``.
    opt_state: the server optimiser's state (:attr:`BaselineState.opt_state`;
      :func:`server_state` before round 1).
    num_records: ``(K,)`` the clients' ``N_k``; required with ``weighting='size'``
      (:func:`fedlap_jax.dispatch.client_weights`).
    optimizer: the server's direction (an ``optax.GradientTransformation`` before the rate;
      static under jit, hashes by identity), in place of ``config.server_optimizer``.

  Returns:
    ``(new_params, opt_state, w)``: the new global model, the optimiser's new state and the
    normalised ``(K,)`` weights.
  """
  weights = client_weights(
    config.weighting, num_records, num_clients=jax.tree.leaves(client_params)[0].shape[0]
  )
  weights = weights / jnp.sum(weights)
  deltas = jax.tree.map(lambda y, xi: y - xi[None], client_params, params)
  mean_delta = _weighted_sum(weights, deltas)
  if optimizer is None:
    optimizer = optim.written_out_or(config.server_optimizer)
  if optimizer is None:
    new = jax.tree.map(lambda xi, d: xi + config.server_lr * d, params, mean_delta)
    return new, opt_state, weights
  opt = optim.with_rate(optimizer, config.server_lr)
  updates, opt_state = opt.update(jax.tree.map(jnp.negative, mean_delta), opt_state, params)
  return optax.apply_updates(params, updates), opt_state, weights


def server_state(
  params: PyTree, config: BaselineConfig, optimizer: optax.GradientTransformation | None = None
) -> optax.OptState:
  """The server optimiser's state before round 1: ``()`` for plain SGD written out
  (``optimizer=None`` and ``config.server_optimizer`` plain SGD), else
  ``optim.with_rate(optimizer, server_lr).init(params)`` (``optimizer=None``: the direction of
  ``config.server_optimizer``)."""
  if optimizer is None:
    optimizer = optim.written_out_or(config.server_optimizer)
  if optimizer is None:
    return ()
  return optim.with_rate(optimizer, config.server_lr).init(params)


def init_baseline_state(
  key: jax.Array,
  params: PyTree,
  clients: ClientData,
  config: BaselineConfig,
  *,
  server_optimizer: optax.GradientTransformation | None = None,
) -> BaselineState:
  """The state before round 1 (SCAFFOLD: all control variates zero; the server optimiser's
  fresh state, :func:`server_state`)."""
  if config.local.control_variates:
    k = clients.mask.shape[0]
    control = jax.tree.map(jnp.zeros_like, params)
    client_controls = jax.tree.map(lambda p: jnp.zeros((k, *p.shape), p.dtype), params)
  else:
    control = client_controls = None
  opt_state = server_state(params, config, server_optimizer)
  return BaselineState(params, jnp.int32(0), key, control, client_controls, opt_state)


# --------------------------------------------------------------------------
# The config of a method, and its mechanism.
# --------------------------------------------------------------------------


def baseline_config(
  method: str,
  *,
  rounds: int,
  learning_rate: float,
  batch_size: int,
  dp: DPConfig | None,
  local_epochs: int = 5,
  prox_mu: float = 0.1,
  max_client_size: int | None = None,
  server_lr: float = 1.0,
  weighting: str | None = None,
  dsa_strategy: str = "",
  poisson_capacity: int | None = None,
  uniform_steps: bool = False,
  gradient_mean: str | None = None,
  track_loss: bool = True,
  lr_schedule: str = "cosine",
  client_optimizer: optim.Optimizer = optim.SGD,
  server_optimizer: optim.Optimizer = optim.SGD,
) -> BaselineConfig:
  """The :class:`BaselineConfig` of ``method`` from the settings of the paper's tables.

  Fills in what the method implies: FedSGD one step per round, FedProx's
  ``mu`` only for the prox methods (ignored by the others), SCAFFOLD's control variates; the
  private path's clip and noise come from ``dp`` (a :class:`~fedlap_jax.dp_config.DPConfig`
  for the ``dp_*`` methods, ``None`` for the others). The other arguments are the fields of
  :class:`BaselineConfig` and :class:`LocalTraining` of those names (``local_epochs``:
  ``LocalTraining.epochs``), with the reference's defaults; ``uniform_steps``: every client
  runs exactly ``T`` steps (a data-independent count, which needs ``max_client_size``)
  instead of ``E * round(N_k / B)``.

  Raises:
    ConfigError: naming the field, the value and what is allowed.
  """
  one_of("method", method, METHODS)
  facts = BASELINE_FACTS[method]  # what the name implies
  private = facts.private
  if private:
    require(isinstance(dp, DPConfig), "dp", dp, f"a DPConfig for method={method!r}")
  else:
    require(
      dp is None, "dp", dp, f"None for method={method!r} (use 'dp_fedavg' or 'dp_fedprox' for DP)"
    )
  require(isinstance(uniform_steps, bool), "uniform_steps", uniform_steps, "a bool")
  local = LocalTraining(
    epochs=local_epochs,
    batch_size=batch_size,
    max_client_size=max_client_size,
    poisson_capacity=poisson_capacity,
    prox_mu=prox_mu if facts.prox else 0.0,
    gradient_mean=gradient_mean,
    dsa_strategy=dsa_strategy,
    track_loss=track_loss,
    **({} if dp is None else _dp_fields(dp)),
  )
  if uniform_steps and facts.fixed_steps is None:
    require(
      max_client_size is not None,
      "max_client_size",
      max_client_size,
      "an integer >= 1 with uniform_steps=True",
    )
    local = dataclasses.replace(local, fixed_steps=local.scheduled_steps())
  return BaselineConfig(
    method=method,
    rounds=rounds,
    learning_rate=learning_rate,
    server_lr=server_lr,
    weighting=weighting,
    local=local,
    dp=dp,
    lr_schedule=lr_schedule,
    client_optimizer=client_optimizer,
    server_optimizer=server_optimizer,
  )
