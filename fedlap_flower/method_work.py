"""A registry method's round over Flower, generic over the method (no ``flwr``).

The Flower app runs every federated method of :data:`fedlap_jax.methods.REGISTRY`
(:func:`supported`), a method added to the registry included. Nothing here names a method; the
:class:`~fedlap_jax.method.Method` of ``cfg.method`` says what the
server's state is (:func:`initial_state`), what it sends (:attr:`Method.plan`'s message and each
client's ``own`` inputs), what a client computes (:attr:`Method.client_step`) and what the
server does with the replies (:attr:`Method.server_step`), so a round is the round of
``experiments.run`` (:func:`fedlap_jax.rounds.method_round`) cut at the wire.

A method's carried client state (:attr:`Method.carried`: SCAFFOLD's ``c_k``, a synthetic set)
stays with its client: before its first round the client computes its slot of the method's
``init`` from its own records (:attr:`Method.client_init`), and keeps the state its step returns
in its own state directory (:meth:`fedlap_flower.ledger.ClientState.save_carried`). The server
holds none of it: its plan and step see the round's clients' fields as public stand-ins of
their shapes (:func:`carried_standins`: every slot valid, images of a shape-only client), which
no method's plan reads beyond their shapes and masks.

The global model travels in its own record: a message's ``params`` field
(:func:`without_model`, :func:`with_model`).

Under DP (the method's mechanism) each client charges its own ledger and draws its own keys
(:func:`fresh_keys`, :mod:`fedlap_flower.client_app`); the server then sends no ``own`` keys.

The message and the ``own`` inputs travel as named arrays (:func:`tree_to_arrays`; PRNG keys as
their ``uint32`` words) and are read back against the structure the receiver computes itself
(:func:`arrays_to_tree`).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RunFacts, Wire
from fedlap_jax.methods import REGISTRY

from fedlap_flower import task


def supported(method: Method) -> bool:
  """Whether the Flower app runs ``method``: federated (not one pooled client), and its
  clients can start their carried state themselves (:attr:`Method.client_init`) if it has one."""
  return method.federated and (not method.carried or method.client_init is not None)


METHODS = tuple(n for n, m in REGISTRY.items() if supported(m))
"""The methods a Flower run runs (in the registry's order): those :func:`supported` (every
federated registry method)."""


def method_of(cfg) -> Method:
  """The registry method of ``cfg.method``."""
  return REGISTRY.method(cfg.method)


MAX_CLASSES_KEY = "max-classes-per-client"
"""The run-config key stating the most classes a client holds (0: not stated)."""


def run_facts(cfg, facts, num_params: int, max_classes: int = 0) -> RunFacts:
  """The :class:`~fedlap_jax.method.RunFacts` of a run (:func:`fedlap_runs.method_entries.run_facts`)
  from its :class:`fedlap_runs.build.Facts`, the stated ``max_classes`` checked first.

  ``max_classes``: the run config's ``max-classes-per-client`` (0: not stated), the most
  classes a client holds (a synthetic set's ``ipc`` slots per class), for a party that reads
  its own data and so does not know it (``facts.max_classes_per_client`` is ``None``). A party
  of the config's named partition knows it and takes its own.

  Raises:
    fedlap_jax.checks.ConfigError: naming ``max-classes-per-client``: stated otherwise than the
      named partition's.
  """
  known = facts.max_classes_per_client
  if known is not None and max_classes not in (0, known):
    raise ConfigError(
      MAX_CLASSES_KEY,
      max_classes,
      f"0 (not stated) or {known}",
      message=f"{MAX_CLASSES_KEY}={max_classes!r} is invalid: the config's named partition "
      f"gives its clients at most {known} classes. Allowed: 0 (not stated) or {known}",
    )
  from fedlap_runs import method_entries  # pylint: disable=g-import-not-at-top

  return method_entries.run_facts(cfg, facts, num_params, int(max_classes))


def classes_beyond(data: ClientData, facts: RunFacts) -> str | None:
  """Why a client holding ``data`` cannot take part in a run of ``facts`` (``None``: it can):
  it holds more classes than the run's ``max_classes_per_client`` (its synthetic set would
  have no slots for them)."""
  y = np.asarray(data.y)[np.asarray(data.mask)]
  held = int(np.unique(y).size)
  if held <= facts.max_classes_per_client:
    return None
  return (
    f"{MAX_CLASSES_KEY}={facts.max_classes_per_client} is invalid for this client: it holds "
    f"{held} classes, and its synthetic set has ipc slots for {facts.max_classes_per_client}. "
    f"Allowed: at least {held}, the most classes any client holds"
  )


def _shape_only_clients(method: Method, config, facts: RunFacts) -> ClientData:
  """Stacked clients of the run's shapes holding no records' values (zero images): what
  :attr:`Method.init` reads of the clients (their count, image shape and sizes) without any
  party's records. Every client is as large as the largest (``max_client_size``, else the
  expected batch) and owns the most classes any client owns (labels ``0, 1, ..`` in turn), so
  a synthetic set has the run's public shape with every slot valid."""
  n = facts.max_client_size or max(1, int(method.batch_size(config)))
  k = facts.num_clients
  labels = np.arange(n, dtype=np.int32) % max(1, facts.max_classes_per_client)
  return ClientData(
    np.broadcast_to(np.zeros((), np.float32), (k, n, *facts.image_shape)),
    np.broadcast_to(labels, (k, n)),
    np.broadcast_to(np.ones((), bool), (k, n)),
  )


