"""One FedLAP / FedLAP-DP communication round over all clients.

:func:`fedlap_round` runs :func:`fedlap_jax.client.local_approx` on every
client (through :func:`fedlap_jax.dispatch.run_clients`: one client after
another, all at once with ``vmap``, or sharded over devices), combines the
client radii, and runs the server's :func:`fedlap_jax.server.global_update`.
The round index and learning rate are traced, so :func:`make_round_fn`
compiles once per run; :func:`algorithm` wraps the round as a
:class:`~fedlap_jax.algorithm.FederatedAlgorithm`.

Clients of different sizes come stacked, padded to the largest client and
masked (:func:`fedlap_jax.client_data.stack_clients`); synthetic sets of
clients owning fewer classes are padded and masked the same way
(:func:`synthetic_labels`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import accounting
from fedlap_jax.algorithm import FederatedAlgorithm, dp_mechanism as _mechanism
from fedlap_jax.checks import ConfigError
from fedlap_jax.client import LocalApproxMetrics, local_approx, shared_family_key
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.config import ClientConfig, FedLAPConfig
from fedlap_jax.dispatch import (VMAP_AXIS, client_weights, place_inputs,
                                 resolve_client_backend, run_clients)
from fedlap_jax.radius import server_radius
from fedlap_jax.server import ServerMetrics, global_update
from fedlap_jax.training import cosine_learning_rate
from fedlap_jax.types import PyTree

class FedLAPState(NamedTuple):
  """Server state between rounds.

  Attributes:
    params: global model parameters.
    synthetic: stacked :class:`SyntheticSet` of all clients, leaves ``(K, S, ...)``
      (carried across rounds under DP, re-drawn from real data otherwise).
    round: int32, rounds completed so far.
    key: PRNG key for the next round.
  """

  params: PyTree
  synthetic: SyntheticSet
  round: jax.Array
  key: jax.Array


class RoundMetrics(NamedTuple):
  """Diagnostics of one round: per-client leaves have a leading ``(K,)`` axis."""

  client: LocalApproxMetrics
  client_radius: jax.Array
  server: ServerMetrics
  learning_rate: jax.Array


def synthetic_labels(client_labels: Sequence[np.ndarray], ipc: int) -> tuple[np.ndarray, np.ndarray]:
  """Balanced synthetic labels: ``ipc`` per class each client owns (host side).

  Args:
    client_labels: K label arrays (only the real records, no padding).
    ipc: images per class.

  Returns:
    ``(labels, mask)`` of shape ``(K, S)`` with ``S = ipc * max_k classes_k``;
    each row holds the client's classes in increasing order, ``ipc`` slots each,
    then padding.
  """
  if ipc < 1:
    raise ConfigError("ipc", ipc, "an integer >= 1")
  classes = [np.unique(np.asarray(y)) for y in client_labels]
  s = ipc * max(len(c) for c in classes)
  labels = np.zeros((len(classes), s), np.int32)
  mask = np.zeros((len(classes), s), bool)
  for k, cls in enumerate(classes):
    row = np.repeat(cls, ipc)
    labels[k, :len(row)] = row
    mask[k, :len(row)] = True
  return labels, mask


def initial_synthetic(key: jax.Array, clients: ClientData, ipc: int,
                      synthetic_init: str) -> tuple[SyntheticSet, jax.Array]:
  """Round-1 synthetic sets: balanced labels and ``N(0, 1)`` images (host side).

  Labels are :func:`synthetic_labels` of each client's real records, images
  :func:`noise_images` (under ``synthetic_init="real"`` the caller draws real
  images later; this checks that it can).

  Args:
    key: PRNG key, split into the images' key and the one returned.
    clients: :class:`ClientData` with ``(K, N, ...)`` leaves.
    ipc: images per class.
    synthetic_init: ``"noise"`` or ``"real"``.

  Returns:
    ``(synthetic, key)``: ``(K, S, ...)`` :class:`SyntheticSet` and the
    remaining key for the state.

  Raises:
    ConfigError: under ``"real"``, a client has fewer than ``ipc`` records of
      one of its classes; ``ipc < 1``.
  """
  ys = [np.asarray(y)[np.asarray(m)] for y, m in zip(clients.y, clients.mask)]
  if synthetic_init == "real":
    for k, y in enumerate(ys):
      cls, counts = np.unique(y, return_counts=True)
      if counts.min() < ipc:
        raise ConfigError(
            "ipc", ipc, "ipc <= the smallest class count of every client", message=
            f"ipc={ipc} is invalid with synthetic_init='real': client {k} has only "
            f"{counts.min()} records of class {cls[np.argmin(counts)]}; allowed: ipc <= the "
            "smallest class count of every client (or synthetic_init='noise')")
  labels, mask = synthetic_labels(ys, ipc)
  k_init, k_state = jax.random.split(key)
  images = noise_images(k_init, jnp.asarray(mask), clients.x.shape[2:])
  return SyntheticSet(images, jnp.asarray(labels), jnp.asarray(mask)), k_state


def noise_images(key: jax.Array, mask: jax.Array, image_shape: tuple[int, ...]) -> jax.Array:
  """``N(0, 1)`` images for every valid slot, zeros for padding: ``(*mask.shape, *image_shape)``."""
  x = jax.random.normal(key, (*mask.shape, *image_shape), jnp.float32)
  return x * mask.reshape(*mask.shape, *([1] * len(image_shape)))


def real_images(key: jax.Array, client: ClientData, labels: jax.Array, mask: jax.Array,
                ipc: int) -> jax.Array:
  """Draws ``ipc`` distinct real images per synthetic class of ONE client.

  Slot ``s`` with label ``c`` gets the ``(s mod ipc)``-th record of class ``c``
  in a random order. Non-private: refused under DP by :class:`FedLAPConfig`.
  Every class of the client needs ``>= ipc`` records (:func:`init_state` checks).

  Args:
    key: PRNG key; client: one client's :class:`ClientData` ``(N, ...)``.
    labels, mask: ``(S,)`` synthetic labels and validity.
    ipc: images per class.

  Returns:
    ``(S, H, W, C)`` float32 images (zeros in padding slots).
  """
  scores = jax.random.uniform(key, client.y.shape)

  def pick(label, rank):
    s = jnp.where(jnp.logical_and(client.y == label, client.mask), scores, -1.0)
    _, idx = jax.lax.top_k(s, ipc)
    return idx[rank]

  ranks = jnp.arange(labels.shape[0]) % ipc
  idx = jax.vmap(pick)(labels, ranks)
  x = client.images(idx).astype(jnp.float32)
  return x * mask.reshape(-1, *([1] * (x.ndim - 1)))


def init_state(
    key: jax.Array,
    params: PyTree,
    clients: ClientData,
    config: FedLAPConfig,
) -> FedLAPState:
  """The state before round 1.

  Synthetic labels are balanced over each client's classes (``config.client.ipc``
  per class). Under ``synthetic_init="noise"`` the images are N(0, 1) once;
  under ``"real"`` they are drawn from real data at the start of every round.

  Raises:
    ConfigError: if ``batch_size`` exceeds the smallest client (q > 1), or, under
      ``"real"``, a client has fewer than ``ipc`` records of one of its classes.
  """
  if config.dp is not None and config.synthetic_init != "noise":
    raise ConfigError("synthetic_init", config.synthetic_init,
                      "'noise' (real images must not be published)",
                      message=f"synthetic_init={config.synthetic_init!r} is invalid with DP on; "
                      "allowed: 'noise' (real images must not be published)")
  sizes = [int(np.sum(m)) for m in np.asarray(clients.mask)]
  if config.client.batch_size > min(sizes):
    raise ConfigError(
        "batch_size", config.client.batch_size, "batch_size <= the smallest client", message=
        f"batch_size={config.client.batch_size} is invalid: client {int(np.argmin(sizes))} has"
        f" only {min(sizes)} records; allowed: batch_size <= the smallest client (the Poisson"
        " rate q = batch_size / N_k must be <= 1)")
  synthetic, k_state = initial_synthetic(key, clients, config.client.ipc, config.synthetic_init)
  return FedLAPState(params, synthetic, jnp.int32(0), k_state)


def server_learning_rate(round_index, config: FedLAPConfig):
  """The server's step size in round ``m`` (1-based, may be traced).

  The cosine schedule of ``config.server.learning_rate`` when set, else the
  run's ``eta_m`` (the paper: clients and server share one schedule).
  """
  base = config.server.learning_rate
  return cosine_learning_rate(round_index, config.rounds,
                              config.learning_rate if base is None else base,
                              schedule=config.lr_schedule)


def fedavg_delta_start(params: PyTree, model_deltas: PyTree, weights: jax.Array) -> PyTree:
  """The server's start for ``server.start='fedavg_delta'``: ``w_g + sum_k w_k delta_k / sum_k w_k``.

  Args:
    params: the global model ``w_g`` of the round.
    model_deltas: the clients' model deltas (``LocalApproxMetrics.model_delta``
      of ``model_steps='noisy_real'``), leaves ``(K, *leaf_shape)``.
    weights: ``(K,)`` the server's client weights (:func:`fedlap_jax.dispatch.client_weights`).
  """
  wn = weights / jnp.sum(weights)
  return jax.tree.map(lambda p, d: p + jnp.tensordot(wn, d, axes=1), params, model_deltas)


def fedlap_round(
    state: FedLAPState,
    clients: ClientData,
    *,
    apply_fn: Callable,
    config: FedLAPConfig,
    client_backend: str = "auto",
    mesh: Any = None,
) -> tuple[FedLAPState, RoundMetrics]:
  """One communication round (Algorithm 2 around Algorithm 1, or Algorithm 3).

  Args:
    state: :class:`FedLAPState` after ``state.round`` rounds.
    clients: stacked :class:`ClientData`, leaves ``(K, N_max, ...)``.
    apply_fn: ``apply_fn(params, x) -> logits``.
    config: :class:`FedLAPConfig` (static).
    client_backend: ``vmap`` (all clients side by side: each step batched
      over the clients, one DSA family per step shared by them with
      ``dsa_family_draw="shared"``, loop termination as masks; same results
      as ``map``), ``map`` (one after another with ``lax.map``: a K-th of
      the memory), ``shard`` (blocks of clients on the devices of ``mesh``,
      one after another within a block; :mod:`fedlap_jax.sharding`) or
      ``auto`` (the default: ``shard`` on several devices, ``vmap`` on one
      accelerator, ``map`` on the CPU; :func:`resolve_client_backend`).
    mesh: for ``shard``: a 1-D mesh with axis ``"clients"``; default all
      devices (:func:`fedlap_jax.sharding.client_mesh`).

  Returns:
    ``(new_state, RoundMetrics)``.
  """
  cc = config.client
  m = state.round + 1
  lr = cosine_learning_rate(m, config.rounds, config.learning_rate, schedule=config.lr_schedule)
  key, k_init, k_clients, k_server = jax.random.split(state.key, 4)
  num_clients = clients.mask.shape[0]
  synthetic = state.synthetic
  if config.synthetic_init == "real":
    x = jax.vmap(real_images, in_axes=(0, 0, 0, 0, None))(
        jax.random.split(k_init, num_clients), clients, synthetic.y, synthetic.mask, cc.ipc)
    synthetic = synthetic._replace(x=x)

  # Side by side (vmap), the clients' loops run with a shared counter and masks.
  client_backend = resolve_client_backend(client_backend, side_by_side=True)
  client_axis = VMAP_AXIS if client_backend == "vmap" else None

  def run(args, params, lr, family_key):
    k, syn, data = args
    return local_approx(k, apply_fn=apply_fn, params=params, config=cc, learning_rate=lr,
                        synthetic=syn, client_data=data, family_key=family_key,
                        client_axis=client_axis)

  family_key = shared_family_key(k_clients)
  args = (jax.random.split(k_clients, num_clients), synthetic, clients)
  synthetic, radii, client_metrics = run_clients(
      run, args, replicated=(state.params, lr, family_key), client_backend=client_backend,
      mesh=mesh)

  r_g = server_radius(radii, config.server.radius_strategy, cc.radius)
  weights = client_weights(clients, config.server.weighting)
  start = state.params
  if config.server.start == "fedavg_delta":
    # The trust region is centred on the FedAvg model of the clients' deltas.
    start = fedavg_delta_start(state.params, client_metrics.model_delta, weights)
  client_metrics = client_metrics._replace(model_delta=None)  # used; not a metric to log
  params, server_metrics = global_update(
      k_server, apply_fn, start, synthetic, weights, r_g,
      learning_rate=server_learning_rate(m, config), config=config.server)
  new_state = FedLAPState(params, synthetic, m, key)
  return new_state, RoundMetrics(client_metrics, radii, server_metrics, lr)


def make_round_fn(apply_fn: Callable, config: FedLAPConfig, *, client_backend: str = "auto",
                  mesh: Any = None, donate_state: bool = False):
  """``jit(fedlap_round)`` with ``apply_fn`` and ``config`` bound: ``(state, clients) -> (state, metrics)``.

  ``donate_state=True`` donates the input state's buffers to the output
  (``donate_argnums=0``): saves a copy of the parameters and synthetic sets per
  round, but the state passed in must not be used afterwards (keep only the
  returned one). ``mesh`` is for ``client_backend="shard"``; the round then
  places its inputs on the mesh itself (:func:`place_inputs`).
  """
  round_fn = jax.jit(functools.partial(fedlap_round, apply_fn=apply_fn, config=config,
                                       client_backend=client_backend, mesh=mesh),
                     donate_argnums=(0,) if donate_state else ())
  return place_inputs(round_fn, client_backend, mesh)


# One jit shared by every FedLAP algorithm built here: runs with equal configs (and
# the same ``apply_fn`` object) share one compilation; a run compiles once.
_round_jit = jax.jit(fedlap_round,
                     static_argnames=("apply_fn", "config", "client_backend", "mesh"))


def dp_mechanism(client: ClientConfig) -> accounting.DpMechanism | None:
  """FedLAP-DP's mechanism: ``T = R_i * max_outer * batch_loop`` noisy real batches of
  expected size ``B`` per round (Algorithm 3); ``None`` without DP."""
  return _mechanism(client.dp, batch_size=client.batch_size,
                    steps_per_round=client.real_accesses_per_round)


def algorithm(apply_fn: Callable, config: FedLAPConfig, *, image_shape: tuple[int, ...],
              max_classes_per_client: int, client_backend: str = "auto",
              mesh: Any = None) -> FederatedAlgorithm:
  """FedLAP / FedLAP-DP as a :class:`FederatedAlgorithm`.

  ``round`` is the module's one jit of :func:`fedlap_round` with ``apply_fn``,
  ``config`` and the backend as static arguments: the round index and learning
  rate are traced, so a run compiles once, and algorithms with equal settings
  (e.g. the seeds of a sweep, a resumed run) share the compilation. The
  counterpart of :func:`fedlap_jax.baselines.algorithm`.

  ``upload_floats_per_client = ipc * max_classes_per_client * prod(image_shape)``
  (the synthetic images; labels are fixed and sent once).
  """
  cc = config.client
  upload = int(cc.ipc * max_classes_per_client * np.prod(image_shape))
  round_fn = functools.partial(_round_jit, apply_fn=apply_fn, config=config,
                               client_backend=client_backend, mesh=mesh)
  return FederatedAlgorithm(
      name="fedlap_dp" if cc.dp is not None else "fedlap",
      init=lambda key, params, clients: init_state(key, params, clients, config),
      round=place_inputs(round_fn, client_backend, mesh),
      params_of=lambda state: state.params,
      upload_floats_per_client=upload,
      dp=cc.dp,
      mechanism=dp_mechanism(cc),
      batch_size=cc.batch_size,
      client_state_fields=("synthetic",),
  )
