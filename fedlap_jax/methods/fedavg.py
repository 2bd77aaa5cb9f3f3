"""The gradient-sharing baselines of :mod:`fedlap_jax.baselines` as
:class:`~fedlap_jax.method.Method` s; :func:`family` builds the method of one name, with the
default optimisers or others.

FedAdam (FedOpt; Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2) is
FedAvg with a server optimiser preset (:func:`adam_preset`): :data:`FEDADAM` is FedAvg's method
under the name ``fedadam``, its server one step of ``optax.adam(eta, b1, b2, eps)`` on minus the
weighted mean client delta (:class:`AdamServer`; the paper's ``b1 = 0.9``, ``b2 = 0.99``, ``eps =
tau = 1e-3``). As FedJAX's and Flower's FedAdam, optax's Adam corrects the moments' bias, which
Reddi et al.'s Algorithm 2 omits. FedYogi is ``fedavg`` with ``baseline.server_optimizer.name=
'yogi'``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import baselines, optim, update_bounds
from fedlap_jax.baselines import BaselineConfig, BaselineRoundMetrics
from fedlap_jax.checks import ConfigError, is_real, require
from fedlap_jax.baselines import BASELINE_FACTS
from fedlap_jax.method import ClientResult, Method, ModelFns, RoundFacts, RoundPlan, RunFacts, Wire
from fedlap_jax.models import count_params
from fedlap_jax.training import tree_distance


class Message(NamedTuple):
  """What a baseline's server sends: ``x``, the clients' ``eta_m`` and SCAFFOLD's ``c``."""

  params: Any
  learning_rate: jax.Array
  control: Any = None


class ScaffoldUpdate(NamedTuple):
  """What a SCAFFOLD client sends: its model ``y_k`` and ``delta c_k``."""

  params: Any
  control_delta: Any


LABELS = {
  "fedavg": "FedAvg",
  "fedprox": "FedProx",
  "fedsgd": "FedSGD",
  "scaffold": "SCAFFOLD",
  "dp_fedavg": "DP-FedAvg",
  "dp_fedprox": "DP-FedProx",
}
"""Display names of the family's methods (the name says whether it is DP)."""


def init(
  key,
  params,
  clients,
  config: BaselineConfig,
  facts: RunFacts,
  *,
  server_optimizer: optax.GradientTransformation | None = None,
):
  """The state before round 1 (:func:`fedlap_jax.baselines.init_baseline_state`; ``opt_state``:
  ``server_optimizer``'s fresh state), once the data agree with the run's facts.

  Raises:
    ConfigError: the model's parameter count, ``K`` or the image shape are not those of
      ``facts``; a client holds more records than ``local.max_client_size``; under DP, a
      client holds fewer than ``B`` (``q = B / N_k`` must be at most 1).
  """
  if count_params(params) != facts.num_params:
    raise ConfigError(
      "num_params",
      facts.num_params,
      "count_params(params)",
      message=f"num_params={facts.num_params} does not match the model's "
      f"{count_params(params)} parameters; allowed: count_params(params)",
    )
  if clients.mask.shape[0] != facts.num_clients:
    raise ConfigError(
      "num_clients",
      facts.num_clients,
      f"{clients.mask.shape[0]}, the data's stacked clients",
      message=f"num_clients={facts.num_clients} does not match the data's "
      f"{clients.mask.shape[0]} stacked clients",
    )
  if tuple(clients.x.shape[2:]) != tuple(facts.image_shape):
    raise ConfigError(
      "image_shape",
      tuple(facts.image_shape),
      f"{tuple(clients.x.shape[2:])}, the data's",
      message=f"image_shape={tuple(facts.image_shape)} does not match the data's "
      f"{tuple(clients.x.shape[2:])}",
    )
  local = config.local
  sizes = np.sum(np.asarray(clients.mask), axis=1)
  if local.max_client_size is not None and sizes.max() > local.max_client_size:
    raise ConfigError(
      "max_client_size",
      local.max_client_size,
      ">= every N_k",
      message=f"max_client_size={local.max_client_size} is smaller than the largest "
      f"client ({int(sizes.max())} records); allowed: >= every N_k",
    )
  if BASELINE_FACTS[config.method].private and sizes.min() < local.batch_size:
    raise ConfigError(
      "batch_size",
      local.batch_size,
      "under DP, B <= min_k N_k",
      message=f"batch_size={local.batch_size} exceeds the smallest client "
      f"({int(sizes.min())} records); allowed under DP: B <= min_k N_k "
      "(the sampling rate q = B / N_k must be <= 1)",
    )
  return baselines.init_baseline_state(
    key, params, clients, config, server_optimizer=server_optimizer
  )


