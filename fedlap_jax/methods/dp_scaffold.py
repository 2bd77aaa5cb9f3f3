"""DP-SCAFFOLD (Noble, Bellet and Dieuleveut, "Differentially Private Federated Learning on
Heterogeneous Data", AISTATS 2022, Algorithm 1): SCAFFOLD whose clients train by DP-SGD.

A round: the server sends ``x``, ``c`` and the round's rate ``eta_m``; client ``k`` runs DP-FedAvg's
``T_k`` local steps from ``x`` (:func:`fedlap_jax.baselines.client_step`: Poisson batches of
expected size ``B``, per-example clipping to ``C``, Gaussian noise ``sigma C``, the one DP gradient
:func:`fedlap_jax.privacy.poisson_gradient`), every noisy gradient corrected by ``c - c_k``; then
its control update (option II of Karimireddy et al., 2020) ``c_k+ = c_k - c + (x - y_k) / (T_k
eta_m)``, and it sends ``y_k`` and ``delta c_k = c_k+ - c_k``. The server takes DP-FedAvg's step
on the ``y_k`` (uniform weights) and adds ``(m / K) sum_k w_k delta c_k`` to ``c`` (SCAFFOLD's
server, :func:`fedlap_jax.methods.fedavg.scaffold_server_step`).

Privacy: ``delta c_k`` is computed from ``y_k``, ``x``, ``c`` and ``c_k`` alone, each a function
of the noisy gradients and of earlier releases, so it costs nothing beyond ``y_k``: the
mechanism is DP-FedAvg's of the same ``B``, ``sigma``, ``T`` and rounds
(:meth:`DPScaffoldConfig.dp_accesses`).

What an honest reply keeps (:func:`check_update`, which a server refuses a reply outside of):
the clients step by plain SGD (:class:`DPScaffoldConfig` refuses any other ``client_optimizer``;
DP-FedAvg's config has no FedProx term), and with ``T_k >= 1`` steps ``delta c_k
= c_k+ - c_k`` with ``c_k+ = c_k - c + (x - y_k) / (T_k eta) = (1 / T_k) sum_s g_s``, the mean of
the round's noisy gradients (the correction cancels), and ``c_k`` the mean of an earlier round's
(or zero). The mean of ``t`` noisy clipped gradients is bounded as a ``t``-step update at rate
``1 / t`` (:func:`fedlap_jax.update_bounds.local_sgd_update_bound`; its tail terms per step
shrink with ``t``, so ``t = 1`` bounds every ``T_k``): ``||delta c_k|| <= 2 G``, ``G`` that
bound at ``t = 1``, whatever the client's ``N_k``; and ``||y_k - x|| = eta ||sum_s (g_s + c -
c_k)|| <= eta (U_T + T (||c|| + G))``, ``U_T`` the ``T``-step bound at rate 1. Each tail bound
fails for an honest client with probability at most
:data:`~fedlap_jax.update_bounds.FALSE_REFUSAL`. The float32 rounding of ``y_k`` (at most
``2^-24 ||w||`` a step) and of ``delta c_k``'s division by ``T_k eta`` is added.

In an experiment config the method is ``method=dp_scaffold`` with DP-FedAvg's sections
(``baseline``, ``client.batch_size``, ``dp``); its own section ``dp_scaffold`` holds nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import baselines, optim, update_bounds
from fedlap_jax.baselines import BaselineConfig, LocalTraining
from fedlap_jax.checks import ConfigError, require
from fedlap_jax.method import RunFacts
from fedlap_jax.methods import fedavg


@dataclasses.dataclass(frozen=True)
class DPScaffoldConfig:
  """A DP-SCAFFOLD run (hashable: a jit static).

  Attributes:
    base: DP-FedAvg's :class:`~fedlap_jax.baselines.BaselineConfig` (``method='dp_fedavg'``):
      its rounds, rates, weighting, optimisers, local DP-SGD and ``dp`` are DP-SCAFFOLD's
      (read through this config: ``config.rounds`` is ``base.rounds``).
    local: ``base.local`` with SCAFFOLD's correction on (derived).
  """

  base: BaselineConfig
  local: LocalTraining = dataclasses.field(init=False)

  def __post_init__(self):
    require(
      isinstance(self.base, BaselineConfig) and self.base.method == "dp_fedavg",
      "base",
      self.base,
      "a BaselineConfig of method 'dp_fedavg' (DP-SCAFFOLD's clients and server)",
    )
    require(self.base.dp is not None, "dp", None, "a DPConfig (DP-SCAFFOLD is DP)")
    # Momentum or weight decay respond to a step's gradient with a total weight A != 1 over
    # the round, so c_k+ = (1 - A)(c_k - c) + ...: the client's own c_k carries into every
    # later reply (with momentum |1 - A| > 1: it grows round on round), and the server, which
    # never sees c_k, has no bound on an honest reply. Adam's step is not linear at all.
    require(
      self.base.client_optimizer == optim.SGD,
      "client_optimizer",
      self.base.client_optimizer,
      "plain SGD (name='sgd', momentum=0, weight_decay=0, nesterov=False) for DP-SCAFFOLD: "
      "the server bounds an honest reply's control delta and model only for plain SGD steps",
    )
    object.__setattr__(self, "local", dataclasses.replace(self.base.local, control_variates=True))

  def __getattr__(self, name: str):
    if name.startswith("__") or name == "base":  # copy / pickle probe before __init__
      raise AttributeError(name)
    return getattr(self.base, name)

  def dp_accesses(self):
    """DP-FedAvg's accesses of ``base``: the control variates add none."""
    return self.base.dp_accesses()


