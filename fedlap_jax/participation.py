"""Client sampling per round: which clients take part, and a round over only them.

Real federations do not run every client in every round. With
``clients_per_round = m < K``:

* :func:`sample_clients` draws the round's ``m`` clients uniformly without
  replacement from ``K``; the draw depends only on ``(seed, round)``
  (``numpy.random.default_rng([seed, round, SAMPLING_STREAM])``), so a run
  killed and resumed draws the same clients. Who takes part is released
  (``metrics.jsonl``, the ledgers), so ``seed`` here must be public and
  independent of the secret seed behind the noise (the driver passes
  ``data.participation_seed``): participants drawn from the secret seed would let
  anyone check seed guesses offline and then recompute the noise;
* :func:`host_clients` keeps all clients' records on the host (NumPy) and
  :func:`device_block` moves only the sampled ``(m, N_max, ...)`` block to the
  device each round: a round's cost and device memory grow with ``m``, not
  ``K`` (static shapes: ``N_max`` is the largest client of all ``K``, so every
  round compiles to one program);
* :func:`sampled_round` runs an algorithm's ordinary ``round`` on the block:
  the per-client carried state the algorithm declares in
  :attr:`FederatedAlgorithm.client_state_fields` (FedLAP-DP's synthetic sets,
  SCAFFOLD's control variates) is gathered for the sampled clients, updated
  by the round and scattered back; unsampled clients' state stays as it is.
  The server aggregates over the sampled clients only (the algorithm sees only
  them: FedLAP their synthetic sets with the usual weights, the baselines their
  deltas; SCAFFOLD's server variate uses the ``m / K`` scaling of Karimireddy
  et al., :func:`fedlap_jax.methods.fedavg.scaffold_server_step`).

``clients_per_round=None`` (or ``K``) draws every client, in order; the driver
then keeps today's path (all clients on the device, ``alg.round(state, clients)``).
Privacy: each client's ledger charges only the rounds it took part in
(:class:`fedlap_jax.accounting.ClientLedgers`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.algorithm import FederatedAlgorithm
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData

# Third entry of the sampling seed, so the stream differs from every other
# ``default_rng([seed, ...])`` of the project (e.g. the partition's ``[seed, 29]``).
SAMPLING_STREAM = 0x5A3


def check_clients_per_round(
  clients_per_round: Any, num_clients: int, field: str = "data.clients_per_round"
) -> int | None:
  """``clients_per_round`` validated against ``K = num_clients``.

  Returns:
    ``None`` (every client) or the int ``m`` with ``1 <= m <= K``.

  Raises:
    ConfigError: naming ``field``, the value and the allowed range.
  """
  if clients_per_round is None:
    return None
  if (
    isinstance(clients_per_round, bool)
    or not isinstance(clients_per_round, (int, np.integer))
    or not 1 <= clients_per_round <= num_clients
  ):
    raise ConfigError(
      field,
      clients_per_round,
      f"None (every client) or an integer in 1..{num_clients} (K, the number of clients)",
    )
  return int(clients_per_round)


def sample_clients(
  seed: int, round_index: int, num_clients: int, clients_per_round: int | None
) -> np.ndarray:
  """The clients taking part in round ``round_index`` (1-based), sorted.

  Uniform without replacement; a pure function of ``(seed, round_index)``.

  Args:
    seed: a public seed, >= 0 (``data.participation_seed``; never the secret
      seed of the noise: the draw is released).
    round_index: the round, >= 1.
    num_clients: ``K``.
    clients_per_round: ``m`` in ``1..K``, or ``None`` for all.

  Returns:
    ``(m,)`` int32 client indices in increasing order (``arange(K)`` for
    ``None`` or ``m = K``).
  """
  m = check_clients_per_round(clients_per_round, num_clients)
  if m is None or m == num_clients:
    return np.arange(num_clients, dtype=np.int32)
  rng = np.random.default_rng([int(seed), int(round_index), SAMPLING_STREAM])
  return np.sort(rng.choice(num_clients, size=m, replace=False)).astype(np.int32)


def host_clients(clients: ClientData) -> ClientData:
  """``clients`` with every leaf as a host NumPy array (nothing stays on a device)."""
  return jax.tree.map(np.asarray, clients)


def device_block(clients: ClientData, idx: np.ndarray) -> ClientData:
  """The sampled clients' ``(m, N_max, ...)`` block of host ``clients``, moved to the device.

  The gather runs on the host (NumPy); only the block is transferred.
  """
  idx = np.asarray(idx)
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)[idx]), clients)


@jax.jit
def _take(tree, idx):
  return jax.tree.map(lambda a: a[idx], tree)


@jax.jit
def _put(tree, idx, sub):
  return jax.tree.map(lambda a, b: a.at[idx].set(b), tree, sub)


def sampled_round(alg: FederatedAlgorithm, state: Any, block: ClientData, idx) -> tuple[Any, Any]:
  """One round of ``alg`` over the sampled clients ``idx`` only.

  Args:
    alg: the :class:`FederatedAlgorithm`; its ``client_state_fields`` name
      the state fields whose leaves carry a leading ``(K,)`` client axis.
    state: the algorithm's state (per-client fields of all ``K`` clients).
    block: the sampled clients' data ``(m, N_max, ...)`` (:func:`device_block`),
      in the order of ``idx``.
    idx: ``(m,)`` int client indices (:func:`sample_clients`).

  Returns:
    ``(new_state, metrics)``: per-client fields updated at ``idx`` only;
    per-client metric leaves have a leading ``(m,)`` axis in the order of ``idx``.
  """
  idx = jnp.asarray(idx, jnp.int32)
  fields = tuple(f for f in alg.client_state_fields if getattr(state, f) is not None)
  full = {f: getattr(state, f) for f in fields}
  sub_state = state._replace(**_take(full, idx)) if fields else state
  new_state, metrics = alg.round(sub_state, block)
  if fields:
    new_state = new_state._replace(**_put(full, idx, {f: getattr(new_state, f) for f in fields}))
  return new_state, metrics