def scaffold_client_init(key, params, data, config, facts: RunFacts, *, index: int):
  """A SCAFFOLD client's ``c_k`` before round 1: zeros like the model (:func:`init`'s slot)."""
  del key, data, config, facts, index
  return (jax.tree.map(jnp.zeros_like, params),)


def plan(state, num_clients: int, config: BaselineConfig) -> RoundPlan:
  key, client_keys = baselines.round_keys(state.key, num_clients)
  lr = baselines.learning_rate(state.round + 1, config)
  return RoundPlan(key, None, Message(state.params, lr, state.control), client_keys)


def client_step(
  own,
  model: ModelFns,
  message: Message,
  carried,
  data,
  config,
  *,
  client_axis=None,
  optimizer: optax.GradientTransformation | None = None,
):
  """FedAvg's client: ``y_k`` after local training (:func:`fedlap_jax.baselines.client_step`;
  ``optimizer``: its local direction, ``None`` SGD)."""
  del carried, client_axis
  y, metrics = baselines.client_step(
    own,
    model.apply_fn,
    message.params,
    data,
    config,
    learning_rate=message.learning_rate,
    optimizer=optimizer,
  )
  return ClientResult(y, (), metrics)


def scaffold_client_step(
  own,
  model: ModelFns,
  message: Message,
  carried,
  data,
  config,
  *,
  client_axis=None,
  optimizer: optax.GradientTransformation | None = None,
):
  """SCAFFOLD's client: local training corrected by ``c - c_k``, then its control update."""
  del client_axis
  (c_k,) = carried
  x, c, lr = message.params, message.control, message.learning_rate
  correction = jax.tree.map(jnp.subtract, c, c_k)
  y, metrics = baselines.client_step(
    own,
    model.apply_fn,
    x,
    data,
    config,
    learning_rate=lr,
    correction=correction,
    optimizer=optimizer,
  )
  # Option II: c_k+ = c_k - c + (x - y_k) / (T_k eta); delta c_k = c_k+ - c_k.
  scale = 1.0 / (jnp.maximum(metrics.steps, 1).astype(jnp.float32) * lr)
  delta_c = jax.tree.map(lambda yi, xi, ci: -ci - (yi - xi) * scale, y, x, c)
  return ClientResult(ScaffoldUpdate(y, delta_c), (jax.tree.map(jnp.add, c_k, delta_c),), metrics)


def mean_model(
  state, results, config, facts: RoundFacts, optimizer: optax.GradientTransformation | None
):
  """``(x', opt_state', w)``: the server's step on ``sum_k w_k (y_k - x)`` from
  ``state.opt_state`` (:func:`fedlap_jax.baselines.server_step_with_state`; ``optimizer=None``:
  ``x + eta_s sum_k w_k (y_k - x)``, the state unchanged)."""
  return baselines.server_step_with_state(
    state.params,
    results,
    config,
    state.opt_state,
    num_records=facts.num_records,
    optimizer=optimizer,
  )


def server_step(
  key,
  model: ModelFns,
  state,
  message: Message,
  results,
  config,
  facts: RoundFacts,
  *,
  optimizer: optax.GradientTransformation | None = None,
):
  del key, model
  params, opt_state, _ = mean_model(state, results.update, config, facts, optimizer)
  metrics = BaselineRoundMetrics(
    results.metrics, message.learning_rate, tree_distance(params, state.params), jnp.float32(0.0)
  )
  return state._replace(params=params, opt_state=opt_state), metrics


