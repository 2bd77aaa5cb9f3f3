"""FedLAP and FedLAP-DP as a :class:`~fedlap_jax.method.Method` (Algorithms 1-3).

The steps are :func:`fedlap_jax.client.client_step` and :func:`fedlap_jax.server.server_step`,
with the round's keys of :func:`fedlap_jax.federated.round_keys` (``next, k_init, k_clients,
k_server = split(key, 4)``; client ``k`` of ``K``: ``split(k_clients, K)[k]``, under
``synthetic_init='real'`` also ``split(k_init, K)[k]``, and the shared DSA family key
``shared_family_key(k_clients)``) and the rates of
:func:`fedlap_jax.federated.round_learning_rates`. Each client carries its synthetic set.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from fedlap_jax import client, federated, server
from fedlap_jax.config import FedLAPConfig
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RoundPlan, RunFacts, Wire


class Message(NamedTuple):
  """What the FedLAP server sends every client of round ``m``."""

  params: Any
  rates: federated.RoundRates
  family_key: jax.Array


def _init(key, params, clients, config: FedLAPConfig, facts: RunFacts):
  del facts
  return federated.init_state(key, params, clients, config)


def _plan(state, num_clients: int, config: FedLAPConfig) -> RoundPlan:
  keys = federated.round_keys(state.key)
  rates = federated.round_learning_rates(state.round + 1, config)
  init_keys = jax.random.split(keys.init, num_clients) if config.synthetic_init == "real" else None
  own = (jax.random.split(keys.clients, num_clients), init_keys)
  message = Message(state.params, rates, client.shared_family_key(keys.clients))
  return RoundPlan(keys.next, keys.server, message, own)


def _client_step(
  own, model: ModelFns, message: Message, carried, data, config, *, client_axis=None
):
  key, init_key = own
  (synthetic,) = carried
  update, metrics = client.client_step(
    key,
    model.apply_fn,
    message.params,
    synthetic,
    data,
    config,
    learning_rate=message.rates.client,
    family_key=message.family_key,
    init_key=init_key,
    client_axis=client_axis,
  )
  return ClientResult(update, (update.synthetic,), metrics)


def _server_step(key, model: ModelFns, state, message: Message, results, config, facts: RoundFacts):
  params, server_metrics = server.server_step(
    key,
    model.apply_fn,
    state.params,
    results.update,
    config,
    learning_rate=message.rates.server,
    num_records=facts.num_records,
  )
  metrics = federated.RoundMetrics(
    results.metrics, results.update.radius, server_metrics, message.rates.client
  )
  return state._replace(params=params), metrics


def _slots(config: FedLAPConfig, facts: RunFacts) -> int:
  return int(config.client.ipc * facts.max_classes_per_client)


def _upload(config: FedLAPConfig, facts: RunFacts) -> int:
  """The synthetic images (labels are fixed and sent once)."""
  return int(_slots(config, facts) * np.prod(facts.image_shape))


def _wire(config: FedLAPConfig, params, facts: RunFacts) -> Wire:
  s = _slots(config, facts)
  update = {
    "synthetic.x": jax.ShapeDtypeStruct((s, *facts.image_shape), np.float32),
    "synthetic.y": jax.ShapeDtypeStruct((s,), np.int32),
    "synthetic.mask": jax.ShapeDtypeStruct((s,), np.bool_),
    "radius": jax.ShapeDtypeStruct((), np.float32),
  }
  if config.client.model_steps == "noisy_real":  # its model delta travels too
    update["model_delta"] = params
  return Wire.of(update, pinned=("synthetic.y", "synthetic.mask"))


METHOD = Method(
  name="fedlap",
  label=lambda dp: "FedLAP-DP" if dp else "FedLAP",
  config_type=FedLAPConfig,
  init=_init,
  plan=_plan,
  client_step=_client_step,
  server_step=_server_step,
  upload_floats=_upload,
  wire=_wire,
  batch_size=lambda config: config.client.batch_size,
  carried=("synthetic",),
  side_by_side=True,
  privacy="optional",
  algorithm_name=lambda config: "fedlap_dp" if config.client.dp is not None else "fedlap",
)
METHODS = (METHOD,)