@dataclasses.dataclass(frozen=True)
class Section:
  """DP-SCAFFOLD's own experiment section: empty (every setting is DP-FedAvg's)."""


def extend(base: BaselineConfig, section: Any) -> DPScaffoldConfig:
  """DP-SCAFFOLD's config on DP-FedAvg's ``base`` (``section``: its empty :class:`Section`)."""
  del section
  return DPScaffoldConfig(base)


def init(key, params, clients, config: DPScaffoldConfig, facts):
  """DP-FedAvg's state (its checks of the data), every control variate zero."""
  state = fedavg.init(key, params, clients, config.base, facts)
  k = clients.mask.shape[0]
  zeros = jax.tree.map(jnp.zeros_like, params)
  c_k = jax.tree.map(lambda p: jnp.zeros((k, *p.shape), p.dtype), params)
  return state._replace(control=zeros, client_controls=c_k)


def update_bounds_of(config: DPScaffoldConfig, facts: RunFacts):
  """``message -> (max ||y_k - x||, max ||delta c_k||)`` of an honest client in the round of
  ``message`` (the module docstring: plain SGD steps, clipped and noised)."""
  loc = config.local
  clip = loc.l2_clip_norm
  assert clip is not None  # DP-FedAvg's local steps, always clipped
  steps = loc.scheduled_steps()

  def noisy_sum(t: int) -> float:  # ||sum of t noisy clipped gradients||
    return update_bounds.local_sgd_update_bound(
      learning_rate=1.0,
      steps=t,
      batch_size=loc.batch_size,
      l2_clip_norm=float(clip),
      noise_multiplier=float(loc.noise_multiplier),
      num_params=facts.num_params,
      max_batch=loc.max_client_size,
    )

  mean_g, sum_g = noisy_sum(1), noisy_sum(steps)
  eps = update_bounds.FLOAT32_ROUNDOFF

  def bounds(message: fedavg.Message) -> tuple[float, float]:
    eta = float(message.learning_rate)
    x, c = update_bounds.tree_norm(message.params), update_bounds.tree_norm(message.control)
    model = eta * (sum_g + steps * (c + mean_g)) * (1.0 + update_bounds.FLOAT_SLACK)
    model += steps * eps * (x + model)  # each step's rounding of w - eta d
    control = 2.0 * mean_g * (1.0 + update_bounds.FLOAT_SLACK)
    # The rounding of y_k, then of -c - (y_k - x) / (T_k eta).
    control += (2.0 * eps * (x + model) / eta if eta > 0 else 0.0) + 2.0 * eps * (c + control)
    return model, control

  return bounds


def check_update(config: DPScaffoldConfig, facts: RunFacts) -> Callable[[Any, Any], None]:
  """``(message, update) -> None`` refusing a reply beyond :func:`update_bounds_of`.

  Raises (the check):
    ConfigError: naming ``params`` (``||y_k - x||``) or ``control_delta``, the norm and the
      bound.
  """
  of = update_bounds_of(config, facts)

  def check(message: fedavg.Message, update: fedavg.ScaffoldUpdate) -> None:
    model, control = of(message)
    moved = jax.tree.map(
      lambda y, x: np.asarray(y, np.float64) - np.asarray(x, np.float64),
      update.params,
      message.params,
    )
    for field, what, norm, bound in (
      ("params", "||y_k - x||", update_bounds.tree_norm(moved), model),
      ("control_delta", "||delta c_k||", update_bounds.tree_norm(update.control_delta), control),
    ):
      if not norm <= bound:
        raise ConfigError(
          field,
          norm,
          f"at most {bound:.4g}",
          message=f"{field} has norm {norm:.4g} ({what}); allowed: at most {bound:.4g}, what "
          "an honest client's eta_m, steps, clip and noise allow",
        )

  return check


_SCAFFOLD = fedavg.METHODS[baselines.METHODS.index("scaffold")]
_DP_FEDAVG = fedavg.METHODS[baselines.METHODS.index("dp_fedavg")]

DP_SCAFFOLD = dataclasses.replace(
  _SCAFFOLD,
  name="dp_scaffold",
  label=lambda dp: "DP-SCAFFOLD",
  config_type=DPScaffoldConfig,
  init=init,
  privacy="required",
  privacy_note=_DP_FEDAVG.privacy_note,
  dp_twin=None,
  extends="dp_fedavg",
  extend=extend,
  own_section=Section,
  check_update=check_update,
)

METHODS = (DP_SCAFFOLD,)