def scaffold_server_step(
  key,
  model: ModelFns,
  state,
  message: Message,
  results,
  config,
  facts: RoundFacts,
  *,
  optimizer: optax.GradientTransformation | None = None,
):
  del key, model
  params, opt_state, weights = mean_model(state, results.update.params, config, facts, optimizer)
  step = jax.tree.map(lambda a: jnp.tensordot(weights, a, axes=1), results.update.control_delta)
  m, k = facts.take_part
  if m != k:  # sampled clients (static: the all-clients program is unchanged)
    step = jax.tree.map(lambda d: (m / k) * d, step)
  control = jax.tree.map(jnp.add, state.control, step)
  control_norm = tree_distance(control, jax.tree.map(jnp.zeros_like, control))
  metrics = BaselineRoundMetrics(
    results.metrics, message.learning_rate, tree_distance(params, state.params), control_norm
  )
  return state._replace(params=params, control=control, opt_state=opt_state), metrics


def model_wire(config, params, facts: RunFacts) -> Wire:
  del config, facts
  return Wire.of(params)


def _scaffold_wire(config, params, facts: RunFacts) -> Wire:
  del config, facts
  return Wire.of(ScaffoldUpdate(params, params))


def update_bound(config: BaselineConfig, facts: RunFacts):
  """``message -> bound``: the largest ``||y_k - x||`` an honest client of the private path
  sends in the round of ``message``, for the family's own client at the message's ``eta_m``
  over ``T = local.scheduled_steps()`` steps with ``config.client_optimizer``:

  * SGD (heavy-ball or Nesterov momentum, weight decay):
    :func:`fedlap_jax.update_bounds.local_sgd_update_bound` with FedProx's ``mu``, the clip
    ``C``, ``sigma`` and ``B`` of ``config.local`` and the largest batch
    ``local.max_client_size`` (false-refusal probability
    :data:`~fedlap_jax.update_bounds.FALSE_REFUSAL` per reply);
  * Adam, Yogi, Adagrad: :func:`fedlap_jax.update_bounds.normalised_update_bound` (their steps
    are bounded per coordinate whatever the gradients).

  ``None`` without clipping (the non-DP methods: an honest SGD client's step has no bound) or
  where the optimiser's hyper-parameters bound no step (``b2 = 0`` with memory)."""
  loc = config.local
  if loc.l2_clip_norm is None:  # not the private path
    return None
  spec = config.client_optimizer
  if spec.name != "sgd":
    steps = update_bounds.normalised_step_bounds(
      spec.name,
      loc.scheduled_steps(),
      b1=spec.b1 or 0.0,
      b2=spec.b2 or 0.0,
      initial_accumulator=spec.initial_accumulator or 0.0,
    )
    if steps is None:
      return None

    def normalised(message: Message) -> float:
      return update_bounds.normalised_update_bound(
        steps,
        learning_rate=float(message.learning_rate),
        num_params=facts.num_params,
        params_norm=update_bounds.tree_norm(message.params),
      )

    return normalised
  clip = float(loc.l2_clip_norm)

  def bound(message: Message) -> float:
    return update_bounds.local_sgd_update_bound(
      learning_rate=float(message.learning_rate),
      steps=loc.scheduled_steps(),
      batch_size=loc.batch_size,
      l2_clip_norm=clip,
      noise_multiplier=float(loc.noise_multiplier),
      num_params=facts.num_params,
      prox_mu=loc.prox_mu,
      momentum=float(spec.momentum),
      weight_decay=float(spec.weight_decay),
      nesterov=bool(spec.nesterov),
      params_norm=update_bounds.tree_norm(message.params),
      max_batch=loc.max_client_size,
    )

  return bound


