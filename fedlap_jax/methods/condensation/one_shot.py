"""DSC and PSG: one-shot dataset condensation by gradient matching, in the FedLAP framework.

The two one-shot comparison systems of the paper's Tables 1 and 2. Both
condense a client's data *once* into a small synthetic set by matching, on
networks freshly initialised again and again, the gradient of the synthetic
set to the gradient of real batches; the server then trains a fresh model on
the union of the clients' synthetic sets. :func:`condense` is the client side
(one pure function, like :func:`fedlap_jax.methods.fedlap.client.local_approx`)::

  for i in 1..networks:                      # lax.scan, a fresh network each time
    w <- init_fn(key_i)
    for o in 1..outer_loop:                  # lax.fori_loop
      for b in 1..batch_loop:                # lax.fori_loop
        DSC: per class c, a real batch of class c (expected B) and the synthetic
             images of class c; L = sum_c L_dis(g_real_c, g_syn_c)
        PSG: one Poisson batch of the whole client (q = B / N_k), the whole
             synthetic set; g_real clipped per example to C, N(0, sigma^2 C^2),
             divided by B (privacy.poisson_gradient: clipped sums over every
             chunk of the draw, then the noise: exact Poisson sampling, no
             record dropped)
        S <- S - momentum-SGD(image_lr) grad_S L      (fedlap_jax.matching.matching_step)
      if o == outer_loop: break
      inner_loop epochs of SGD (net_lr, batch model_batch_size) of w on S
  server: a fresh model trained on the union (fedlap_jax.methods.fedlap.server.global_update,
          momentum 0.9, weight decay 5e-4, the learning rate x lr_decay for the
          second half of the epochs)

``L_dis`` is :func:`fedlap_jax.matching.matching_distance` in the variant of
the condensation code: ``1 - cos`` summed over output units, 1-D tensors left
out, no MSE term. Everything FedLAP-specific stays out: no global model, no
trust region.

Methods (``OneShotConfig.method``):

* ``dsc``: Zhao, Mopuri & Bilen, "Dataset Condensation with Gradient
  Matching", ICLR 2021, as the federated one-shot method: every client
  condenses its own classes once, the server trains on the union. Not DP.
* ``dsc_centralized``: the same on the pooled training data of all clients
  (one "client" holding every class), the setting of the paper's Table 1
  (DSC, marked as one-shot centralized; ported there from the DSC paper). Its
  "upload" is the raw data pooled, reported as such.
* ``psg``: Chen, Kerkouche & Fritz, "Private Set Generation with
  Discriminative Information", NeurIPS 2022: class-agnostic matching of
  per-example-clipped, noised real gradients (record-level DP), each client
  once on its own data. ``T = networks * outer_loop * batch_loop`` noisy
  accesses at ``q = B / N_k``, accounted by :mod:`fedlap_jax.accounting` as
  one round of ``T`` steps.

Settings and where they come from (defaults of :class:`CondensationConfig` /
:class:`OneShotConfig`):

* DSC, from the authors' code (VICO-UoE/DatasetCondensation, ``main.py`` and
  ``utils.py``): 1000 fresh networks (``Iteration``), ``(outer_loop,
  inner_loop)`` by ipc from its ``get_loops`` (:func:`dc_loops`: 1 -> (1, 1),
  10 -> (10, 50), 50 -> (50, 10), ...), one image update per outer step,
  real batches of 256 per class, image SGD lr 0.1 momentum 0.5, network SGD
  lr 0.01 with batch 256, synthetic images from N(0, 1), no DSA in the DC
  variant; the model trained on the result: SGD lr 0.01, momentum 0.9, weight
  decay 5e-4, batch 256, lr x 0.1 at half the epochs, 300 epochs (1000 with
  augmentation, which the code uses for MNIST: ``crop_scale_rotate``).
* PSG, from the authors' code (DingfanChen/Private-Set, ``main.py``): the
  same loops (``get_loops``) with ``batch_loop = 10`` real batches per outer
  step, Poisson real batches of the whole data (``UniformWithReplacementSampler``,
  ``q = 256 / N``), clip ``C = 0.1``, ``delta = 1e-5``, image lr 0.1, network
  lr 0.01, the same evaluation training (augmentation ``crop_scale_rotate`` for
  MNIST and Fashion-MNIST). PSG calibrates ``sigma`` to a target epsilon with
  its own accountant; here ``sigma`` is an input and the epsilon is the
  project accountant's for ``(q, sigma, T)``.

The one round (every client's :func:`condense`, then :func:`train_on_union`; the clients
pooled into one for DSC centralized) is the registry's method of each name
(:func:`fedlap_jax.methods.condensation.family`), run by :func:`fedlap_jax.rounds.algorithm`
as every method is; this module holds the configs, the condensation, the server's training,
the state and the metrics.

Deviations, all documented: real batches of DSC are Poisson draws of
expected size ``B`` per class (the code draws exactly ``min(B, N_c)``); the
cosine's ``1e-6`` is our ``1e-8``; DSA picks one augmentation family per batch
where the code's ``augment`` picks one per image; freshly initialised networks
use Flax's initialisers, not PyTorch's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import dsa, optim, privacy
from fedlap_jax.checks import (
  ConfigError,
  is_real,
  nonneg_int,
  one_of,
  positive_float,
  positive_int,
  require,
)
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  check_batch_size,
  check_finite,
  check_labels,
  check_pair,
  num_classes_of,
  poison_unless,
)
from fedlap_jax.synthetic import (
  SYNTHETIC_INITS,
  check_synthetic_learner,
  image_optimizer as config_image_optimizer,
)
from fedlap_jax.dp_config import DpAccesses, DPConfig, poisson_capacity
from fedlap_jax.methods.fedlap.config import ServerConfig, check_fresh_server, fixed_epochs_server
from fedlap_jax.matching import matching_step
from fedlap_jax.methods.fedlap.server import ServerMetrics, global_update
from fedlap_jax.synthetic import class_batch, class_blocks, initial_synthetic
from fedlap_jax.training import sgd_epoch, tree_distance
from fedlap_jax.types import ApplyFn, PyTree


class OneShotFacts(NamedTuple):
  """What a one-shot condensation method's name implies
  (:class:`fedlap_jax.methods.condensation.one_shot.OneShotConfig`, and the registry's methods).

  Attributes:
    private: DP condensation (PSG: class-agnostic, a ``dp`` config, ``uniform`` weights).
    centralized: one client pools every client's records (DSC centralized).
  """

  private: bool = False
  centralized: bool = False


# Synthetic-data comparison systems: FedDM (fedlap_jax.methods.feddm.distribution_matching) and the
# one-shot condensation methods DSC and PSG (fedlap_jax.methods.condensation.one_shot).
ONE_SHOT_FACTS = {
  "dsc": OneShotFacts(),
  "dsc_centralized": OneShotFacts(centralized=True),
  "psg": OneShotFacts(private=True),
}
ONE_SHOT_METHODS = tuple(ONE_SHOT_FACTS)
DP_ONE_SHOT_METHODS = tuple(n for n, f in ONE_SHOT_FACTS.items() if f.private)

InitFn = Callable[[jax.Array], PyTree]

# (outer_loop, inner_loop) by images per class: DatasetCondensation's get_loops
# (PSG's copy adds 100).
DC_LOOPS = {
  1: (1, 1),
  10: (10, 50),
  20: (20, 25),
  30: (30, 20),
  40: (40, 15),
  50: (50, 10),
  100: (50, 10),
}


def dc_loops(ipc: int) -> tuple[int, int]:
  """``(outer_loop, inner_loop)`` of the condensation code for ``ipc`` images per class.

  Raises:
    ConfigError: ``ipc`` has no published loops (give both loops explicitly).
  """
  if ipc not in DC_LOOPS:
    raise ConfigError(
      "ipc",
      ipc,
      f"one of {sorted(DC_LOOPS)} (the published loops), or "
      "outer_loop and inner_loop given explicitly",
    )
  return DC_LOOPS[ipc]


# --------------------------------------------------------------------------
# Configuration.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CondensationConfig:
  """The client side of DSC / PSG (static: loop bounds are compile-time constants).

  Attributes:
    ipc: synthetic images per class the client (or the pool) owns.
    networks: freshly initialised networks, one after another (the authors'
      ``Iteration``).
    outer_loop: image-update stages per network (the last ends without a
      network update).
    inner_loop: epochs of network SGD on the synthetic set between stages.
    batch_loop: real batches (and image updates) per stage: 1 for DSC, 10 for PSG.
    classwise: match per class (DSC) or the whole set at once (PSG; required
      with ``dp``: class-wise batches have per-class sampling rates).
    batch_size: ``B``: expected real records per batch (per class when
      ``classwise``); ``q = B / N_k`` otherwise.
    model_batch_size: batch of the network's SGD on the synthetic set.
    image_lr, image_momentum: SGD on the synthetic images (one optimiser state
      for the whole condensation).
    image_optimizer: the synthetic images' direction as a config value (a
      :class:`fedlap_jax.optim.Optimizer` other than heavy-ball SGD), stepped at ``image_lr``,
      one state for the whole condensation; ``None`` (default): the SGD of
      ``image_momentum`` (that field is the SGD spec: with a spec it must be 0).
    net_lr: SGD learning rate of the network on the synthetic set.
    dsa_strategy: DSA families (``""``: none, the DC / PSG default).
    synthetic_init: ``noise`` (N(0, 1), the default of both codes) or ``real``
      (real images of the class; refused with ``dp``).
    poisson_capacity: static Poisson buffer (default ``B + 6 sqrt(B) + 4``; at
      least ``B + 3 sqrt(B)``); a draw beyond it is processed in extra chunks
      (:func:`fedlap_jax.privacy.sum_over_chunks`), never truncated.
    dp: a :class:`~fedlap_jax.dp_config.DPConfig` for PSG, ``None`` for DSC.
  """

  ipc: int = 10
  networks: int = 1000
  outer_loop: int = 10
  inner_loop: int = 50
  batch_loop: int = 1
  classwise: bool = True
  batch_size: int = 256
  model_batch_size: int = 256
  image_lr: float = 0.1
  image_momentum: float = 0.5
  image_optimizer: optim.Optimizer | None = None
  net_lr: float = 0.01
  dsa_strategy: str = ""
  synthetic_init: str = "noise"
  poisson_capacity: int | None = None
  dp: DPConfig | None = None

  def __post_init__(self):
    for f in ("ipc", "networks", "outer_loop", "batch_loop", "batch_size", "model_batch_size"):
      positive_int(f, getattr(self, f))
    nonneg_int("inner_loop", self.inner_loop)
    require(isinstance(self.classwise, bool), "classwise", self.classwise, "True or False")
    positive_float("net_lr", self.net_lr)
    check_synthetic_learner(self)
    one_of("synthetic_init", self.synthetic_init, SYNTHETIC_INITS)
    if self.dp is not None:
      require(
        not self.classwise,
        "classwise",
        self.classwise,
        "False with dp (class-wise batches are drawn at a per-class rate B / N_c the "
        "accountant does not cover; PSG matches class-agnostic Poisson batches)",
      )
      require(
        self.synthetic_init == "noise",
        "synthetic_init",
        self.synthetic_init,
        "'noise' with dp (initialising from real images would publish them)",
      )

  @property
  def capacity(self) -> int:
    """Static size of the Poisson batch buffer."""
    return self.poisson_capacity or poisson_capacity(self.batch_size)

  @property
  def real_accesses_per_round(self) -> int:
    """``T = networks * outer_loop * batch_loop`` real batches (the accountant's steps)."""
    return self.networks * self.outer_loop * self.batch_loop

  @property
  def gradient(self) -> privacy.PoissonGradient:
    """PSG's whole-set real gradient (``classwise`` off;
    :func:`fedlap_jax.privacy.poisson_gradient`): ``B``, the buffer, ``dp``'s clip, noise,
    microbatch and per-example method, the DSA; without ``dp`` the mean over the records
    drawn. Its :meth:`~fedlap_jax.privacy.PoissonGradient.mechanism` of
    ``T = networks * outer_loop * batch_loop`` is PSG's."""
    return privacy.PoissonGradient.of(
      self.dp, batch_size=self.batch_size, capacity=self.capacity, dsa_strategy=self.dsa_strategy
    )

  def dp_accesses(self) -> DpAccesses | None:
    """PSG's noisy accesses: ``T = networks * outer_loop * batch_loop`` class-agnostic
    Poisson batches of expected size ``B`` in its one round; ``None`` without DP (DSC)."""
    if self.dp is None:
      return None
    return DpAccesses(self.dp, self.batch_size, self.real_accesses_per_round)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneShotConfig:
  """A one-shot method: condensation on the clients, then the server's training.

  Attributes:
    method: one of :data:`fedlap_jax.methods.condensation.one_shot.ONE_SHOT_METHODS`; what it
      implies (DP, pooled clients) is its
      :data:`fedlap_jax.methods.condensation.one_shot.ONE_SHOT_FACTS` entry.
    condensation: :class:`CondensationConfig` (``classwise`` for ``dsc*``,
      class-agnostic with ``dp`` for ``psg``).
    server: :class:`~fedlap_jax.methods.fedlap.config.ServerConfig` of the training of the
      fresh model on the union: ``radius_strategy='fixed'`` (``max_epochs``
      epochs); defaults as the condensation code's evaluation.
    learning_rate: the server's learning rate (0.01).
    lr_decay: factor applied to the learning rate for the last
      ``max_epochs // 2`` epochs (0.1 as the code; 1 for none).
  """

  method: str
  condensation: CondensationConfig = dataclasses.field(default_factory=CondensationConfig)
  server: ServerConfig = dataclasses.field(default_factory=lambda: fixed_epochs_server(300))
  learning_rate: float = 0.01
  lr_decay: float = 0.1

  def __post_init__(self):
    one_of("method", self.method, ONE_SHOT_METHODS)
    require(
      isinstance(self.condensation, CondensationConfig),
      "condensation",
      self.condensation,
      "a CondensationConfig",
    )
    require(isinstance(self.server, ServerConfig), "server", self.server, "a ServerConfig")
    positive_float("learning_rate", self.learning_rate)
    require(
      is_real(self.lr_decay) and 0 < self.lr_decay <= 1,
      "lr_decay",
      self.lr_decay,
      "a number in (0, 1]",
    )
    c = self.condensation
    private = ONE_SHOT_FACTS[self.method].private  # what the name implies
    object.__setattr__(self, "server", self.server.resolved(private))
    require(
      (c.dp is not None) == private,
      "dp",
      c.dp,
      f"a DPConfig for method={self.method!r}"
      if private
      else f"None for method={self.method!r} (PSG is the DP one-shot method)",
    )
    require(
      c.classwise == (not private),
      "classwise",
      c.classwise,
      f"{not private} for method={self.method!r} (DSC matches per class, PSG the whole set)",
    )
    require(
      self.server.radius_strategy == "fixed",
      "radius_strategy",
      self.server.radius_strategy,
      f"'fixed' for method={self.method!r} (the server trains max_epochs epochs; "
      "there is no trust region)",
    )
    check_fresh_server(self.server, self.method, "one-shot: its server trains once")

  @property
  def centralized(self) -> bool:
    return ONE_SHOT_FACTS[self.method].centralized

  @property
  def dp(self) -> DPConfig | None:
    return self.condensation.dp

  def dp_accesses(self) -> DpAccesses | None:
    """The condensation's noisy accesses (:meth:`CondensationConfig.dp_accesses`)."""
    return self.condensation.dp_accesses()


# --------------------------------------------------------------------------
# One client: the condensation.
# --------------------------------------------------------------------------


class CondensationMetrics(NamedTuple):
  """Diagnostics of :func:`condense` (scalars, ``(K,)`` over clients).

  Attributes:
    matching_loss: ``(networks,)`` mean ``L_dis`` over the image updates of
      each fresh network (under DP: computed from the noised gradients).
    real_accesses: real batches drawn (``T``; per class when class-wise).
    poisson_extra_chunks: extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is ever dropped).
    mean_batch_size: mean realised records per access (all classes together).
    clip_fraction: fraction of per-example gradients clipped (DP; else 0).

  Under DP, ``matching_loss`` is computed from the noised gradients and the
  synthetic set only and ``real_accesses`` is the fixed ``T`` (both
  releasable); the fields named in :attr:`NONPRIVATE` are raw statistics of
  the real records, outside the DP mechanism: diagnostics, not to be released
  (the experiment driver writes them only with ``debug_nonprivate_stats``).
  """

  NONPRIVATE = ("poisson_extra_chunks", "mean_batch_size", "clip_fraction")  # type: ignore[misc]  # a class constant, not a field

  matching_loss: jax.Array
  real_accesses: jax.Array
  poisson_extra_chunks: jax.Array
  mean_batch_size: jax.Array
  clip_fraction: jax.Array


def condense(
  key: jax.Array,
  apply_fn: ApplyFn,
  init_fn: InitFn,
  synthetic: SyntheticSet,
  client_data: ClientData,
  config: CondensationConfig,
  *,
  image_optimizer: optax.GradientTransformation | None = None,
) -> tuple[SyntheticSet, CondensationMetrics]:
  """Condenses one client's data into ``synthetic`` (DSC, or PSG with ``config.dp``).

  Pure and jit-compatible (``config`` static); vmap or ``lax.map`` it over
  stacked clients (:func:`fedlap_jax.dispatch.run_clients`).

  Args:
    key: PRNG key of this client.
    apply_fn: ``apply_fn(params, x) -> logits``.
    init_fn: ``init_fn(key) -> params``, a freshly initialised network
      (:func:`fedlap_jax.models.init_fn` for the ConvNet).
    synthetic: the starting set ``(S, ...)``, in the layout of
      :func:`fedlap_jax.synthetic.synthetic_labels` (blocks of ``ipc``).
    client_data: the client's real records, padded with a mask.
    config: :class:`CondensationConfig`.
    image_optimizer: the images' ``optax.GradientTransformation`` (rate included; a jit
      static, hashed by identity); ``None``: the config's, SGD at ``image_lr`` with momentum
      ``image_momentum`` (:func:`fedlap_jax.optim.image_sgd`) or ``config.image_optimizer``
      at ``image_lr`` (:func:`fedlap_jax.synthetic.image_optimizer`).

  Returns:
    ``(synthetic, metrics)``: the condensed set (labels and mask unchanged)
    and :class:`CondensationMetrics`.

  Labels of both sets must lie in ``[0, K)``, ``K`` the network's logits:
  refused on concrete arrays, NaN outputs inside ``jit`` or ``vmap``
  (:func:`~fedlap_jax.client_data.check_labels`); so are images holding NaN or infinite
  values (:func:`~fedlap_jax.client_data.check_finite`).

  Raises:
    ConfigError: sets that :func:`~fedlap_jax.client_data.check_pair` refuses; for PSG's
      whole-set batches (``classwise`` off), a ``batch_size`` larger than the record slots;
      concrete labels outside ``[0, K)``.
  """
  check_pair(synthetic, client_data)
  if not config.classwise:
    check_batch_size("batch_size", config.batch_size, client_data)
  params_shape = jax.eval_shape(init_fn, key)
  config.gradient.check_model(apply_fn, params_shape, synthetic.x)
  ok = check_labels(
    num_classes_of(
      apply_fn, params_shape, jnp.shape(synthetic.x)[1:], jnp.result_type(synthetic.x)
    ),
    ("client_data.y", client_data.y, client_data.mask),
    ("synthetic.y", synthetic.y, synthetic.mask),
  ) & check_finite(("client_data.x", client_data.x), ("synthetic.x", synthetic.x))
  c = config
  capacity = c.capacity
  augment = dsa.make_augment_fn(c.dsa_strategy)
  opt = config_image_optimizer(c) if image_optimizer is None else image_optimizer
  syn_weights = synthetic.mask.astype(jnp.float32)
  match = functools.partial(
    matching_step,
    apply_fn,
    dsa_strategy=c.dsa_strategy,
    mse_weight=0.0,
    row_reduction="sum",
    include_vectors=False,
  )
  f32 = jnp.float32

  def whole_set(k, w, x_syn):
    """PSG: one Poisson batch of the client, the whole synthetic set."""
    # Exact Poisson sampling: every sampled record counts, also beyond the buffer.
    real = privacy.poisson_gradient(c.gradient, k, apply_fn, w, client_data)
    loss, grad_x = match(w, synthetic._replace(x=x_syn), real.gradient, real.aug_key)
    return loss, grad_x, (real.extra_chunks, real.batch_size, real.clipped)

  def per_class(k, w, x_syn):
    """DSC: per class block, a real batch of the class and the block's images."""
    xs, labels, valid = class_blocks(synthetic._replace(x=x_syn), c.ipc)

    def one(kc, x_block, label, ok):
      k_sample, k_aug = jax.random.split(kc)
      batch = class_batch(k_sample, client_data, label, ok, c.batch_size, capacity)

      def chunk_sum(indices, is_padding):
        xb = augment(k_aug, client_data.images(indices))
        return privacy.real_gradient_sum(
          apply_fn, w, xb, client_data.y[indices], is_padding, microbatch_size="auto"
        )[0]

      total = privacy.sum_over_chunks(chunk_sum, batch)
      g = jax.tree.map(lambda t: t / jnp.maximum(batch.size, 1).astype(f32), total)
      block = SyntheticSet(x_block, jnp.full((c.ipc,), label), jnp.full((c.ipc,), ok))
      loss, grad_x = match(w, block, g, k_aug)
      return loss * ok, grad_x * ok, batch.extra_chunks, batch.size

    losses, grads, extra, sizes = jax.vmap(one)(
      jax.random.split(k, labels.shape[0]), xs, labels, valid
    )
    return (jnp.sum(losses), grads.reshape(x_syn.shape), (jnp.sum(extra), jnp.sum(sizes), f32(0.0)))

  update = per_class if c.classwise else whole_set

  def iteration(carry, k_it):
    x_syn, opt_state, stats = carry
    k_init, k_loop = jax.random.split(k_it)

    def outer(o, carry):
      w, x_syn, opt_state, loss_sum, stats = carry
      k_o = jax.random.fold_in(k_loop, o)

      def batch_step(b, carry):
        x_syn, opt_state, loss_sum, stats = carry
        loss, grad_x, (extra, size, clipped) = update(jax.random.fold_in(k_o, b), w, x_syn)
        updates, opt_state = opt.update(grad_x, opt_state, x_syn)
        accesses, n_extra, sampled, n_clipped = stats
        stats = (accesses + 1, n_extra + extra, sampled + size, n_clipped + clipped)
        return optax.apply_updates(x_syn, updates), opt_state, loss_sum + loss, stats

      x_syn, opt_state, loss_sum, stats = jax.lax.fori_loop(
        0, c.batch_loop, batch_step, (x_syn, opt_state, loss_sum, stats)
      )

      def train(w):
        def epoch(e, w):
          k = jax.random.fold_in(jax.random.fold_in(k_o, c.batch_loop), e)
          return sgd_epoch(
            k,
            apply_fn,
            w,
            x_syn,
            synthetic.y,
            syn_weights,
            c.net_lr,
            batch_size=c.model_batch_size,
            dsa_strategy=c.dsa_strategy,
          )[0]

        return jax.lax.fori_loop(0, c.inner_loop, epoch, w)

      # The last stage ends without a network update (as the code's `break`).
      w = jax.lax.cond(o < c.outer_loop - 1, train, lambda w: w, w)
      return w, x_syn, opt_state, loss_sum, stats

    init = (init_fn(k_init), x_syn, opt_state, f32(0.0), stats)
    _, x_syn, opt_state, loss_sum, stats = jax.lax.fori_loop(0, c.outer_loop, outer, init)
    return (x_syn, opt_state, stats), loss_sum / (c.outer_loop * c.batch_loop)

  stats0 = (jnp.int32(0), jnp.int32(0), jnp.int32(0), f32(0.0))
  (x_syn, _, stats), losses = jax.lax.scan(
    iteration, (synthetic.x, opt.init(synthetic.x), stats0), jax.random.split(key, c.networks)
  )
  accesses, extra_chunks, sampled, n_clipped = stats
  metrics = CondensationMetrics(  # type: ignore[call-arg]  # (NONPRIVATE is no field)
    matching_loss=losses,
    real_accesses=accesses,
    poisson_extra_chunks=extra_chunks,
    mean_batch_size=sampled / jnp.maximum(accesses, 1),
    clip_fraction=n_clipped / jnp.maximum(sampled, 1),
  )
  return poison_unless(ok, (synthetic._replace(x=x_syn), metrics))


# --------------------------------------------------------------------------
# The round: every client condenses once, the server trains a fresh model.
# --------------------------------------------------------------------------


class OneShotState(NamedTuple):
  """Server state.

  Attributes:
    params: the model; before the round a freshly initialised one, after it
      the model trained on the union of the synthetic sets.
    synthetic: stacked :class:`SyntheticSet` ``(K, S, ...)`` (``K = 1`` for
      ``dsc_centralized``): N(0, 1) before the round, condensed after it.
    round: int32, rounds completed (0 or 1).
    key: PRNG key.
  """

  params: PyTree
  synthetic: SyntheticSet
  round: jax.Array
  key: jax.Array


class OneShotMetrics(NamedTuple):
  """Diagnostics of the round: per-client leaves have a leading ``(K,)`` axis.

  ``server_*``: epochs and SGD steps of the server's training, and
  ``||w - w_fresh||``; ``learning_rate``: the server's (before the decay).
  """

  client: CondensationMetrics
  server_epochs: jax.Array
  server_steps: jax.Array
  server_distance: jax.Array
  learning_rate: jax.Array


def pool_clients(clients: ClientData) -> ClientData:
  """All clients' records as one client: leaves ``(K, N, ...) -> (1, K * N, ...)``."""

  def flat(a):
    return a.reshape(1, a.shape[0] * a.shape[1], *a.shape[2:])

  pooled = ClientData(flat(clients.x), flat(clients.y), flat(clients.mask))
  if clients.pixel_scale is not None and clients.pixel_offset is not None:  # both or neither
    pooled = pooled._replace(
      pixel_scale=clients.pixel_scale[:1], pixel_offset=clients.pixel_offset[:1]
    )
  return pooled


def init_oneshot_state(
  key: jax.Array, params: PyTree, clients: ClientData, config: OneShotConfig
) -> OneShotState:
  """The state before the round: the fresh model and N(0, 1) synthetic sets (host side checks).

  Raises:
    ConfigError: under DP ``batch_size`` exceeds the smallest client (q > 1);
      with ``synthetic_init='real'`` a class has fewer than ``ipc`` records.
  """
  c = config.condensation
  data = pool_clients(clients) if config.centralized else clients
  sizes = [int(np.sum(m)) for m in np.asarray(data.mask)]
  if c.dp is not None and c.batch_size > min(sizes):
    raise ConfigError(
      "batch_size",
      c.batch_size,
      "batch_size <= the smallest client",
      message=f"batch_size={c.batch_size} is invalid: client {int(np.argmin(sizes))} has only "
      f"{min(sizes)} records; allowed: batch_size <= the smallest client (the Poisson rate "
      "q = batch_size / N_k must be <= 1)",
    )
  synthetic, k_state = initial_synthetic(key, data, c.ipc, c.synthetic_init)
  return OneShotState(params, synthetic, jnp.int32(0), k_state)


def train_on_union(
  key: jax.Array,
  apply_fn: ApplyFn,
  params: PyTree,
  synthetic: SyntheticSet,
  weights: jax.Array,
  config: OneShotConfig,
) -> tuple[PyTree, ServerMetrics]:
  """The server's training on the union: :func:`global_update` without radius, in two stages.

  ``max_epochs - max_epochs // 2`` epochs at ``learning_rate``, then
  ``max_epochs // 2`` at ``learning_rate * lr_decay`` with a new optimiser
  state (the condensation code re-creates its optimiser at the decay).
  """
  server = config.server
  late = server.max_epochs // 2 if config.lr_decay < 1 else 0
  k_early, k_late = jax.random.split(key)
  w, early = global_update(
    k_early,
    apply_fn,
    params,
    synthetic,
    weights,
    jnp.inf,
    learning_rate=config.learning_rate,
    config=dataclasses.replace(server, max_epochs=server.max_epochs - late),
  )
  epochs, steps = early.epochs, early.steps
  if late:
    w, second = global_update(
      k_late,
      apply_fn,
      w,
      synthetic,
      weights,
      jnp.inf,
      learning_rate=config.learning_rate * config.lr_decay,
      config=dataclasses.replace(server, max_epochs=late),
    )
    epochs, steps = epochs + second.epochs, steps + second.steps
  return w, ServerMetrics(epochs, steps, tree_distance(w, params), jnp.float32(jnp.inf))
