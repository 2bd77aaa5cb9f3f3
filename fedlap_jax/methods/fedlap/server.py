"""Server side of FedLAP: global optimisation in a trust region (Algorithm 2), and its step.

The server trains the global model by SGD on the union of the clients'
synthetic sets (client ``k`` weighted by ``N_k / N``, or ``1 / K`` under DP),
in shuffled batches of 512 with DSA, epoch after epoch, and stops after the
first epoch that leaves the ball ``||w - w_start|| < r_g`` (or at the epoch
cap). The optimiser is SGD re-created every round: plain for FedLAP, with
``momentum`` and ``weight_decay`` for the synthetic-data comparison systems
(FedDM's server; DSC's and PSG's training of a fresh model on the synthetic
sets), which also run here, with ``r_g = inf``. Another direction may replace
it: as a config value, ``ServerConfig.optimizer`` (an :class:`fedlap_jax.optim.Optimizer`
spec, restarted every round like SGD), or as any optax direction, ``optimizer``
(:mod:`fedlap_jax.optim`); :func:`global_update_with_state` and
:func:`server_step_with_state` also take and return its state, for a server that
carries it across rounds.

Shared and FedLAP-only: :func:`global_update` (with :func:`example_weights`
and :class:`ServerMetrics`) is the training on a union of synthetic sets that
FedDM, DSC and PSG share; :func:`server_step_with_state` is FedLAP's whole server
(``r_g`` from the clients' ``r_k``, the client weights, the FedAvg-delta start,
then :func:`global_update`) and :func:`fedavg_delta_start` is part of it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import optim
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import (
  SyntheticSet,
  check_label_dtype,
  check_labels,
  num_classes_of,
  on_device,
  poison_unless,
)
from fedlap_jax.methods.fedlap.config import FedLAPConfig, ServerConfig
from fedlap_jax.dispatch import client_weights
from fedlap_jax.methods.fedlap.radius import server_radius
from fedlap_jax.training import train_epoch, tree_distance
from fedlap_jax.types import PyTree


class ServerMetrics(NamedTuple):
  """Diagnostics of :func:`global_update`.

  Attributes:
    epochs: epochs run (``<= max_epochs``).
    steps: SGD steps taken.
    distance: final ``||w - w_start||``.
    radius: the ``r_g`` used (``inf`` for the ``fixed`` strategy).
  """

  epochs: jax.Array
  steps: jax.Array
  distance: jax.Array
  radius: jax.Array


def example_weights(mask: jax.Array, client_weights: jax.Array) -> jax.Array:
  """Per-example weights on the union of synthetic sets.

  Args:
    mask: ``(K, S)`` bool, valid synthetic examples.
    client_weights: ``(K,)`` non-negative client weights (e.g. ``N_k / N``).

  Returns:
    ``(K, S)`` weights such that the mean loss over a full pass equals
    ``sum_k client_weights_k * mean loss on S_k`` (normalised weights); with
    equal weights and equal set sizes every weight is 1.
  """
  mask = mask.astype(jnp.float32)
  counts = jnp.sum(mask, axis=1)
  cw = client_weights / jnp.maximum(jnp.sum(client_weights), 1e-12)
  per_example = cw / jnp.maximum(counts, 1.0)
  return mask * per_example[:, None] * jnp.sum(mask)


def check_union(synthetic: SyntheticSet, client_weights: jax.Array) -> None:
  """Refuses a union of synthetic sets that :func:`global_update` cannot use.

  Reads static shapes and dtypes only (it runs at trace time, under ``jit`` too): images
  ``(K, S, ...)`` with a leading client axis (one client's set is stacked as ``K = 1``),
  labels and mask ``(K, S)``, integer labels and ``(K,)`` client weights.

  Raises:
    ConfigError: naming the leaf (``synthetic.x.shape``, ``client_weights.shape``, ...), with
      the value and what is allowed.
  """
  shape = jnp.shape(synthetic.x)
  if len(shape) < 3:
    raise ConfigError(
      "synthetic.x.shape",
      shape,
      "(K, S, ...): the clients' sets stacked on a leading axis (one client: x[None])",
    )
  for name, leaf in (("y", synthetic.y), ("mask", synthetic.mask)):
    if jnp.shape(leaf) != shape[:2]:
      raise ConfigError(
        f"synthetic.{name}.shape",
        jnp.shape(leaf),
        f"{shape[:2]}: one entry per image of synthetic.x {shape} (K clients x S images; "
        "one client's set stacked as x[None])",
      )
  check_label_dtype("synthetic.y", synthetic.y)
  if jnp.shape(client_weights) != shape[:1]:
    raise ConfigError(
      "client_weights.shape", jnp.shape(client_weights), f"{shape[:1]}: one weight per client"
    )


def global_update_with_state(
  key: jax.Array,
  apply_fn: Callable,
  params: PyTree,
  synthetic: SyntheticSet,
  client_weights: jax.Array,
  radius,
  opt_state: optax.OptState | None,
  *,
  learning_rate,
  config: ServerConfig,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, optax.OptState, ServerMetrics]:
  """Algorithm 2: SGD (or ``optimizer``) on the union of synthetic sets until
  ``||w - w_0|| >= r_g``, from ``opt_state``.

  Jit-compatible (``config`` static); NumPy arguments are copied to the device first
  (:func:`~fedlap_jax.client_data.on_device`).

  Args:
    key: PRNG key (shuffling and DSA).
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the global model at the start of the round.
    synthetic: the clients' :class:`SyntheticSet` s stacked: images
      ``(K, S, H, W, C)``, labels ``(K, S)``, mask ``(K, S)`` bool.
    client_weights: ``(K,)`` weights (``N_k`` or ones); normalised inside.
    radius: ``r_g`` (``inf`` runs ``config.max_epochs`` epochs).
    learning_rate: ``eta_m`` (may be traced).
    opt_state: the optimiser's state to start from (``with_rate(optimizer, lr).init`` of
      the parameters' structure; :func:`server_state`), or ``None``: a fresh one
      (Algorithm 2: the server's SGD starts afresh every round).
    config: :class:`ServerConfig` (static): batch size, epoch cap, DSA, and
      the default optimiser's momentum and weight decay.
    optimizer: the server's direction, an ``optax.GradientTransformation`` before the
      rate (:mod:`fedlap_jax.optim`), stepped at ``learning_rate``; ``None``:
      ``config.direction()`` (the config's ``optimizer`` spec, or without one
      :func:`fedlap_jax.optim.server_direction` of ``config.momentum`` and
      ``config.weight_decay``: SGD). A
      jit static where the caller jits (hashes by identity).

  Returns:
    ``(params, opt_state, ServerMetrics)``: the optimiser's state after the last step.

  Labels: every label of a valid image of a client with weight > 0 must lie
  in ``[0, K)``, ``K`` the model's logits: refused on concrete arrays, and
  inside ``jit`` every float output is NaN instead
  (:func:`~fedlap_jax.client_data.check_labels`).

  Raises:
    ConfigError: a union :func:`check_union` refuses (shapes, label dtype, weights), or
      concrete labels outside ``[0, K)``.
  """
  key, params, synthetic, client_weights = on_device(key, params, synthetic, client_weights)
  check_union(synthetic, client_weights)
  counted = jnp.logical_and(synthetic.mask, (jnp.asarray(client_weights) > 0)[:, None])
  ok = check_labels(
    num_classes_of(apply_fn, params, jnp.shape(synthetic.x)[2:], jnp.result_type(synthetic.x)),
    ("synthetic.y", synthetic.y, counted),
  )
  weights = example_weights(synthetic.mask, client_weights).reshape(-1)
  x = synthetic.x.reshape(-1, *synthetic.x.shape[2:])
  y = synthetic.y.reshape(-1)
  radius = jnp.asarray(radius, jnp.float32)
  if optimizer is None:
    optimizer = config.direction()
  optimizer = optim.with_rate(optimizer, learning_rate)
  if opt_state is None:
    opt_state = optimizer.init(params)

  def cond(s):
    epoch, _, _, dist, _ = s
    return jnp.logical_and(epoch < config.max_epochs, dist < radius)

  def body(s):
    epoch, w, opt_state, _, steps = s
    w, opt_state, n = train_epoch(
      jax.random.fold_in(key, epoch),
      apply_fn,
      w,
      opt_state,
      x,
      y,
      weights,
      optimizer=optimizer,
      batch_size=config.batch_size,
      dsa_strategy=config.dsa_strategy,
    )
    return epoch + 1, w, opt_state, tree_distance(w, params), steps + n

  epochs, w, opt_state, dist, steps = jax.lax.while_loop(
    cond, body, (jnp.int32(0), params, opt_state, jnp.float32(0.0), jnp.int32(0))
  )
  return poison_unless(ok, (w, opt_state, ServerMetrics(epochs, steps, dist, radius)))


def server_state(
  params: PyTree, config: ServerConfig, optimizer: optax.GradientTransformation | None = None
) -> optax.OptState:
  """The fresh state of the server's optimiser for ``params`` (``optimizer=None``: the
  default of :func:`global_update_with_state`; SGD without momentum has no leaves)."""
  if optimizer is None:
    optimizer = config.direction()
  return optim.with_rate(optimizer, 1.0).init(params)


def global_update(
  key: jax.Array,
  apply_fn: Callable,
  params: PyTree,
  synthetic: SyntheticSet,
  client_weights: jax.Array,
  radius,
  *,
  learning_rate,
  config: ServerConfig,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, ServerMetrics]:
  """Algorithm 2: :func:`global_update_with_state` from a fresh optimiser state, the state
  dropped: ``(params, ServerMetrics)``. FedLAP's, FedDM's, DSC's and PSG's servers run it
  (the optimiser re-created every round)."""
  params, _, metrics = global_update_with_state(
    key,
    apply_fn,
    params,
    synthetic,
    client_weights,
    radius,
    None,
    learning_rate=learning_rate,
    config=config,
    optimizer=optimizer,
  )
  return params, metrics


def fedavg_delta_start(params: PyTree, model_deltas: PyTree, weights: jax.Array) -> PyTree:
  """The server's start for ``server.start='fedavg_delta'``: ``w_g + sum_k w_k delta_k / sum_k w_k``.

  Args:
    params: the global model ``w_g`` of the round.
    model_deltas: the clients' model deltas (``ClientUpdate.model_delta`` of
      ``model_steps='noisy_real'``), leaves ``(K, *leaf_shape)``.
    weights: ``(K,)`` the server's client weights
      (:func:`fedlap_jax.dispatch.client_weights`).
  """
  wn = weights / jnp.sum(weights)
  return jax.tree.map(lambda p, d: p + jnp.tensordot(wn, d, axes=1), params, model_deltas)


def server_step_with_state(
  key: jax.Array,
  apply_fn: Callable,
  params: PyTree,
  updates,
  config: FedLAPConfig,
  opt_state: optax.OptState | None,
  *,
  learning_rate,
  num_records: jax.Array | None = None,
  valid: jax.Array | None = None,
  optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, optax.OptState, ServerMetrics]:
  """FedLAP's server in one round: what it does with the clients' updates.

  ``r_g`` from the clients' ``r_k`` (:func:`fedlap_jax.methods.fedlap.radius.server_radius`
  with ``server.radius_strategy``), the client weights
  (:func:`fedlap_jax.dispatch.client_weights` with ``server.weighting``),
  the start (``w_g``, or with ``server.start='fedavg_delta'``
  :func:`fedavg_delta_start` of the clients' deltas), then
  :func:`global_update` on the union of the synthetic sets. Pure and
  jit-compatible (``config`` static; NumPy arguments are copied to the device first);
  every front end's server runs it.

  Args:
    key: ``k_server`` of the round.
    apply_fn, params: the model and the global model ``w_g`` of the round.
    updates: the clients' :class:`fedlap_jax.methods.fedlap.client.ClientUpdate` stacked,
      leaves ``(K', ...)`` (synthetic sets padded to one size and masked).
    config: :class:`~fedlap_jax.methods.fedlap.config.FedLAPConfig`.
    learning_rate: the server's step size of the round (may be traced;
      :func:`fedlap_jax.methods.fedlap.state.round_learning_rates`).
    num_records: ``(K',)`` the clients' ``N_k``; required with
      ``server.weighting='size'``.
    valid: optional ``(K',)`` bool: clients whose update counts (the others get
      weight 0 and are left out of ``r_g``).
    opt_state, optimizer: the server optimiser's state to start from (``None``: fresh, the
      paper's recipe) and its direction (``None``: ``server.direction()``, the config's
      ``server.optimizer`` or SGD of ``server.momentum`` and ``server.weight_decay``);
      :func:`global_update_with_state`.

  Returns:
    ``(params, opt_state, ServerMetrics)``.

  Raises:
    ValueError: ``server.start='fedavg_delta'`` and ``updates`` without model
      deltas; ``weighting='size'`` without ``num_records``.
  """
  key, params, updates, num_records, valid = on_device(key, params, updates, num_records, valid)
  sc = config.server
  num_clients = updates.radius.shape[0]
  r_g = server_radius(updates.radius, sc.radius_strategy, config.client.radius, valid)
  weights = client_weights(sc.weighting, num_records, num_clients=num_clients)
  if valid is not None:
    weights = weights * valid.astype(weights.dtype)
  start = params
  if sc.start == "fedavg_delta":
    if updates.model_delta is None:
      raise ValueError(
        "server.start='fedavg_delta' needs the clients' model deltas "
        "(ClientUpdate.model_delta); allowed: updates from client_step"
      )
    # The trust region is centred on the FedAvg model of the clients' deltas.
    start = fedavg_delta_start(params, updates.model_delta, weights)
  return global_update_with_state(
    key,
    apply_fn,
    start,
    updates.synthetic,
    weights,
    r_g,
    opt_state,
    learning_rate=learning_rate,
    config=sc,
    optimizer=optimizer,
  )
