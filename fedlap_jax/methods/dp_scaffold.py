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

In an experiment config the method is ``method=dp_scaffold`` with DP-FedAvg's sections
(``baseline``, ``client.batch_size``, ``dp``); its own section ``dp_scaffold`` holds nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fedlap_jax import baselines
from fedlap_jax.baselines import BaselineConfig, LocalTraining
from fedlap_jax.checks import require
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
)

METHODS = (DP_SCAFFOLD,)
