"""FedDM: iterative distribution matching, as a method of the FedLAP framework.

Xiong, Wang, Cheng, Yu & Hsieh, "FedDM: Iterative Distribution Matching for
Communication-Efficient Federated Learning", arXiv 2207.09653. Like FedLAP,
every round each client sends a small synthetic set and the server trains the
global model on their union; unlike FedLAP the set is built *class-wise by
distribution matching* (Zhao & Bilen, WACV 2023) instead of gradient
matching, and there is no trust region::

  server: send w_g
  client k (distribution_match):
    S_k <- ipc real images per class it owns (re-drawn every round)
    for i in 1..image_updates:
      w <- w_g + rho * z / ||z||,  z ~ N(0, I)     # a model in the neighbourhood of w_g
      L = sum_c || mean_{x in real batch of c} e_w(x) - mean_{s in S_k of c} e_w(s) ||^2
      S_k <- S_k - momentum-SGD(image_lr) grad_S L
  server: max_epochs epochs of SGD (momentum 0.9, weight decay 5e-4) of w_g on
          the union of the S_k (fedlap_jax.methods.fedlap.server.global_update, no radius)

``e_w`` is the model's embedding, given as ``embed_fn(params, x)`` returning a
pytree of per-example arrays (:func:`fedlap_jax.matching.mean_embedding_distance`
sums the distance over its leaves). For the ConvNet,
:func:`fedlap_jax.models.embed_fn` returns ``(features, logits)``, the
penultimate features and the logits from one forward pass, both matched. A
user with their own model supplies ``embed_fn`` (features only gives the DM
loss of Zhao & Bilen) besides ``apply_fn``.

Settings and where they come from (defaults of :class:`FedDMConfig`). The
paper's text gives the algorithm; the numbers are those of the public
reimplementation m13891290332/fedDM (``config.py``, ``client/fedDMclient.py``,
``server/fedDMserver.py``), which the paper's settings match where stated:
``ipc = 10``, ``rho = 5`` (the perturbation has norm ``rho``, its
``random_pertube``), 1000 image iterations per round, real batches of 256 per
class, image SGD lr 1 with momentum 0.5, synthetic images initialised from real
images every round, no DSA; the server re-creates SGD (lr 0.01, momentum 0.9,
weight decay 5e-4) every round and trains 500 epochs in batches of 256 on the
union, all clients weighted alike, starting from the current global model;
matching of both the embedding and the logits ("equation 8"). The paper's
comparison (FedLAP-DP, Table 1, "FedDM (0.96x)") uses FedLAP's partition,
``ipc = 50`` and 200 rounds, so the upload equals FedLAP's; the named configs
``{mnist,fmnist,cifar}_feddm`` do the same.

Privacy. Only the non-DP FedDM is implemented. FedDM's DP variant protects the
class-wise statistics it matches, a different privacy notion that the
FedLAP-DP paper calls incomparable with record-level DP ("FedDM is incomparable
since it considers class-wise optimization, introducing additional privacy
risks and a distinct privacy notion"); :class:`FedDMConfig` has no DP field.

A round (the server's noise or real starts, every client's :func:`distribution_match`, the
server's :func:`fedlap_jax.methods.fedlap.server.global_update` on the union) is the registry's
method :data:`fedlap_jax.methods.feddm.METHOD`, run by :func:`fedlap_jax.rounds.algorithm` as every
method is; this module holds its config, client update, state and metrics.

Deviation: real batches are Poisson draws of expected size ``B`` per class
(:func:`fedlap_jax.synthetic.class_batch`; the whole class when it holds fewer),
where the reimplementation takes exactly ``B`` at random.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import dsa, optim, privacy
from fedlap_jax.checks import nonneg_float, one_of, positive_float, positive_int, require
from fedlap_jax.client_data import ClientData, SyntheticSet, check_pair
from fedlap_jax.synthetic import (
  SYNTHETIC_INITS,
  check_synthetic_learner,
  image_optimizer as config_image_optimizer,
)
from fedlap_jax.methods.fedlap.config import ServerConfig, check_fresh_server, fixed_epochs_server
from fedlap_jax.dp_config import poisson_capacity
from fedlap_jax.matching import mean_embedding_distance
from fedlap_jax.synthetic import class_batch, class_blocks, initial_synthetic
from fedlap_jax.types import PyTree

EmbedFn = Callable[[PyTree, jax.Array], PyTree]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FedDMConfig:
  """FedDM (static: a jit argument). Defaults: the published settings (module docstring).

  Attributes:
    ipc: synthetic images per class a client owns.
    image_updates: updates of the synthetic images per round, each against a
      new perturbed model.
    rho: norm of the random perturbation of the global model (L2 over all
      parameters).
    batch_size: ``B``, expected real records per class per iteration.
    image_lr, image_momentum: SGD on the synthetic images (re-created every round).
    image_optimizer: the synthetic images' direction as a config value (a
      :class:`fedlap_jax.optim.Optimizer` other than heavy-ball SGD), stepped at ``image_lr``
      and re-created every round; ``None`` (default): the SGD of ``image_momentum`` (that
      field is the SGD spec: with a spec it must be 0).
    dsa_strategy: DSA shared by the real and synthetic batch of a class
      (``""``: none, as the reimplementation).
    synthetic_init: ``real`` (real images of the class, every round) or
      ``noise`` (N(0, 1), every round).
    poisson_capacity: static Poisson buffer (default ``B + 6 sqrt(B) + 4``; at
      least ``B + 3 sqrt(B)``); a draw beyond it is processed in extra chunks.
    server: :class:`~fedlap_jax.methods.fedlap.config.ServerConfig` of the server's training
      (``radius_strategy='fixed'``: ``max_epochs`` epochs).
    learning_rate: the server's learning rate, the same every round.
  """

  ipc: int = 10
  image_updates: int = 1000
  rho: float = 5.0
  batch_size: int = 256
  image_lr: float = 1.0
  image_momentum: float = 0.5
  image_optimizer: optim.Optimizer | None = None
  dsa_strategy: str = ""
  synthetic_init: str = "real"
  poisson_capacity: int | None = None
  server: ServerConfig = dataclasses.field(default_factory=lambda: fixed_epochs_server(500))
  learning_rate: float = 0.01

  def __post_init__(self):
    for f in ("ipc", "image_updates", "batch_size"):
      positive_int(f, getattr(self, f))
    nonneg_float("rho", self.rho)
    check_synthetic_learner(self)
    one_of("synthetic_init", self.synthetic_init, SYNTHETIC_INITS)
    require(isinstance(self.server, ServerConfig), "server", self.server, "a ServerConfig")
    object.__setattr__(self, "server", self.server.resolved(private=False))  # no DP variant
    require(
      self.server.radius_strategy == "fixed",
      "radius_strategy",
      self.server.radius_strategy,
      "'fixed' for FedDM (its server trains max_epochs epochs; no trust region)",
    )
    check_fresh_server(
      self.server, "feddm", "its server's optimiser starts afresh at each round's training"
    )
    positive_float("learning_rate", self.learning_rate)

  @property
  def capacity(self) -> int:
    return self.poisson_capacity or poisson_capacity(self.batch_size)

  def dp_accesses(self) -> None:
    """FedDM has no DP variant: no noisy accesses to account for."""
    return None


class FedDMClientMetrics(NamedTuple):
  """Diagnostics of :func:`distribution_match` (scalars, ``(K,)`` over clients).

  Attributes:
    matching_loss: ``(image_updates,)`` the distribution-matching loss before each update.
    poisson_extra_chunks: extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is ever dropped).
    mean_batch_size: mean real records per iteration (all classes together).
  """

  matching_loss: jax.Array
  poisson_extra_chunks: jax.Array
  mean_batch_size: jax.Array


def perturb(key: jax.Array, params: PyTree, rho) -> PyTree:
  """``params + rho * z / ||z||``, ``z ~ N(0, I)`` over all parameters: a model at distance ``rho``."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  z = [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in z))
  scale = rho / jnp.maximum(norm, 1e-12)
  return jax.tree.unflatten(treedef, [p + scale * v for p, v in zip(leaves, z)])


