"""A registry method's round over Flower, generic over the method (no ``flwr``).

The Flower app runs, besides FedLAP (:mod:`fedlap_flower.client_work`), every method of
:data:`fedlap_jax.methods.REGISTRY` whose clients carry no state between rounds and send their
model (FedAvg's wire, :func:`fedlap_jax.methods.fedavg.model_wire`): :func:`supported`. Nothing
here names a method; the :class:`~fedlap_jax.method.Method` of ``cfg.method`` says what the
server's state is (:func:`initial_state`), what it sends (:attr:`Method.plan`'s message and each
client's ``own`` inputs), what a client computes (:attr:`Method.client_step`) and what the
server does with the replies (:attr:`Method.server_step`), so a round is the round of
``experiments.run`` (:func:`fedlap_jax.rounds.method_round`) cut at the wire.

Under DP (the method's mechanism) each client charges its own ledger and draws its own keys
(:func:`fresh_keys`), as a FedLAP-DP client does (:mod:`fedlap_flower.client_app`); the server
then sends no ``own`` keys.

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

from fedlap_jax.client_data import ClientData
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RunFacts, Wire
from fedlap_jax.methods import REGISTRY, fedavg
from fedlap_jax.methods import fedlap as _fedlap


def supported(method: Method) -> bool:
  """Whether the generic strategy runs ``method``: federated, no carried client state, FedAvg's
  wire (the client's model)."""
  return method.federated and not method.carried and method.wire is fedavg.model_wire


def has_own_strategy(method: Method) -> bool:
  """FedLAP / FedLAP-DP: their own strategy (:class:`fedlap_flower.strategy.FedLAP`: synthetic
  sets on the wire)."""
  return method is _fedlap.METHOD


METHODS = tuple(n for n, m in REGISTRY.items() if has_own_strategy(m) or supported(m))
"""The methods a Flower run runs (in the registry's order): FedLAP's and those :func:`supported`."""


def method_of(cfg) -> Method:
  """The registry method of ``cfg.method``."""
  return REGISTRY.method(cfg.method)


def run_facts(cfg, facts, num_params: int) -> RunFacts:
  """The :class:`~fedlap_jax.method.RunFacts` of a run (as :func:`experiments.methods.algorithm`
  builds them) from its :class:`experiments.build.Facts`."""
  return RunFacts(
    tuple(facts.image_shape),
    int(cfg.data.num_clients),
    int(num_params),
    facts.max_classes_per_client or 0,
    facts.max_client_size,
    cfg.data.get("clients_per_round"),
  )


def _shape_only_clients(method: Method, config, facts: RunFacts) -> ClientData:
  """Stacked clients of the run's shapes holding no records' values (broadcast zeros): what
  :attr:`Method.init` reads of the clients (their count, image shape and sizes) without any
  party's records. Every client is as large as the largest (``max_client_size``, else the
  expected batch)."""
  n = facts.max_client_size or max(1, int(method.batch_size(config)))
  k = facts.num_clients
  zeros = np.zeros((), np.float32)
  return ClientData(
    np.broadcast_to(zeros, (k, n, *facts.image_shape)),
    np.broadcast_to(np.zeros((), np.int32), (k, n)),
    np.broadcast_to(np.ones((), bool), (k, n)),
  )


def initial_state(method: Method, config, params, k_alg: jax.Array, facts: RunFacts):
  """The method's state before round 1 (``experiments.run``'s, from the algorithm key)."""
  return method.init(k_alg, params, _shape_only_clients(method, config, facts), config, facts)


def _is_key(leaf) -> bool:
  return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def fresh_keys(own, draw):
  """``own`` with every key leaf replaced by ``draw()`` (a DP client's own secret keys)."""
  return jax.tree.map(lambda leaf: draw() if _is_key(leaf) else leaf, own)


def tree_to_arrays(tree) -> dict[str, np.ndarray]:
  """``{name: array}`` of a pytree's leaves (names: :meth:`fedlap_jax.method.Wire.of`'s; a key
  leaf as its ``uint32`` words)."""
  names = Wire.of(jax.tree.map(_shape_of, tree)).names()
  leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(tree)]
  return {n: np.asarray(x) for n, x in zip(names, leaves)}


def _shape_of(leaf):
  if _is_key(leaf):
    leaf = jax.random.key_data(leaf)
  a = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
  return jax.ShapeDtypeStruct(np.shape(a), a.dtype)


def arrays_to_tree(arrays: Mapping[str, Any], template):
  """Inverse of :func:`tree_to_arrays` against ``template`` (the receiver's own structure).

  Raises:
    fedlap_jax.checks.ConfigError: an array missing, unexpected, of another shape or dtype, or
      non-finite (:meth:`fedlap_jax.method.Wire.check`, naming it).
  """
  wire = Wire.of(jax.tree.map(_shape_of, template))
  wire.check(arrays)
  leaves = [
    jax.random.wrap_key_data(jnp.asarray(arrays[n])) if _is_key(t) else jnp.asarray(arrays[n])
    for n, t in zip(wire.names(), jax.tree.leaves(template))
  ]
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def update_arrays(update) -> dict[str, np.ndarray]:
  """A client update as the ``{name: array}`` mapping its :class:`~fedlap_jax.method.Wire`
  checks."""
  return tree_to_arrays(update)


@functools.lru_cache(maxsize=8)
def plan_fn(method: Method, num_clients: int, config):
  """``state -> RoundPlan`` of ``num_clients`` clients, jitted as the round computes it."""
  return jax.jit(lambda state: method.plan(state, num_clients, config))


@functools.lru_cache(maxsize=8)
def client_fn(method: Method, model: ModelFns, config):
  """``(own, message, data) -> update``: the method's client step, jitted."""

  def run(own, message, data):
    return method.client_step(own, model, message, (), data, config).update

  return jax.jit(run)


@functools.lru_cache(maxsize=8)
def server_fn(method: Method, model: ModelFns, config, take_part: tuple[int, int]):
  """``(key, state, message, updates, num_records) -> (state, metrics)``: the server step,
  jitted (``key``: the plan's ``server_key``)."""

  def run(key, state, message, updates, num_records):
    results = ClientResult(updates, (), ())
    return method.server_step(
      key, model, state, message, results, config, RoundFacts(num_records, take_part)
    )

  return jax.jit(run)