def initial_state(method: Method, config, params, k_alg: jax.Array, facts: RunFacts):
  """The method's state before round 1 (``experiments.run``'s, from the algorithm key), its
  carried client fields those of shape-only clients (:func:`carried_standins`)."""
  return method.init(k_alg, params, _shape_only_clients(method, config, facts), config, facts)


def server_state(state, method: Method):
  """``state`` without the carried client fields (``None``): the server holds none of them."""
  return state._replace(**{f: None for f in method.carried})


def carried_standins(state, method: Method) -> dict:
  """``{field: leaves (K, ...)}``: :func:`initial_state`'s carried fields, public stand-ins of
  the clients' own (their shapes; a synthetic set's slots all valid) that a plan and a server
  step are given in their place."""
  return {f: getattr(state, f) for f in method.carried}


def with_standins(state, standins: dict, num: int):
  """``state`` with the first ``num`` stand-ins of each carried field (the round's clients)."""
  return state._replace(**{f: jax.tree.map(lambda a: a[:num], v) for f, v in standins.items()})


def without_model(message):
  """The message without its global model (it travels in the parameter record): its
  ``params`` field set to ``None``; a message without one as it is."""
  return message._replace(params=None) if "params" in getattr(message, "_fields", ()) else message


def with_model(message, params):
  """Inverse of :func:`without_model`."""
  return message._replace(params=params) if "params" in getattr(message, "_fields", ()) else message


def _is_key(leaf) -> bool:
  return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def fresh_keys(own, draw):
  """``own`` with every key leaf replaced by ``draw()`` (a DP client's own secret keys).

  Raises:
    ValueError: ``own`` has a leaf that is not a key: a client that draws its own inputs can
      draw keys only (the method's plan must send anything else in its message).
  """
  names = Wire.of(jax.tree.map(shape_of, own)).names()
  other = [n for n, leaf in zip(names, jax.tree.leaves(own)) if not _is_key(leaf)]
  if other:
    raise ValueError(
      f"the method's own inputs {other} are not PRNG keys: a client that draws its own "
      "inputs (under DP) draws keys only; allowed: a plan whose own inputs are keys"
    )
  return jax.tree.map(lambda leaf: draw(), own)


def tree_to_arrays(tree) -> dict[str, np.ndarray]:
  """``{name: array}`` of a pytree's leaves (names: :meth:`fedlap_jax.method.Wire.of`'s; a key
  leaf as its ``uint32`` words)."""
  names = Wire.of(jax.tree.map(shape_of, tree)).names()
  leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(tree)]
  return {n: np.asarray(x) for n, x in zip(names, leaves)}