def distribution_match(
  key: jax.Array,
  embed_fn: EmbedFn,
  params: PyTree,
  synthetic: SyntheticSet,
  client_data: ClientData,
  config: FedDMConfig,
  *,
  image_optimizer: optax.GradientTransformation | None = None,
) -> tuple[SyntheticSet, FedDMClientMetrics]:
  """FedDM's client update: class-wise distribution matching around ``params``.

  Pure and jit-compatible (``config`` static).

  Args:
    key: PRNG key of this client and round.
    embed_fn: ``embed_fn(params, x)`` -> pytree of per-example embeddings
      ``(N, ...)`` (e.g. :func:`fedlap_jax.models.embed_fn`).
    params: the global model ``w_g``.
    synthetic: the starting set ``(S, ...)`` in blocks of ``ipc``
      (:func:`fedlap_jax.synthetic.synthetic_labels`).
    client_data: the client's real records, padded with a mask.
    config: :class:`FedDMConfig`.
    image_optimizer: the images' ``optax.GradientTransformation`` (rate included; a jit
      static, hashed by identity); ``None``: the config's, SGD at ``image_lr`` with momentum
      ``image_momentum`` (:func:`fedlap_jax.optim.image_sgd`) or ``config.image_optimizer``
      at ``image_lr`` (:func:`fedlap_jax.synthetic.image_optimizer`).

  Returns:
    ``(synthetic, metrics)``.

  Raises:
    ConfigError: sets that :func:`~fedlap_jax.client_data.check_pair` refuses.
  """
  check_pair(synthetic, client_data)
  c = config
  capacity = c.capacity
  augment = dsa.make_augment_fn(c.dsa_strategy)
  opt = config_image_optimizer(c) if image_optimizer is None else image_optimizer
  _, labels, valid = class_blocks(synthetic, c.ipc)
  num_blocks = labels.shape[0]
  syn_weights = jnp.ones((c.ipc,), jnp.float32)

  def step(carry, k):
    x_syn, opt_state, extra_chunks, sampled = carry
    k_model, k_classes = jax.random.split(k)
    w = perturb(k_model, params, c.rho)

    def real_side(kc, label, ok):
      """The mean embedding of a Poisson batch of the class, over every chunk of the draw."""
      k_sample, k_aug = jax.random.split(kc)
      batch = class_batch(k_sample, client_data, label, ok, c.batch_size, capacity)

      def chunk_sum(indices, is_padding):
        emb = embed_fn(w, augment(k_aug, client_data.images(indices)))
        keep = (~is_padding).astype(jnp.float32)
        return jax.tree.map(
          lambda e: jnp.sum(keep.reshape(-1, *([1] * (e.ndim - 1))) * e, axis=0), emb
        )

      total = privacy.sum_over_chunks(chunk_sum, batch)
      mean = jax.tree.map(lambda t: (t / jnp.maximum(batch.size, 1))[None], total)
      return mean, (batch.size > 0)[None], k_aug, batch.extra_chunks, batch.size

    class_keys = jax.random.split(k_classes, num_blocks)
    real_emb, real_w, aug_keys, n_extra, sizes = jax.vmap(real_side)(class_keys, labels, valid)

    def loss_fn(x):
      xs = x.reshape(num_blocks, c.ipc, *x.shape[1:])

      def one(x_block, emb, weights, k_aug, ok):
        syn_emb = embed_fn(w, augment(k_aug, x_block))
        return ok * mean_embedding_distance(emb, syn_emb, weights, syn_weights)

      return jnp.sum(jax.vmap(one)(xs, real_emb, real_w, aug_keys, valid))

    loss, grad_x = jax.value_and_grad(loss_fn)(x_syn)
    updates, opt_state = opt.update(grad_x, opt_state, x_syn)
    carry = (
      optax.apply_updates(x_syn, updates),
      opt_state,
      extra_chunks + jnp.sum(n_extra),
      sampled + jnp.sum(sizes),
    )
    return carry, loss

  init = (synthetic.x, opt.init(synthetic.x), jnp.int32(0), jnp.int32(0))
  (x_syn, _, extra_chunks, sampled), losses = jax.lax.scan(
    step, init, jax.random.split(key, c.image_updates)
  )
  metrics = FedDMClientMetrics(losses, extra_chunks, sampled / c.image_updates)
  return synthetic._replace(x=x_syn), metrics


class FedDMState(NamedTuple):
  """Server state: the global model, the last synthetic sets ``(K, S, ...)``, rounds done, key."""

  params: PyTree
  synthetic: SyntheticSet
  round: jax.Array
  key: jax.Array


class FedDMRoundMetrics(NamedTuple):
  """Diagnostics of a round: per-client leaves have a leading ``(K,)`` axis.

  ``server_*``: epochs and SGD steps of the server, ``||w_new - w_g||``.
  """

  client: FedDMClientMetrics
  server_epochs: jax.Array
  server_steps: jax.Array
  server_distance: jax.Array


def init_feddm_state(
  key: jax.Array, params: PyTree, clients: ClientData, config: FedDMConfig
) -> FedDMState:
  """The state before round 1: balanced labels, ``ipc`` per class each client owns.

  Raises:
    ConfigError: with ``synthetic_init='real'``, a client has fewer than
      ``ipc`` records of one of its classes.
  """
  synthetic, k_state = initial_synthetic(key, clients, config.ipc, config.synthetic_init)
  return FedDMState(params, synthetic, jnp.int32(0), k_state)