def family(
  name: str,
  *,
  client_optimizer: optax.GradientTransformation | None = None,
  server_optimizer: optax.GradientTransformation | None = None,
) -> Method:
  """The baseline ``name`` (one of :data:`fedlap_jax.baselines.METHODS`) with these
  directions (``None``: SGD written out; the server's state is ``state.opt_state``, carried
  across rounds). Each call is a new method
  (a jit static by identity): build one and reuse it."""
  facts = BASELINE_FACTS[name]  # what the name implies
  scaffold, private = facts.control_variates, facts.private
  client = scaffold_client_step if scaffold else client_step
  server = scaffold_server_step if scaffold else server_step

  def init_(key, params, clients, config, facts):
    return init(key, params, clients, config, facts, server_optimizer=server_optimizer)

  def client_(own, model, message, carried, data, config, *, client_axis=None):
    return client(
      own,
      model,
      message,
      carried,
      data,
      config,
      client_axis=client_axis,
      optimizer=client_optimizer,
    )

  def server_(key, model, state, message, results, config, facts):
    return server(key, model, state, message, results, config, facts, optimizer=server_optimizer)

  return Method(
    name=name,
    label=lambda dp: LABELS[name],
    config_type=BaselineConfig,
    init=init_,
    plan=plan,
    client_step=client_,
    server_step=server_,
    upload_floats=lambda config, facts: (2 if scaffold else 1) * facts.num_params,
    wire=_scaffold_wire if scaffold else model_wire,
    batch_size=lambda config: config.local.batch_size,
    carried=("client_controls",) if scaffold else (),
    client_init=scaffold_client_init if scaffold else None,
    privacy="required" if private else "never",
    privacy_note=""
    if private
    else f"use method='dp_{name}' where a DP variant exists: {baselines.DP_METHODS}",
    dp_twin=(f"dp_{name}", "its DP variant") if f"dp_{name}" in BASELINE_FACTS else None,
    # Derived for the family's own client (plain SGD); another direction is not bounded here.
    update_bound=update_bound if client_optimizer is None and not scaffold else None,
  )


METHODS = tuple(family(name) for name in baselines.METHODS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamServer:
  """FedAdam's server (its experiment section ``fedadam``).

  Attributes:
    learning_rate: ``eta``, the server's step size (the same every round).
    b1, b2: the moments' decay rates, in ``[0, 1)``.
    eps: ``tau``, added to ``sqrt(v)`` (the adaptivity's floor).
  """

  learning_rate: float = 0.01
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-3

  def __post_init__(self):
    for f in ("learning_rate", "eps"):
      v = getattr(self, f)
      require(is_real(v) and v > 0, f, v, "a finite number > 0")
    for f in ("b1", "b2"):
      v = getattr(self, f)
      require(is_real(v) and 0 <= v < 1, f, v, "a number in [0, 1)")


def adam_preset(base: BaselineConfig, server: Mapping[str, Any] | AdamServer) -> BaselineConfig:
  """FedAdam's config: FedAvg's ``base`` with ``server`` (an :class:`AdamServer` or its fields)
  as its server optimiser and rate. ``base`` keeps FedAvg's server defaults (plain SGD, rate
  1.0): FedAdam's server is ``server``, a choice there is refused, not overridden."""
  if not isinstance(server, AdamServer):
    server = AdamServer(**server)
  require(base.method == "fedavg", "method", base.method, "'fedavg' (FedAdam's clients)")
  require(
    base.server_optimizer == optim.SGD,
    "server_optimizer",
    base.server_optimizer,
    "plain SGD, the default (FedAdam's server optimiser is its server: AdamServer)",
  )
  require(
    base.server_lr == 1.0,
    "server_lr",
    base.server_lr,
    "1.0, the default (FedAdam's server rate is server.learning_rate)",
  )
  adam = optim.Optimizer(name="adam", b1=server.b1, b2=server.b2, eps=server.eps)
  return dataclasses.replace(base, server_optimizer=adam, server_lr=server.learning_rate)


FEDADAM = dataclasses.replace(
  METHODS[baselines.METHODS.index("fedavg")],
  name="fedadam",
  label=lambda dp: "FedAdam",
  privacy_note="FedAdam has no DP variant",
  dp_twin=None,
  extends="fedavg",
  extend=adam_preset,
  own_section=AdamServer,
)
