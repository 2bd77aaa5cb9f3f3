"""One FedLAP / FedLAP-DP communication round over all clients.

A round is two pure steps, the same for every front end (this jitted round,
``experiments.run``, the Flower app): :func:`fedlap_jax.client.client_step`
on every client (through :func:`fedlap_jax.dispatch.run_clients`: one client
after another, all at once with ``vmap``, or sharded over devices), then
:func:`fedlap_jax.server.server_step` on their stacked
:class:`~fedlap_jax.client.ClientUpdate` s. :func:`round_learning_rates`
gives both steps their rates. The round index is traced, so :func:`make_round_fn`
compiles once per run; :func:`algorithm` wraps the round as a
:class:`~fedlap_jax.algorithm.FederatedAlgorithm`.

Clients of different sizes come stacked, padded to the largest client and
masked (:func:`fedlap_jax.client_data.stack_clients`); synthetic sets of
clients owning fewer classes are padded and masked the same way
(:func:`fedlap_jax.synthetic.synthetic_labels`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import accounting
from fedlap_jax.algorithm import FederatedAlgorithm
from fedlap_jax.checks import ConfigError
from fedlap_jax.client import LocalApproxMetrics, client_step, shared_family_key
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.config import ClientConfig, FedLAPConfig
from fedlap_jax.dispatch import (
  VMAP_AXIS,
  place_inputs,
  record_counts,
  resolve_client_backend,
  run_clients,
)
from fedlap_jax.server import ServerMetrics, server_state, server_step, server_step_with_state
from fedlap_jax.synthetic import initial_synthetic
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
    opt_state: the server optimiser's state carried to the next round. By default (the
      paper's Algorithm 2) the server's optimiser starts afresh every round and nothing is
      carried: ``()``. With ``config.server.carry_state=True`` it is the
      state after the last round's server step (``init`` of the optimiser before round
      1), and the next round starts from it. Last, so the checkpoint leaves of the other
      fields keep their names and a checkpoint written before the field restores.
  """

  params: PyTree
  synthetic: SyntheticSet
  round: jax.Array
  key: jax.Array
  opt_state: Any = ()


class RoundMetrics(NamedTuple):
  """Diagnostics of one round: per-client leaves have a leading ``(K,)`` axis."""

  client: LocalApproxMetrics
  client_radius: jax.Array
  server: ServerMetrics
  learning_rate: jax.Array


def init_state(
  key: jax.Array,
  params: PyTree,
  clients: ClientData,
  config: FedLAPConfig,
  *,
  server_optimizer: optax.GradientTransformation | None = None,
) -> FedLAPState:
  """The state before round 1.

  ``opt_state``: ``()`` (nothing carried), or with ``config.server.carry_state`` the fresh
  state of ``server_optimizer`` (``None``: the config's; :func:`fedlap_jax.server.server_state`).

  Synthetic labels are balanced over each client's classes (``config.client.ipc``
  per class). Under ``synthetic_init="noise"`` the images are N(0, 1) once;
  under ``"real"`` they are drawn from real data at the start of every round.

  Raises:
    ConfigError: if ``batch_size`` exceeds the smallest client (q > 1), or, under
      ``"real"``, a client has fewer than ``ipc`` records of one of its classes.
  """
  if config.dp is not None and config.synthetic_init != "noise":
    raise ConfigError(
      "synthetic_init",
      config.synthetic_init,
      "'noise' (real images must not be published)",
      message=f"synthetic_init={config.synthetic_init!r} is invalid with DP on; "
      "allowed: 'noise' (real images must not be published)",
    )
  sizes = [int(np.sum(m)) for m in np.asarray(clients.mask)]
  if config.client.batch_size > min(sizes):
    raise ConfigError(
      "batch_size",
      config.client.batch_size,
      "batch_size <= the smallest client",
      message=f"batch_size={config.client.batch_size} is invalid: client {int(np.argmin(sizes))} has"
      f" only {min(sizes)} records; allowed: batch_size <= the smallest client (the Poisson"
      " rate q = batch_size / N_k must be <= 1)",
    )
  synthetic, k_state = initial_synthetic(key, clients, config.client.ipc, config.synthetic_init)
  carry = config.server.carry_state
  opt_state = server_state(params, config.server, server_optimizer) if carry else ()
  return FedLAPState(params, synthetic, jnp.int32(0), k_state, opt_state)