def shape_of(leaf):
  """A leaf's ``jax.ShapeDtypeStruct`` (a key leaf: of its ``uint32`` words); ``leaf`` an
  array, a number or a ``jax.ShapeDtypeStruct``."""
  if _is_key(leaf):
    leaf = jax.eval_shape(jax.random.key_data, leaf)
  elif not hasattr(leaf, "dtype"):
    leaf = np.asarray(leaf)
  return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)


def arrays_to_tree(arrays: Mapping[str, Any], template):
  """Inverse of :func:`tree_to_arrays` against ``template`` (the receiver's own structure).

  Raises:
    fedlap_jax.checks.ConfigError: an array missing, unexpected, of another shape or dtype, or
      non-finite (:meth:`fedlap_jax.method.Wire.check`, naming it).
  """
  wire = Wire.of(jax.tree.map(shape_of, template))
  wire.check(arrays)
  leaves = [
    jax.random.wrap_key_data(jnp.asarray(arrays[n])) if _is_key(t) else jnp.asarray(arrays[n])
    for n, t in zip(wire.names(), jax.tree.leaves(template))
  ]
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def is_model(update, params) -> bool:
  """Whether a client update is a model (the parameters' structure: FedAvg's wire), which
  travels packed (:func:`fedlap_flower.records.params_to_record`)."""
  return jax.tree.structure(update) == jax.tree.structure(params)


@functools.lru_cache(maxsize=8)
def round_templates(method: Method, config, facts: RunFacts, params_def, params_leaves: tuple):
  """``(message, own, carried)`` of one client of a round, ``jax.ShapeDtypeStruct`` leaves
  (traced with :func:`jax.eval_shape`, nothing computed): the plan's message without its model
  (:func:`without_model`), one client's ``own`` inputs and its carried fields, for parameters
  of the treedef ``params_def`` and leaves ``params_leaves`` (:func:`shape_of`'s)."""

  def one_client(params):
    state = initial_state(method, config, params, jax.random.key(0), facts)
    plan = method.plan(state, 1, config)
    carried = tuple(jax.tree.map(lambda a: a[0], getattr(state, f)) for f in method.carried)
    return without_model(plan.message), jax.tree.map(lambda a: a[0], plan.own), carried

  return jax.eval_shape(one_client, jax.tree.unflatten(params_def, params_leaves))


@functools.lru_cache(maxsize=8)
def plan_fn(method: Method, num_clients: int, config):
  """``state -> RoundPlan`` of ``num_clients`` clients, jitted as the round computes it."""
  return jax.jit(lambda state: method.plan(state, num_clients, config))


@functools.lru_cache(maxsize=8)
def _client_jit(method: Method, model: ModelFns, config):
  def method_client_step(own, message, carried, data):
    result = method.client_step(own, model, message, carried, data, config)
    return result.update, result.carried

  return jax.jit(method_client_step)


@functools.lru_cache(maxsize=8)
def client_fn(method: Method, model: ModelFns, config):
  """``(own, message, carried, data) -> (update, carried)``: the method's client step, jitted
  (read back from the export cache: :func:`fedlap_flower.task.kept_exported`)."""
  return task.kept_exported(_client_jit(method, model, config))


def update_template(method: Method, model: ModelFns, config, message, own, carried, data):
  """The structure, shapes and dtypes of a client's update (``jax.ShapeDtypeStruct`` leaves):
  what a reply is read back into (nothing is computed)."""
  return jax.eval_shape(_client_jit(method, model, config), own, message, carried, data)[0]


def shape_only_client(method: Method, config, facts: RunFacts) -> ClientData:
  """One client of the run's largest shape (:func:`_shape_only_clients`' first)."""
  return jax.tree.map(lambda a: a[0], _shape_only_clients(method, config, facts))


@functools.lru_cache(maxsize=8)
def server_fn(method: Method, model: ModelFns, config, take_part: tuple[int, int]):
  """``(key, state, message, updates, num_records) -> (state, metrics)``: the server step,
  jitted (``key``: the plan's ``server_key``; read back from the export cache:
  :func:`fedlap_flower.task.kept_exported`)."""

  def method_server_step(key, state, message, updates, num_records):
    results = ClientResult(updates, (), ())
    return method.server_step(
      key, model, state, message, results, config, RoundFacts(num_records, take_part)
    )

  return task.kept_exported(jax.jit(method_server_step))
