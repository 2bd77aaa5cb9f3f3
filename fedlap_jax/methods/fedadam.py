"""FedAdam: FedAvg's clients, Adam on the server (FedOpt; Reddi et al., "Adaptive Federated
Optimization", ICLR 2021, Algorithm 2).

Each round the clients run FedAvg's local training (:func:`fedlap_jax.methods.fedavg.client_step`)
from the global model ``x`` and send ``y_k``; the server treats minus the weighted mean client
delta, ``g = -sum_k w_k (y_k - x)`` (``w_k`` normalised, ``server.weighting`` as FedAvg's), as
a gradient and takes one step of ``optax.adam(eta, b1, b2, eps)``: FedAvg's server step
(:func:`fedlap_jax.methods.fedavg.server_step`, the stateful
:func:`fedlap_jax.baselines.server_step_with_state`) with the direction
``optax.scale_by_adam(b1, b2, eps)`` at the rate ``eta``. The Adam state (step count,
first and second moments) is the state's ``opt_state``, carried across rounds (and
checkpointed with the state).

Defaults: ``b1 = 0.9``, ``b2 = 0.99``, ``eps = tau = 1e-3`` (the paper's FedAdam settings) and
``eta = 0.01``. One deviation from the paper's pseudo-code, as FedJAX's and Flower's FedAdam:
optax's Adam corrects the moments' bias (``m / (1 - b1^t)``, ``v / (1 - b2^t)``), which
Reddi et al.'s Algorithm 2 omits. No DP variant.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import optax

from fedlap_jax import baselines, optim
from fedlap_jax.baselines import BaselineConfig
from fedlap_jax.checks import ConfigError, is_real, require
from fedlap_jax.method import Method, ModelFns, RoundFacts, RoundPlan, RunFacts
from fedlap_jax.methods import fedavg
from fedlap_jax.types import PyTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamServer:
  """The server's Adam (hashable: a jit static).

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

  def spec(self) -> optim.Optimizer:
    """The direction as a config value: ``Optimizer(name='adam', b1, b2, eps)``."""
    return optim.Optimizer(name="adam", b1=self.b1, b2=self.b2, eps=self.eps)

  def direction(self) -> optax.GradientTransformation:
    """``optax.scale_by_adam(b1, b2, eps)``: Adam before the rate (:meth:`spec`'s direction,
    one object for equal settings)."""
    return self.spec().direction()

  def optimizer(self) -> optax.GradientTransformation:
    """``optax.adam(eta, b1, b2, eps)`` operation for operation: :meth:`direction` at ``eta``
    (:func:`fedlap_jax.optim.with_rate`)."""
    return optim.with_rate(self.direction(), self.learning_rate)


@dataclasses.dataclass(frozen=True)
class FedAdamConfig:
  """FedAdam (hashable: a jit static): FedAvg's clients and the server's Adam.

  Attributes:
    clients: the :class:`~fedlap_jax.baselines.BaselineConfig` of method ``fedavg`` (rounds,
      the clients' schedule and local training, the server's weighting).
    server: :class:`AdamServer`.
  """

  clients: BaselineConfig
  server: AdamServer = AdamServer()

  def __post_init__(self):
    c = self.clients
    require(
      isinstance(c, BaselineConfig) and c.method == "fedavg",
      "clients",
      c,
      "a BaselineConfig of method 'fedavg'",
    )
    require(isinstance(self.server, AdamServer), "server", self.server, "an AdamServer")
    # The server's optimiser and rate are ``server``'s: the clients' config must not name others.
    require(
      c.server_optimizer == optim.SGD,
      "clients.server_optimizer",
      c.server_optimizer,
      "plain SGD, the default (FedAdam's server optimiser is its server: AdamServer)",
    )
    require(
      c.server_lr == 1.0,
      "clients.server_lr",
      c.server_lr,
      "1.0, the default (FedAdam's server rate is server.learning_rate)",
    )

  def dp_accesses(self) -> None:
    """FedAdam has no DP variant."""
    return None


class FedAdamState(NamedTuple):
  """Server state: the global model, rounds done, the chain key and Adam's state."""

  params: PyTree
  round: jax.Array
  key: jax.Array
  opt_state: optax.OptState


def _init(key, params, clients, config: FedAdamConfig, facts: RunFacts) -> FedAdamState:
  base = fedavg.init(key, params, clients, config.clients, facts)
  return FedAdamState(base.params, base.round, base.key, config.server.optimizer().init(params))


def _plan(state, num_clients: int, config: FedAdamConfig) -> RoundPlan:
  key, client_keys = baselines.round_keys(state.key, num_clients)
  lr = baselines.learning_rate(state.round + 1, config.clients)
  return RoundPlan(key, None, fedavg.Message(state.params, lr), client_keys)


def _client_step(own, model: ModelFns, message, carried, data, config, *, client_axis=None):
  return fedavg.client_step(
    own, model, message, carried, data, config.clients, client_axis=client_axis
  )


def _server_step(key, model: ModelFns, state, message, results, config, facts: RoundFacts):
  # FedAvg's server with Adam's direction at eta: the step on minus the weighted mean delta.
  clients = dataclasses.replace(config.clients, server_lr=config.server.learning_rate)
  return fedavg.server_step(
    key, model, state, message, results, clients, facts, optimizer=config.server.direction()
  )


def _extend(base: BaselineConfig, server: Mapping[str, Any] | AdamServer) -> FedAdamConfig:
  if not isinstance(server, AdamServer):
    server = AdamServer(**server)
  try:
    return FedAdamConfig(base, server)
  except ConfigError as e:  # named as a field of the base config, which the caller built
    if not e.field.startswith("clients."):
      raise
    field = e.field.removeprefix("clients.")
    raise ConfigError(field, e.value, e.allowed) from None


METHOD = Method(
  name="fedadam",
  label=lambda dp: "FedAdam",
  config_type=FedAdamConfig,
  init=_init,
  plan=_plan,
  client_step=_client_step,
  server_step=_server_step,
  upload_floats=lambda config, facts: facts.num_params,
  wire=fedavg.model_wire,
  batch_size=lambda config: config.clients.local.batch_size,
  privacy_note="FedAdam has no DP variant",
  extends="fedavg",
  extend=_extend,
  own_section=AdamServer,
)
METHODS = (METHOD,)
