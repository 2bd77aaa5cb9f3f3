"""Client dispatch: one function run for every client, on a swappable backend.

In the spirit of FedJAX's ``for_each_client``: an algorithm says *what* one
client computes (a pure function of that client's inputs and of what every
client shares) and :func:`run_clients` decides *how* the K clients run, with
the results stacked on a leading ``(K,)`` axis whatever the backend:

* ``vmap``: all clients at once (``jax.vmap``);
* ``map``: one after another (``lax.map``), same numbers, a K-th of the memory;
* ``shard``: blocks of clients on the devices of a mesh, one after another
  within a block (:mod:`fedlap_jax.sharding`);
* ``auto``: ``shard`` on several devices, else ``map``
  (:func:`resolve_client_backend`).

FedLAP (:mod:`fedlap_jax.federated`) and the gradient-sharing baselines
(:mod:`fedlap_jax.baselines`) both dispatch their clients through here, and
weight them with :func:`client_weights`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedlap_jax import sharding
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData
from fedlap_jax.config import CLIENT_BACKENDS
from fedlap_jax.types import PyTree


def resolve_client_backend(name: str) -> str:
  """``client_backend`` with ``"auto"`` resolved; other names are returned as they are.

  ``"auto"`` is ``"shard"`` when JAX sees several devices (each device runs
  its block of clients one after another) and ``"map"`` (clients one after
  another) on a single device, never ``"vmap"``: every client draws its own
  DSA family, so under ``vmap`` the batched ``lax.switch`` computes all six
  augmentation families for every batch and the ``lax.cond`` around a local
  update runs both branches, while ``map`` holds one client's temporaries at a
  time. BENCHMARKS.md has the rounds measured both ways on CPU and GPU.
  """
  if name == "auto":
    return "shard" if jax.device_count() > 1 else "map"
  return name


def place_inputs(round_fn: Callable, client_backend: str = "auto", mesh: Any = None) -> Callable:
  """``round_fn`` itself, or for the ``shard`` backend one that places its inputs first.

  A sharded round wants the state replicated over the mesh and the client data
  sharded over its client axis (:class:`fedlap_jax.sharding.PlacedRound`). The
  state stays placed from round 1 on, so a run compiles one program, and the
  client data moves to the devices once.
  """
  if resolve_client_backend(client_backend) != "shard":
    return round_fn
  return sharding.PlacedRound(round_fn, sharding.client_mesh() if mesh is None else mesh)


def run_clients(run: Callable, args: PyTree, *, replicated: tuple = (),
                client_backend: str = "auto", mesh: Any = None) -> PyTree:
  """``run(one_client_args, *replicated)`` for every client, stacked on a leading ``(K,)`` axis.

  ``args`` holds the per-client inputs (leading axis ``K``); ``replicated``
  what every client gets whole (the global model, the learning rate). The
  backend (:data:`CLIENT_BACKENDS`, ``auto`` resolved by
  :func:`resolve_client_backend`): ``vmap`` all at once, ``map`` one after
  another (``lax.map``), ``shard`` one after another within blocks placed on
  the devices of ``mesh`` (:func:`fedlap_jax.sharding.map_clients`).
  """
  if client_backend not in CLIENT_BACKENDS:
    raise ConfigError("client_backend", client_backend, f"{CLIENT_BACKENDS}")
  client_backend = resolve_client_backend(client_backend)
  if client_backend == "vmap":
    return jax.vmap(run, in_axes=(0,) + (None,) * len(replicated))(args, *replicated)

  def one_by_one(block, *rep):
    return jax.lax.map(lambda one: run(one, *rep), block)

  if client_backend == "shard":
    return sharding.map_clients(one_by_one, args, replicated=replicated, mesh=mesh)
  return one_by_one(args, *replicated)


def client_weights(clients: ClientData, weighting: str) -> jax.Array:
  """``(K,)`` server weights: ``N_k`` for ``size``, ones for ``uniform``."""
  if weighting == "uniform":
    return jnp.ones(clients.mask.shape[0], jnp.float32)
  return jnp.sum(clients.mask, axis=1).astype(jnp.float32)