class RoundKeys(NamedTuple):
  """The keys one round splits from the state key: ``split(key, 4)`` in this order.

  Client ``k`` of ``K`` uses ``split(clients, K)[k]`` (and ``split(init, K)[k]`` for real
  images); every front end derives a round's keys here.
  """

  next: jax.Array  # the state key of the next round
  init: jax.Array  # the real-image draws of synthetic_init='real'
  clients: jax.Array  # the clients' keys and the round's shared DSA family key
  server: jax.Array  # the server step


def round_keys(key: jax.Array) -> RoundKeys:
  """The :class:`RoundKeys` of a round whose state key is ``key``."""
  return RoundKeys(*jax.random.split(key, 4))


class RoundRates(NamedTuple):
  """The step sizes of round ``m``: the clients' ``eta_m`` and the server's."""

  client: jax.Array
  server: jax.Array


def round_learning_rates(round_index, config: FedLAPConfig) -> RoundRates:
  """The learning rates of round ``m`` (1-based, may be traced), for both steps.

  ``client``: ``eta_m``, the cosine schedule of ``config.learning_rate``
  (:func:`fedlap_jax.training.cosine_learning_rate` with ``config.lr_schedule``).
  ``server``: the same schedule of ``config.server.learning_rate`` when set,
  else ``eta_m`` itself (the paper: clients and server share one schedule).
  """
  client = cosine_learning_rate(
    round_index, config.rounds, config.learning_rate, schedule=config.lr_schedule
  )
  base = config.server.learning_rate
  server = (
    client
    if base is None
    else cosine_learning_rate(round_index, config.rounds, base, schedule=config.lr_schedule)
  )
  return RoundRates(client, server)


def server_learning_rate(round_index, config: FedLAPConfig):
  """The server's step size in round ``m``: ``round_learning_rates(m, config).server``."""
  return round_learning_rates(round_index, config).server


def fedlap_round(
  state: FedLAPState,
  clients: ClientData,
  *,
  apply_fn: Callable,
  config: FedLAPConfig,
  client_backend: str = "auto",
  mesh: Any = None,
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
) -> tuple[FedLAPState, RoundMetrics]:
  """One communication round (Algorithm 2 around Algorithm 1, or Algorithm 3).

  The round's keys: ``(next, k_init, k_clients, k_server) = round_keys(state.key)``;
  client ``k`` runs :func:`fedlap_jax.client.client_step` with
  ``split(k_clients, K)[k]``, ``split(k_init, K)[k]`` (real images) and the
  shared family key ``shared_family_key(k_clients)``; the server runs
  :func:`fedlap_jax.server.server_step` with ``k_server``.

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
    image_optimizer, model_optimizer: the clients' optimisers of the synthetic images and
      of the model (:func:`fedlap_jax.client.client_step`); server_optimizer: the server's
      direction (:func:`fedlap_jax.server.server_step_with_state`). ``None``: the defaults
      of :mod:`fedlap_jax.optim`. Static (they hash by identity). With
      ``config.server.carry_state`` the server's optimiser starts from ``state.opt_state``
      and its state is carried to the next round (FedOpt-style); without (the paper) it
      starts afresh every round and ``state.opt_state`` stays ``()``.

  Returns:
    ``(new_state, RoundMetrics)``.
  """
  m = state.round + 1
  rates = round_learning_rates(m, config)
  key, k_init, k_clients, k_server = round_keys(state.key)
  num_clients = clients.mask.shape[0]
  init_keys = jax.random.split(k_init, num_clients) if config.synthetic_init == "real" else None

  # Side by side (vmap), the clients' loops run with a shared counter and masks.
  client_backend = resolve_client_backend(client_backend, side_by_side=True)
  client_axis = VMAP_AXIS if client_backend == "vmap" else None

  def run(args, params, lr, family_key):
    k, syn, data, k_real = args
    return client_step(
      k,
      apply_fn,
      params,
      syn,
      data,
      config,
      learning_rate=lr,
      family_key=family_key,
      init_key=k_real,
      client_axis=client_axis,
      image_optimizer=image_optimizer,
      model_optimizer=model_optimizer,
    )

  args = (jax.random.split(k_clients, num_clients), state.synthetic, clients, init_keys)
  updates, client_metrics = run_clients(
    run,
    args,
    replicated=(state.params, rates.client, shared_family_key(k_clients)),
    client_backend=client_backend,
    mesh=mesh,
  )
  num_records = record_counts(clients)
  if config.server.carry_state:
    params, opt_state, server_metrics = server_step_with_state(
      k_server,
      apply_fn,
      state.params,
      updates,
      config,
      state.opt_state,
      learning_rate=rates.server,
      num_records=num_records,
      optimizer=server_optimizer,
    )
  else:  # Algorithm 2: the server's optimiser starts afresh; nothing is carried
    params, server_metrics = server_step(
      k_server,
      apply_fn,
      state.params,
      updates,
      config,
      learning_rate=rates.server,
      num_records=num_records,
      optimizer=server_optimizer,
    )
    opt_state = state.opt_state
  new_state = FedLAPState(params, updates.synthetic, m, key, opt_state)
  return new_state, RoundMetrics(client_metrics, updates.radius, server_metrics, rates.client)


