"""FedLAP / FedLAP-DP's round state, keys and rates.

A round is two pure steps, the same for every front end (the jitted round,
``experiments.run``, the Flower app): :func:`fedlap_jax.methods.fedlap.client.client_step`
on every client, then :func:`fedlap_jax.methods.fedlap.server.server_step_with_state` on their
stacked :class:`~fedlap_jax.methods.fedlap.client.ClientUpdate` s. This module holds what the
round around them needs: the state (:class:`FedLAPState`, :func:`init_state`), the round's keys
(:func:`round_keys`) and rates (:func:`round_learning_rates`), its metrics and the DP
mechanism. The round itself is the one generic round over a method
(:func:`fedlap_jax.rounds.algorithm` / :func:`fedlap_jax.rounds.make_round_fn` of
``fedlap_jax.methods.REGISTRY["fedlap"]``, :mod:`fedlap_jax.methods.fedlap`); the round
index is traced, so a run compiles once.

Clients of different sizes come stacked, padded to the largest client and
masked (:func:`fedlap_jax.client_data.stack_clients`); synthetic sets of
clients owning fewer classes are padded and masked the same way
(:func:`fedlap_jax.synthetic.synthetic_labels`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.client import LocalApproxMetrics
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.methods.fedlap.config import FedLAPConfig
from fedlap_jax.methods.fedlap.server import ServerMetrics, server_state
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
  state of ``server_optimizer`` (``None``: the config's;
  :func:`fedlap_jax.methods.fedlap.server.server_state`).

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
