"""One jitted round over any :class:`~fedlap_jax.method.Method`.

:func:`method_round` runs the method's plan, every client's step (through
:func:`fedlap_jax.dispatch.run_clients`: one after another, side by side under ``vmap``, or
sharded over devices) and the server's step; :func:`algorithm` binds a method, its config and
the model into a :class:`~fedlap_jax.algorithm.FederatedAlgorithm`. The round knows no method:
what differs lives in the method's value (:mod:`fedlap_jax.methods`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from fedlap_jax.algorithm import FederatedAlgorithm
from fedlap_jax.checks import ConfigError, one_of
from fedlap_jax.client_data import ClientData
from fedlap_jax.dispatch import CLIENT_BACKENDS
from fedlap_jax.dispatch import (
  VMAP_AXIS,
  place_inputs,
  record_counts,
  resolve_client_backend,
  run_clients,
)
from fedlap_jax.method import Method, ModelFns, RoundFacts, RunFacts


def method_round(
  state: Any,
  clients: ClientData,
  *,
  method: Method,
  config: Any,
  model: ModelFns,
  client_backend: str = "auto",
  mesh: Any = None,
  take_part: tuple[int, int] | None = None,
) -> tuple[Any, Any]:
  """One round of ``method``: its plan, every client's step, the server's step.

  Args:
    state: the method's state after ``state.round`` rounds.
    clients: stacked :class:`ClientData`, leaves ``(K, N_max, ...)``.
    method, config, model: the method, its library config and the model (static).
    client_backend: ``vmap``, ``map``, ``shard`` or ``auto``
      (:func:`fedlap_jax.dispatch.resolve_client_backend` with the method's ``side_by_side``);
      a method whose round is one pooled client runs ``map``.
    mesh: for ``shard``: a 1-D mesh with axis ``"clients"``.
    take_part: static ``(m, K)``: the round runs ``m`` of the run's ``K`` clients (``None``:
      all of those given).

  Returns:
    ``(new_state, metrics)``.
  """
  clients = method.prepare_clients(clients, config)
  num = clients.mask.shape[0]
  plan = method.plan(state, num, config)
  if not method.federated:  # one pooled client
    backend, mesh = "map", None
  else:
    backend = resolve_client_backend(client_backend, side_by_side=method.side_by_side)
  axis = VMAP_AXIS if backend == "vmap" and method.side_by_side else None
  carried = tuple(getattr(state, f) for f in method.carried)

  def one(args, message):
    own, carried_k, data = args
    return method.client_step(own, model, message, carried_k, data, config, client_axis=axis)

  results = run_clients(
    one, (plan.own, carried, clients), replicated=(plan.message,), client_backend=backend, mesh=mesh
  )
  facts = RoundFacts(record_counts(clients), take_part or (num, num))
  new_state, metrics = method.server_step(
    plan.server_key, model, state, plan.message, results, config, facts
  )
  new_state = new_state._replace(
    **dict(zip(method.carried, results.carried)), round=state.round + 1, key=plan.next_key
  )
  return new_state, metrics


# One jit shared by every method and setting: runs with equal (method, config, model) share one
# compilation (the seeds of a sweep, a resumed run).
_STATICS = ("method", "config", "model", "client_backend", "mesh", "take_part")
_round_jit = jax.jit(method_round, static_argnames=_STATICS)
_donating_round_jit = jax.jit(method_round, static_argnames=_STATICS, donate_argnums=(0,))


def make_round_fn(
  method: Method,
  config: Any,
  model: ModelFns,
  *,
  client_backend: str = "auto",
  mesh: Any = None,
  take_part: tuple[int, int] | None = None,
  donate_state: bool = False,
):
  """``(state, clients) -> (state, metrics)``: the shared jit of :func:`method_round` bound
  (the ``shard`` backend places its inputs first: :func:`fedlap_jax.dispatch.place_inputs`).

  ``donate_state=True`` donates the input state's buffers to the output (``donate_argnums=0``):
  saves a copy of the parameters and carried state per round, but the state passed in must not
  be used afterwards (keep only the returned one).
  """
  round_fn = functools.partial(
    _donating_round_jit if donate_state else _round_jit,
    method=method,
    config=config,
    model=model,
    client_backend=client_backend,
    mesh=mesh,
    take_part=take_part,
  )
  return place_inputs(round_fn, client_backend, mesh)


def run_facts(
  params: Any, clients: ClientData, *, clients_per_round: int | None = None
) -> RunFacts:
  """The :class:`~fedlap_jax.method.RunFacts` of a run on ``clients`` (host side): the image
  shape, ``K``, the model's parameter count, the most classes a client holds and ``N_max`` read
  off the stacked data (leaves ``(K, N_max, ...)``; only records under the mask count).

  A deployment in which no party sees every client's data states them instead (the Flower
  app's run config)."""
  mask = np.asarray(clients.mask)
  y = np.asarray(clients.y)
  held = [np.unique(y[k][mask[k]]).size for k in range(mask.shape[0])]
  return RunFacts(
    image_shape=tuple(int(d) for d in clients.x.shape[2:]),
    num_clients=int(mask.shape[0]),
    num_params=int(sum(np.size(p) for p in jax.tree.leaves(params))),
    max_classes_per_client=int(max(held)),
    max_client_size=int(mask.sum(axis=1).max()),
    clients_per_round=clients_per_round,
  )


def algorithm(
  method: Method,
  config: Any,
  model: ModelFns,
  facts: RunFacts,
  *,
  client_backend: str = "auto",
  mesh: Any = None,
) -> FederatedAlgorithm:
  """``method`` under ``config`` as a :class:`~fedlap_jax.algorithm.FederatedAlgorithm`.

  ``facts.clients_per_round = m < K`` binds ``take_part = (m, K)`` (the round is run on the
  sampled clients by :func:`fedlap_jax.participation.sampled_round`).

  Raises:
    ConfigError: ``config`` is not the method's config class, an unknown backend.
  """
  if not isinstance(config, method.config_type):
    raise ConfigError("config", config, f"a {method.config_type.__name__} ({method.name})")
  one_of("client_backend", client_backend, CLIENT_BACKENDS)
  m = facts.clients_per_round
  take_part = None if m is None or m == facts.num_clients else (m, facts.num_clients)
  accesses = config.dp_accesses()  # every library config of a method has it
  return FederatedAlgorithm(
    name=method.name_of(config),
    init=lambda key, params, clients: method.init(key, params, clients, config, facts),
    round=make_round_fn(
      method, config, model, client_backend=client_backend, mesh=mesh, take_part=take_part
    ),
    params_of=lambda state: state.params,
    upload_floats_per_client=int(method.upload_floats(config, facts)),
    dp=None if accesses is None else accesses.dp,
    mechanism=method.mechanism(config),
    batch_size=method.batch_size(config),
    client_state_fields=method.client_state_fields(config),
  )
