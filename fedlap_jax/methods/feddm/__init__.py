"""FedDM (Xiong et al., 2023) as a :class:`~fedlap_jax.method.Method`.

Keys: ``next, k_init, k_clients, k_server = split(state.key, 4)``; client ``k`` of ``K``
matches with ``split(k_clients, K)[k]``. Every round each client's synthetic set starts afresh: under
``synthetic_init='real'`` from its own real images (``split(k_init, K)[k]``, drawn in its
step), under ``'noise'`` from ``N(0, 1)`` images the server draws with ``k_init`` (sent to
each client as its own input); then
:func:`fedlap_jax.methods.feddm.distribution_matching.distribution_match`. The server
trains on the union (:func:`fedlap_jax.methods.fedlap.server.global_update`, ``r_g = inf``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax.checks import ConfigError
from fedlap_jax.dispatch import client_weights
from fedlap_jax.methods.feddm.distribution_matching import FedDMConfig, FedDMRoundMetrics
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
from fedlap_jax.methods.fedlap.server import global_update
from fedlap_jax.synthetic import noise_images, real_images, synthetic_slot


class Message(NamedTuple):
  """What FedDM's server sends every client: the global model."""

  params: Any


def _init(key, params, clients, config: FedDMConfig, facts: RunFacts):
  del facts
  return feddm.init_feddm_state(key, params, clients, config)


def _client_init(key, params, data, config: FedDMConfig, facts: RunFacts, *, index: int):
  """One client's slot of :func:`_init`'s synthetic set (its labels and mask, the N(0, 1)
  images), from its own records (:func:`fedlap_jax.synthetic.synthetic_slot`)."""
  del params
  syn = synthetic_slot(
    key,
    data,
    config.ipc,
    config.synthetic_init,
    index=index,
    num_clients=facts.num_clients,
    max_classes=facts.max_classes_per_client,
  )
  return (syn,)


def _plan(state, num_clients: int, config: FedDMConfig) -> RoundPlan:
  key, k_init, k_clients, k_server = jax.random.split(state.key, 4)
  syn = state.synthetic
  if config.synthetic_init == "real":
    start = jax.random.split(k_init, num_clients)
  else:
    start = noise_images(k_init, syn.mask, syn.x.shape[2:])
  own = (jax.random.split(k_clients, num_clients), start)
  return RoundPlan(key, k_server, Message(state.params), own)


def _client_step(own, model: ModelFns, message, carried, data, config, *, client_axis=None):
  del client_axis
  if model.embed_fn is None:
    raise ConfigError("model.embed_fn", None, "embed(params, x) -> (features, logits) (FedDM)")
  key, start = own
  (syn,) = carried
  if config.synthetic_init == "real":
    start = real_images(start, data, syn.y, syn.mask, config.ipc)
  else:  # the plan's noise, masked by this client's own slots (a no-op on masked noise)
    start = start * syn.mask.reshape(-1, *([1] * (start.ndim - 1)))
  synthetic, metrics = feddm.distribution_match(
    key, model.embed_fn, message.params, syn._replace(x=start), data, config
  )
  return ClientResult(synthetic, (synthetic,), metrics)


def _server_step(key, model: ModelFns, state, message, results, config, facts: RoundFacts):
  new, m = global_update(
    key,
    model.apply_fn,
    message.params,
    results.update,
    client_weights(config.server.weighting, facts.num_records),
    jnp.inf,
    learning_rate=config.learning_rate,
    config=config.server,
  )
  metrics = FedDMRoundMetrics(results.metrics, m.epochs, m.steps, m.distance)
  return state._replace(params=new), metrics


METHOD = Method(
  name="feddm",
  label=lambda dp: "FedDM",
  config_type=FedDMConfig,
  init=_init,
  plan=_plan,
  client_step=_client_step,
  server_step=_server_step,
  upload_floats=lambda config, facts: synthetic_upload(config.ipc, facts),
  wire=lambda config, params, facts: synthetic_wire(config.ipc, facts),
  batch_size=lambda config: config.batch_size,
  carried=("synthetic",),
  client_init=_client_init,
  privacy_note="FedDM's DP variant protects class-wise statistics, a privacy notion not "
  "comparable with record-level DP; it is not implemented",
)
METHODS = (METHOD,)
