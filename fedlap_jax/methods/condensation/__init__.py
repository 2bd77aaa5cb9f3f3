"""The one-shot condensation methods as :class:`~fedlap_jax.method.Method` s: DSC federated,
DSC centralized and PSG.

Keys: ``next, k_init, k_clients, k_server = split(state.key, 4)``; client ``k`` of ``K``
condenses with ``split(k_clients, K)[k]``; under ``synthetic_init='real'`` a client's start set is drawn from its own
records with ``split(k_init, K)[k]`` in its step. Every client condenses once
(:func:`fedlap_jax.methods.condensation.one_shot.condense`); the server trains on the union
(:func:`fedlap_jax.methods.condensation.one_shot.train_on_union`). DSC centralized pools every
client's records into one (:func:`fedlap_jax.methods.condensation.one_shot.pool_clients`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.condensation.one_shot import OneShotConfig, OneShotMetrics
from fedlap_jax.methods.condensation.one_shot import (
  DP_ONE_SHOT_METHODS,
  ONE_SHOT_FACTS,
  ONE_SHOT_METHODS,
)
from fedlap_jax.dispatch import client_weights
from fedlap_jax.method import (
  ClientResult,
  Method,
  ModelFns,
  RoundFacts,
  RoundPlan,
  RunFacts,
  synthetic_upload,
  synthetic_wire,
)
from fedlap_jax.synthetic import real_images, synthetic_slot


def _init(key, params, clients, config: OneShotConfig, facts: RunFacts):
  del facts
  return condensation.init_oneshot_state(key, params, clients, config)


def _client_init(key, params, data, config: OneShotConfig, facts: RunFacts, *, index: int):
  """One client's slot of :func:`_init`'s synthetic set (federated: the clients not pooled),
  from its own records (:func:`fedlap_jax.synthetic.synthetic_slot`)."""
  del params
  c = config.condensation
  syn = synthetic_slot(
    key,
    data,
    c.ipc,
    c.synthetic_init,
    index=index,
    num_clients=facts.num_clients,
    max_classes=facts.max_classes_per_client,
  )
  return (syn,)


def _prepare(clients, config: OneShotConfig):
  return condensation.pool_clients(clients) if config.centralized else clients


def _plan(state, num_clients: int, config: OneShotConfig) -> RoundPlan:
  key, k_init, k_clients, k_server = jax.random.split(state.key, 4)
  real = config.condensation.synthetic_init == "real"
  init_keys = jax.random.split(k_init, num_clients) if real else None
  return RoundPlan(key, k_server, (), (jax.random.split(k_clients, num_clients), init_keys))


def _client_step(own, model: ModelFns, message, carried, data, config, *, client_axis=None):
  del message, client_axis
  key, init_key = own
  (syn,) = carried
  c = config.condensation
  if model.init_fn is None:
    raise ConfigError("model.init_fn", None, "init(key) -> params of a fresh network (DSC, PSG)")
  if init_key is not None:
    syn = syn._replace(x=real_images(init_key, data, syn.y, syn.mask, c.ipc))
  synthetic, metrics = condensation.condense(key, model.apply_fn, model.init_fn, syn, data, c)
  return ClientResult(synthetic, (synthetic,), metrics)


def _server_step(key, model: ModelFns, state, message, results, config, facts: RoundFacts):
  del message
  params, m = condensation.train_on_union(
    key,
    model.apply_fn,
    state.params,
    results.update,
    client_weights(config.server.weighting, facts.num_records),
    config,
  )
  metrics = OneShotMetrics(
    results.metrics, m.epochs, m.steps, m.distance, jnp.float32(config.learning_rate)
  )
  return state._replace(params=params), metrics


def _upload(config: OneShotConfig, facts: RunFacts) -> int:
  """The synthetic set once; DSC centralized: the raw records pooled."""
  if config.centralized:
    if facts.max_client_size is None:
      raise ConfigError("max_client_size", None, "the largest client's records (DSC centralized)")
    return int(facts.max_client_size * np.prod(facts.image_shape))
  return synthetic_upload(config.condensation.ipc, facts)


LABELS = {"dsc": "DSC federated", "dsc_centralized": "DSC centralized", "psg": "PSG"}
"""Display names of the one-shot methods."""


def family(name: str) -> Method:
  """The one-shot method ``name`` (one of
  :data:`fedlap_jax.methods.condensation.one_shot.ONE_SHOT_METHODS`; its
  :data:`fedlap_jax.methods.condensation.one_shot.ONE_SHOT_FACTS` entry says what it is)."""
  private, centralized = ONE_SHOT_FACTS[name]
  return Method(
    name=name,
    label=lambda dp: LABELS[name],
    config_type=OneShotConfig,
    init=_init,
    plan=_plan,
    client_step=_client_step,
    server_step=_server_step,
    upload_floats=_upload,
    wire=lambda config, params, facts: synthetic_wire(config.condensation.ipc, facts),
    batch_size=lambda config: config.condensation.batch_size,
    carried=("synthetic",),
    client_init=None if centralized else _client_init,
    # dsc_centralized holds one pooled set: a round pools whichever clients it is given.
    per_client_fields=lambda config: () if config.centralized else ("synthetic",),
    prepare_clients=_prepare,
    privacy="required" if private else "never",
    privacy_note=f"PSG is the DP one-shot method: {DP_ONE_SHOT_METHODS}",
    dp_twin=None if private else ("psg", "PSG is the DP one-shot method"),
    federated=not centralized,
    algorithm_name=lambda config: config.method,
  )


METHODS = tuple(family(name) for name in ONE_SHOT_METHODS)
