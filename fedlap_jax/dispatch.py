"""Client dispatch: one function run for every client, on a swappable backend.

In the spirit of FedJAX's ``for_each_client``: an algorithm says *what* one
client computes (a pure function of that client's inputs and of what every
client shares) and :func:`run_clients` decides *how* the K clients run, with
the results stacked on a leading ``(K,)`` axis whatever the backend:

* ``vmap``: all clients at once, side by side (``jax.vmap`` with the axis
  name :data:`VMAP_AXIS`, so a client function can run its loops side by side,
  e.g. :func:`fedlap_jax.methods.fedlap.client.local_approx` with ``client_axis``);
* ``map``: one after another (``lax.map``), same numbers, a K-th of the memory;
* ``shard``: blocks of clients on the devices of a mesh, one after another
  within a block (:mod:`fedlap_jax.sharding`);
* ``auto``: ``shard`` on several devices, else ``map``, or for FedLAP on an
  accelerator ``vmap`` (:func:`resolve_client_backend`).

FedLAP (:mod:`fedlap_jax.methods.fedlap.state`) and the gradient-sharing baselines
(:mod:`fedlap_jax.baselines`) both dispatch their clients through here, and
weight them with :func:`client_weights` (the one weighting rule, from record counts
or from nothing).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedlap_jax import sharding
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData
from fedlap_jax.types import PyTree


CLIENT_BACKENDS = ("vmap", "map", "shard", "auto")
WEIGHTINGS = ("size", "uniform")

# The axis name of the ``vmap`` backend's client axis (for collectives such as
# "is any client still running?" inside the client function).
VMAP_AXIS = "side_by_side_clients"


def resolve_client_backend(name: str, *, side_by_side: bool = False) -> str:
  """``client_backend`` with ``"auto"`` resolved; other names are returned as they are.

  ``"auto"`` is ``"shard"`` when JAX sees several devices (each device runs
  its block of clients one after another); on one device it is ``"map"``
  (clients one after another), except that with ``side_by_side=True`` (FedLAP,
  whose client function runs side by side without the ``vmap`` penalties:
  :func:`fedlap_jax.methods.fedlap.client.local_approx` with ``client_axis``) on an
  accelerator it is ``"vmap"``, which gives each kernel the work of all the
  clients. On the CPU ``map`` stays faster (docs/benchmarks.md has the rounds
  measured both ways); the baselines keep ``map`` everywhere (their ``vmap``
  was never measured on an accelerator).
  """
  if name == "auto":
    if jax.device_count() > 1:
      return "shard"
    return "vmap" if side_by_side and jax.default_backend() != "cpu" else "map"
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


def run_clients(
  run: Callable,
  args: PyTree,
  *,
  replicated: tuple = (),
  client_backend: str = "auto",
  mesh: Any = None,
) -> PyTree:
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
    return jax.vmap(run, in_axes=(0,) + (None,) * len(replicated), axis_name=VMAP_AXIS)(
      args, *replicated
    )

  def one_by_one(block, *rep):
    return jax.lax.map(lambda one: run(one, *rep), block)

  if client_backend == "shard":
    return sharding.map_clients(one_by_one, args, replicated=replicated, mesh=mesh)
  return one_by_one(args, *replicated)


def record_counts(clients: ClientData) -> jax.Array:
  """``(K,)`` int32 ``N_k``: the real records of each stacked client."""
  return jnp.sum(clients.mask, axis=1)


def resolve_weighting(weighting: str | None, private: bool) -> str:
  """The server's weighting of a run, ``private`` (under DP) or not: the one rule of the
  weighting under DP, which every method's config applies.

  ``None`` is ``uniform`` under DP and ``size`` without; under DP only ``uniform`` is allowed
  (Algorithm 3 averages the client updates with ``1/K``, the setting the privacy analysis
  covers: a DP client does not release its ``N_k``).

  Raises:
    ConfigError: naming ``server.weighting``: anything but ``uniform`` or ``None`` under DP.
  """
  if weighting is None:
    return "uniform" if private else "size"
  if private and weighting != "uniform":
    raise ConfigError(
      "server.weighting",
      weighting,
      "'uniform' or None when DP is on (Algorithm 3 averages the client updates with 1/K, "
      "the setting the privacy analysis covers)",
    )
  return weighting


def client_weights(
  weighting: str | None, num_records: jax.Array | None = None, *, num_clients: int | None = None
) -> jax.Array:
  """The server's ``(K,)`` float32 client weights (not normalised): the one weighting rule.

  ``size``: ``N_k`` (paper Eq. 9; the server must know every ``N_k``);
  ``uniform``: ones (Algorithm 3: a DP client does not release ``N_k``).

  Args:
    weighting: ``"size"`` or ``"uniform"`` (:data:`fedlap_jax.dispatch.WEIGHTINGS`).
    num_records: ``(K,)`` the clients' record counts (e.g. :func:`record_counts`,
      or what the clients reported); required by ``size``.
    num_clients: ``K``, for ``uniform`` without ``num_records``.

  Raises:
    ConfigError: an unknown ``weighting``; ``size`` without ``num_records``;
      neither ``num_records`` nor ``num_clients``.
  """
  if weighting not in WEIGHTINGS:
    raise ConfigError("weighting", weighting, f"one of {WEIGHTINGS}")
  if weighting == "size":
    if num_records is None:
      raise ConfigError(
        "weighting",
        weighting,
        "'uniform' when the clients' record counts are not known",
        message="weighting='size' needs every client's "
        "record count N_k (num_records); allowed: the counts, or "
        "weighting='uniform'",
      )
    return jnp.asarray(num_records).astype(jnp.float32)
  if num_records is not None:
    num_clients = jnp.shape(num_records)[0]
  if num_clients is None:
    raise ValueError("client_weights needs num_records or num_clients (the number of clients)")
  return jnp.ones(num_clients, jnp.float32)
