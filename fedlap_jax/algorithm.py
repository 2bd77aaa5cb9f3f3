"""A uniform interface over FedLAP and the gradient-sharing baselines.

In the style of FedJAX's ``FederatedAlgorithm(init, apply)``: an algorithm is a
pair of functions plus a few static facts the experiment driver needs for
accounting and communication cost. ``round`` is jitted once per run.

* ``init(key, params, clients) -> state``
* ``round(state, clients) -> (state, metrics)`` where ``metrics`` is a pytree
  of arrays (per-client leaves have a leading ``(K,)`` axis).
* ``params_of(state) -> params``: the global model to evaluate.
* ``upload_floats_per_client``: floats one client sends per round.
* ``dp``: the :class:`~fedlap_jax.config.DPConfig` or ``None``.
* ``dp_steps_per_round``: ``T``, the data-independent worst-case number of
  accesses to a client's real data per round (for the accountant); ``None``
  without DP.
* ``batch_size``: expected Poisson batch size ``B`` of real data.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from fedlap_jax.client_data import ClientData
from fedlap_jax.config import DPConfig, FedLAPConfig
from fedlap_jax.federated import init_state, make_round_fn


class FederatedAlgorithm(NamedTuple):
  """See the module docstring."""

  name: str
  init: Callable[[jax.Array, Any, ClientData], Any]
  round: Callable[[Any, ClientData], tuple[Any, Any]]
  params_of: Callable[[Any], Any]
  upload_floats_per_client: int
  dp: DPConfig | None
  dp_steps_per_round: int | None
  batch_size: int


def fedlap(apply_fn: Callable, config: FedLAPConfig, *, image_shape: tuple[int, ...],
           max_classes_per_client: int, client_backend: str = "auto") -> FederatedAlgorithm:
  """FedLAP / FedLAP-DP as a :class:`FederatedAlgorithm`.

  ``upload_floats_per_client = ipc * max_classes_per_client * prod(image_shape)``
  (the synthetic images; labels are fixed and sent once).
  """
  cc = config.client
  upload = int(cc.ipc * max_classes_per_client * np.prod(image_shape))
  round_fn = make_round_fn(apply_fn, config, client_backend=client_backend)
  return FederatedAlgorithm(
      name="fedlap_dp" if cc.dp is not None else "fedlap",
      init=lambda key, params, clients: init_state(key, params, clients, config),
      round=round_fn,
      params_of=lambda state: state.params,
      upload_floats_per_client=upload,
      dp=cc.dp,
      dp_steps_per_round=cc.real_accesses_per_round if cc.dp is not None else None,
      batch_size=cc.batch_size,
  )
