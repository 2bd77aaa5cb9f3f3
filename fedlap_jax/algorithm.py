"""A uniform interface over FedLAP and the gradient-sharing baselines.

In the style of FedJAX's ``FederatedAlgorithm(init, apply)``: an algorithm is a
pair of functions plus a few static facts the experiment driver needs for
accounting and communication cost. ``round`` is jitted once per run.
Implemented once, by :func:`fedlap_jax.rounds.algorithm`, for any
:class:`~fedlap_jax.method.Method` (every method of :data:`fedlap_jax.methods.REGISTRY`: FedLAP
and FedLAP-DP, the gradient-sharing baselines, FedDM, DSC, PSG, FedAdam, and a method of one's
own).

* ``init(key, params, clients) -> state``
* ``round(state, clients) -> (state, metrics)`` where ``metrics`` is a pytree
  of arrays (per-client leaves have a leading ``(K,)`` axis).
* ``params_of(state) -> params``: the global model to evaluate.
* ``upload_floats_per_client``: floats one client sends per round.
* ``dp``: the :class:`~fedlap_jax.dp_config.DPConfig` (clip, noise, delta) or ``None``.
* ``mechanism``: the :class:`~fedlap_jax.accounting.DpMechanism` the method
  declares (``q_k = B / N_k``, ``sigma``, ``T`` noisy accesses to a client's
  records per round, ``delta``, the neighbouring relation of its epsilon): the
  one value every ledger and calibration reads; ``None`` without DP (exactly
  when ``dp`` is ``None``). ``dp_steps_per_round`` reads its ``T``.
* ``batch_size``: expected Poisson batch size ``B`` of real data.
* ``client_state_fields``: names of the state fields whose leaves carry a
  leading ``(K,)`` client axis across rounds (FedLAP's synthetic sets,
  SCAFFOLD's control variates); a round over sampled clients gathers and
  scatters them (:func:`fedlap_jax.participation.sampled_round`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from fedlap_jax.accounting import DpMechanism
from fedlap_jax.client_data import ClientData
from fedlap_jax.dp_config import DPConfig


class FederatedAlgorithm(NamedTuple):
  """See the module docstring."""

  name: str
  init: Callable[[jax.Array, Any, ClientData], Any]
  round: Callable[[Any, ClientData], tuple[Any, Any]]
  params_of: Callable[[Any], Any]
  upload_floats_per_client: int
  dp: DPConfig | None
  mechanism: DpMechanism | None
  batch_size: int
  client_state_fields: tuple[str, ...] = ()

  @property
  def dp_steps_per_round(self) -> int | None:
    """``T`` of :attr:`mechanism` (``None`` without DP)."""
    return None if self.mechanism is None else self.mechanism.steps_per_round