def make_round_fn(
  apply_fn: Callable,
  config: FedLAPConfig,
  *,
  client_backend: str = "auto",
  mesh: Any = None,
  donate_state: bool = False,
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
):
  """``jit(fedlap_round)`` with ``apply_fn`` and ``config`` bound: ``(state, clients) -> (state, metrics)``.

  ``donate_state=True`` donates the input state's buffers to the output
  (``donate_argnums=0``): saves a copy of the parameters and synthetic sets per
  round, but the state passed in must not be used afterwards (keep only the
  returned one). ``mesh`` is for ``client_backend="shard"``; the round then
  places its inputs on the mesh itself (:func:`place_inputs`). The optimisers: as
  :func:`fedlap_round`.
  """
  round_fn = jax.jit(
    functools.partial(
      fedlap_round,
      apply_fn=apply_fn,
      config=config,
      client_backend=client_backend,
      mesh=mesh,
      image_optimizer=image_optimizer,
      model_optimizer=model_optimizer,
      server_optimizer=server_optimizer,
    ),
    donate_argnums=(0,) if donate_state else (),
  )
  return place_inputs(round_fn, client_backend, mesh)


# One jit shared by every FedLAP algorithm built here: runs with equal configs (and
# the same ``apply_fn`` object) share one compilation; a run compiles once.
_OPTIMISERS = ("image_optimizer", "model_optimizer", "server_optimizer")
_round_jit = jax.jit(
  fedlap_round, static_argnames=("apply_fn", "config", "client_backend", "mesh", *_OPTIMISERS)
)


def dp_mechanism(client: ClientConfig | FedLAPConfig) -> accounting.DpMechanism | None:
  """FedLAP-DP's mechanism: ``T = R_i * max_outer * batch_loop`` noisy real batches of
  expected size ``B`` per round (Algorithm 3); ``None`` without DP
  (:meth:`~fedlap_jax.accounting.DpMechanism.from_config`)."""
  return accounting.DpMechanism.from_config(client)


def algorithm(
  apply_fn: Callable,
  config: FedLAPConfig,
  *,
  image_shape: tuple[int, ...],
  max_classes_per_client: int,
  client_backend: str = "auto",
  mesh: Any = None,
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
) -> FederatedAlgorithm:
  """FedLAP / FedLAP-DP as a :class:`FederatedAlgorithm`.

  ``round`` is the module's one jit of :func:`fedlap_round` with ``apply_fn``,
  ``config`` and the backend as static arguments: the round index and learning
  rate are traced, so a run compiles once, and algorithms with equal settings
  (e.g. the seeds of a sweep, a resumed run) share the compilation. The
  counterpart of :func:`fedlap_jax.baselines.algorithm`.

  ``upload_floats_per_client = ipc * max_classes_per_client * prod(image_shape)``
  (the synthetic images; labels are fixed and sent once).

  The optimisers: as :func:`fedlap_round` (``None``: the
  defaults of :mod:`fedlap_jax.optim`). They are static arguments of the shared jit and
  hash by identity: build each once and pass the same object to every algorithm that
  should share a compilation.
  """
  cc = config.client
  upload = int(cc.ipc * max_classes_per_client * np.prod(image_shape))
  optimisers = dict(
    image_optimizer=image_optimizer,
    model_optimizer=model_optimizer,
    server_optimizer=server_optimizer,
  )
  round_fn = functools.partial(
    _round_jit,
    apply_fn=apply_fn,
    config=config,
    client_backend=client_backend,
    mesh=mesh,
    **optimisers,
  )
  return FederatedAlgorithm(
    name="fedlap_dp" if cc.dp is not None else "fedlap",
    init=lambda key, params, clients: init_state(
      key, params, clients, config, server_optimizer=server_optimizer
    ),
    round=place_inputs(round_fn, client_backend, mesh),
    params_of=lambda state: state.params,
    upload_floats_per_client=upload,
    dp=cc.dp,
    mechanism=dp_mechanism(cc),
    batch_size=cc.batch_size,
    client_state_fields=("synthetic",),
  )
