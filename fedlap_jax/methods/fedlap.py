"""FedLAP and FedLAP-DP as a :class:`~fedlap_jax.method.Method` (Algorithms 1-3).

The steps are :func:`fedlap_jax.client.client_step` and :func:`fedlap_jax.server.server_step`,
with the round's keys of :func:`fedlap_jax.federated.round_keys` (``next, k_init, k_clients,
k_server = split(key, 4)``; client ``k`` of ``K``: ``split(k_clients, K)[k]``, under
``synthetic_init='real'`` also ``split(k_init, K)[k]``, and the shared DSA family key
``shared_family_key(k_clients)``) and the rates of
:func:`fedlap_jax.federated.round_learning_rates`. Each client carries its synthetic set.
:data:`METHOD` has the default optimisers; :func:`method` builds FedLAP with others.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from fedlap_jax import client, federated, server
from fedlap_jax.config import FedLAPConfig
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RoundPlan, RunFacts, Wire


class Message(NamedTuple):
  """What the FedLAP server sends every client of round ``m``."""

  params: Any
  rates: federated.RoundRates
  family_key: jax.Array


def _plan(state, num_clients: int, config: FedLAPConfig) -> RoundPlan:
  keys = federated.round_keys(state.key)
  rates = federated.round_learning_rates(state.round + 1, config)
  init_keys = jax.random.split(keys.init, num_clients) if config.synthetic_init == "real" else None
  own = (jax.random.split(keys.clients, num_clients), init_keys)
  message = Message(state.params, rates, client.shared_family_key(keys.clients))
  return RoundPlan(keys.next, keys.server, message, own)


def _metrics(results, message: Message, server_metrics) -> federated.RoundMetrics:
  return federated.RoundMetrics(
    results.metrics, results.update.radius, server_metrics, message.rates.client
  )


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


def method(
  *,
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
) -> Method:
  """FedLAP with these optimisers (:func:`fedlap_jax.federated.algorithm`'s: ``None`` is the
  config's, ``client.model_optimizer``, ``client.image_optimizer`` and ``server.optimizer``,
  each the role's default of :mod:`fedlap_jax.optim` unless set). The config's
  ``server.carry_state`` says whether the server's optimiser starts from ``state.opt_state``
  and carries its state across rounds (otherwise it restarts each round). Each call is a new
  method (a jit static by identity): build one and reuse it."""

  def init(key, params, clients, config: FedLAPConfig, facts: RunFacts):
    del facts
    return federated.init_state(key, params, clients, config, server_optimizer=server_optimizer)

  def client_step(
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
      image_optimizer=image_optimizer,
      model_optimizer=model_optimizer,
    )
    return ClientResult(update, (update.synthetic,), metrics)

  def server_step(
    key, model: ModelFns, state, message: Message, results, config, facts: RoundFacts
  ):
    # Without server.carry_state the optimiser starts afresh (Algorithm 2); () stays ().
    carry = config.server.carry_state
    opt_state = state.opt_state if carry else None
    params, opt_state, server_metrics = server.server_step_with_state(
      key,
      model.apply_fn,
      state.params,
      results.update,
      config,
      opt_state,
      learning_rate=message.rates.server,
      num_records=facts.num_records,
      optimizer=server_optimizer,
    )
    if not carry:
      opt_state = state.opt_state
    return state._replace(params=params, opt_state=opt_state), _metrics(
      results, message, server_metrics
    )

  return Method(
    name="fedlap",
    label=lambda dp: "FedLAP-DP" if dp else "FedLAP",
    config_type=FedLAPConfig,
    init=init,
    plan=_plan,
    client_step=client_step,
    server_step=server_step,
    upload_floats=_upload,
    wire=_wire,
    batch_size=lambda config: config.client.batch_size,
    carried=("synthetic",),
    side_by_side=True,
    privacy="optional",
    algorithm_name=lambda config: "fedlap_dp" if config.client.dp is not None else "fedlap",
  )


METHOD = method()
METHODS = (METHOD,)
