"""The server's state after a completed round: what a resumed run continues from.

``RUN_DIR/server_state.npz`` is rewritten atomically
(:func:`fedlap_runs.checkpointing.write_atomic`) after every round whose
update the strategy made: the round ``m``, the global parameters after it
(packed as :func:`fedlap_flower.records.params_to_record` packs them), the
strategy's key chain after the round's split, and what the strategy pinned
for the run (each partition's synthetic labels and ``num-examples``, the
epsilons its accepted replies reported). ``run_info.json`` beside it holds
the experiment's config; :func:`load` checks that the resumed run is the
same experiment.

A resumed run (run config ``resume = true``) is a new Flower run that
starts at round ``m + 1``: the same learning rates, participants and (with
server keys) round keys as the run that stopped, from the same parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from flwr.app import Array, ArrayRecord

from fedlap_runs.checkpointing import write_atomic
from fedlap_flower import records, task

STATE_FILE = "server_state.npz"


class ServerState(NamedTuple):
  """What :func:`save` stores.

  Attributes:
    round: the last completed round ``m`` (1-based).
    params: the global parameters after round ``m`` (a pytree like the model's).
    chain: the strategy's PRNG key chain after round ``m``.
    labels: ``{partition: (y, mask)}`` pinned synthetic labels (FedLAP; ``{}`` for FedAvg).
    epsilon: ``{partition: epsilon}`` the largest epsilon each partition's accepted replies
      reported.
    pins: :attr:`fedlap_flower.binding.PartitionBinding.pins`.
    extra: a registry method's server state besides its parameters, key and round
      (``{name: array}``, :func:`fedlap_flower.method_work.tree_to_arrays`: FedAdam's Adam
      state); ``{}`` for FedLAP.
  """

  round: int
  params: Any
  chain: Any
  labels: dict
  epsilon: dict
  pins: dict
  extra: dict = {}


def save(run_dir: Path, state: ServerState) -> None:
  """Writes ``run_dir/server_state.npz`` atomically."""
  meta = {
    "round": int(state.round),
    "epsilon": {str(k): float(v) for k, v in state.epsilon.items()},
    "pins": state.pins,
  }
  arrays = {
    "params": records.params_to_record(state.params)[records.PACKED].numpy(),
    "chain": np.asarray(task.key_to_words(state.chain), np.uint32),
    "meta": np.asarray(json.dumps(meta, sort_keys=True)),
  }
  for pid, (y, mask) in state.labels.items():
    arrays[f"labels/{pid}/y"] = np.asarray(y)
    arrays[f"labels/{pid}/mask"] = np.asarray(mask)
  for name, value in state.extra.items():
    arrays[f"extra/{name}"] = np.asarray(value)
  write_atomic(Path(run_dir) / STATE_FILE, lambda f: np.savez(f, **arrays))


def load(run_dir: Path, template) -> ServerState | None:
  """The state :func:`save` wrote in ``run_dir`` (``None`` if there is none).

  ``template``: the model's initial parameters (their paths and shapes).

  Raises:
    ValueError: the file does not hold a state of this model.
  """
  path = Path(run_dir) / STATE_FILE
  if not path.exists():
    return None
  with np.load(path, allow_pickle=False) as f:
    arrays = {k: np.asarray(f[k]) for k in f.files}
  meta = json.loads(str(arrays["meta"]))
  params = records.record_to_params(
    ArrayRecord({records.PACKED: Array(arrays["params"])}), template
  )
  labels = {}
  for name in arrays:
    if name.startswith("labels/") and name.endswith("/y"):
      pid = name.split("/")[1]
      labels[int(pid)] = (arrays[name], arrays[f"labels/{pid}/mask"])
  extra = {n[len("extra/") :]: arrays[n] for n in arrays if n.startswith("extra/")}
  return ServerState(
    int(meta["round"]),
    params,
    task.words_to_key(arrays["chain"].tolist()),
    labels,
    {int(k): float(v) for k, v in meta["epsilon"].items()},
    meta["pins"],
    extra,
  )
