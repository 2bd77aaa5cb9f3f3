"""FedLAP and FedLAP-DP as a :class:`~fedlap_jax.method.Method` (Algorithms 1-3).

The steps are :func:`fedlap_jax.methods.fedlap.client.client_step` and
:func:`fedlap_jax.methods.fedlap.server.server_step_with_state`,
with the round's keys of :func:`fedlap_jax.methods.fedlap.state.round_keys` (``next, k_init,
k_clients, k_server = split(key, 4)``; client ``k`` of ``K``: ``split(k_clients, K)[k]``, under
``synthetic_init='real'`` also ``split(k_init, K)[k]``, and the shared DSA family key
``shared_family_key(k_clients)``) and the rates of
:func:`fedlap_jax.methods.fedlap.state.round_learning_rates`. Each client carries its synthetic set.
:data:`METHOD` has the default optimisers; :func:`method` builds FedLAP with others.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from fedlap_jax import update_bounds
from fedlap_jax.methods.fedlap import client
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.methods.fedlap import server
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.config import FedLAPConfig
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RoundPlan, RunFacts, Wire
from fedlap_jax.method import json_floats
from fedlap_jax.synthetic import synthetic_slot


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
  """The floats one reply of :func:`_wire` carries (:meth:`~fedlap_jax.method.Wire.floats`:
  the synthetic images, ``r_k`` and, with ``noisy_real`` model steps, the model delta; the
  labels and mask are fixed and sent once). The model's ``facts.num_params`` floats stand in
  for its parameters."""
  model = jax.ShapeDtypeStruct((facts.num_params,), np.float32)
  return _wire(config, model, facts).floats()


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


def _client_init(key, params, data, config: FedLAPConfig, facts: RunFacts, *, index: int):
  """One client's slot of ``init``'s synthetic set (its labels and mask, the N(0, 1) images of
  the whole federation's draw), from its own records and the run's public facts
  (:func:`fedlap_jax.synthetic.synthetic_slot`).

  Raises:
    ConfigError: ``client.batch_size`` above this client's records (``init``'s check of the
      smallest client), or what :func:`~fedlap_jax.synthetic.synthetic_slot` refuses.
  """
  del params
  size = int(np.sum(np.asarray(data.mask)))
  if config.client.batch_size > size:
    raise ConfigError(
      "batch_size",
      config.client.batch_size,
      f"batch_size <= this client's {size} records (the Poisson rate q = batch_size / N_k "
      "must be <= 1)",
    )
  syn = synthetic_slot(
    key,
    data,
    config.client.ipc,
    config.synthetic_init,
    index=index,
    num_clients=facts.num_clients,
    max_classes=facts.max_classes_per_client,
  )
  return (syn,)


def _check_update(config: FedLAPConfig, facts: RunFacts):
  """What an honest client's update keeps in the round of ``message``
  (:mod:`fedlap_jax.update_bounds`): ``r_k`` in ``[radius_floor(eta_m), r]`` and, under DP with
  ``client.model_steps='noisy_real'``, ``||model_delta||`` at most
  :func:`~fedlap_jax.update_bounds.matching_delta_bound` at ``eta_m``."""
  max_radius = float(np.float32(config.client.radius))  # r_k is computed in float32

  def check(message: Message, update: client.ClientUpdate) -> None:
    eta = float(np.float32(message.rates.client))
    update_bounds.check_radius(float(update.radius), max_radius, update_bounds.radius_floor(eta))
    bound = update_bounds.matching_delta_bound(config.client, eta, facts.num_params)
    if bound is not None and update.model_delta is not None:
      update_bounds.check_delta_norm(jax.tree.leaves(update.model_delta), bound)

  return check


def matching_losses(metrics: client.LocalApproxMetrics) -> tuple[np.ndarray, np.ndarray]:
  """Per client (leading ``(K,)`` axis): the mean matching loss over the rows written (the
  first ``outer_iterations`` while-loop iterations of each trajectory, every target and image
  update of them) and the last one written (of the last trajectory's last iteration run);
  NaN for a client that ran none."""
  loss = np.asarray(metrics.matching_loss, np.float64)  # (K, R_i, O, targets, R_b)
  runs = np.asarray(metrics.outer_iterations)  # (K, R_i)
  k = loss.shape[0]
  written = np.arange(loss.shape[2]) < runs[..., None]  # (K, R_i, O)
  written = np.broadcast_to(written[..., None, None], loss.shape).reshape(k, -1)
  count = written.sum(axis=1)
  total = np.where(written, loss.reshape(k, -1), 0.0).sum(axis=1)
  mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
  o = runs[:, -1] - 1
  last = np.where(o >= 0, loss[np.arange(k), -1, np.maximum(o, 0), -1, -1], np.nan)
  return mean, last


def round_record(metrics: federated.RoundMetrics) -> dict:
  """The round's public numbers (``None`` for a value that is not finite). With the clients'
  diagnostics (``metrics.client`` a stacked :class:`~fedlap_jax.methods.fedlap.client.LocalApproxMetrics`;
  a front end that only sees the updates has ``()``): each client's mean and last matching
  loss over the rows written (:func:`matching_losses`); then the clients' ``r_k`` (in the
  order of their updates), ``r_g`` (``None`` for ``fixed``), the server's epochs, steps and
  distance moved, the clients' rate ``eta_m``; and with the diagnostics their while-loop
  iterations (mean over trajectories), real accesses, clip fraction, mean batch size and
  extra Poisson chunks (the last three :attr:`~fedlap_jax.methods.fedlap.client.LocalApproxMetrics.NONPRIVATE`
  under DP)."""
  cm = metrics.client
  has_client = isinstance(cm, client.LocalApproxMetrics)
  out: dict[str, Any] = {}
  if has_client:
    mean, last = matching_losses(cm)
    out["matching_loss"] = json_floats(mean)
    out["matching_loss_last"] = json_floats(last)
  r_g = float(metrics.server.radius)
  out |= {
    "client_radius": json_floats(metrics.client_radius),
    "server_radius": r_g if math.isfinite(r_g) else None,
    "server_epochs": int(metrics.server.epochs),
    "server_steps": int(metrics.server.steps),
    "server_distance": float(metrics.server.distance),
    "learning_rate": float(metrics.learning_rate),
  }
  if has_client:
    out["outer_iterations"] = np.asarray(cm.outer_iterations).mean(axis=1).tolist()
    out["real_accesses"] = np.asarray(cm.real_accesses).tolist()
    out["clip_fraction"] = json_floats(cm.clip_fraction)
    out["mean_batch_size"] = json_floats(cm.mean_batch_size)
    out["poisson_extra_chunks"] = np.asarray(cm.poisson_extra_chunks).tolist()
  return out


def method(
  *,
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
) -> Method:
  """FedLAP with these optimisers (``None`` is the
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
    client_init=_client_init,
    # Under 'real' each round draws its images afresh; only the fixed labels carry over.
    reads_carried=lambda config: config.synthetic_init == "noise",
    side_by_side=True,
    privacy="optional",
    algorithm_name=lambda config: "fedlap_dp" if config.client.dp is not None else "fedlap",
    check_update=_check_update,
    round_record=round_record,
  )


METHOD = method()
METHODS = (METHOD,)
