"""The signed runs a client has computed, in its state directory: each signature admits one run.

Every signed run config carries a random ``run-nonce``
(:mod:`fedlap_flower.runtime.run_signature`). On the first task of a run, a
client records the nonce with the Flower run id it came with, in
``<state-dir>/signed_runs.json`` (under the state directory's lock, written
atomically, before the task runs); every later task of that run finds it there
and goes on, however long the run takes. The same nonce under another Flower run
id is a resubmission of a run this client already computed (``flwr run`` with
the same signed TOML, byte for byte) and is refused before anything runs, so it
charges no ledger. A run the operator resumes (the server's ``resume = true``) is a
new submission signed again (a new nonce): each client then computes, and charges, the
rounds the resumed run asks of it.

The record outlives restarts of the node (a SuperNode that crashes mid-run and
comes back continues the same Flower run); it is never pruned (one line per
run). A record that cannot be read is refused, not reset: a reset would admit
every earlier run again.

No ``flwr`` here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from fedlap_flower import ledger as ledger_lib
from fedlap_flower.refusal import Refusal

RECORD_FILE = "signed_runs.json"
FORMAT = 1


class ReplayedRun(Refusal):
  """A signed run this client already computed under another Flower run (``field``
  ``run-nonce``), or a record it cannot read (``field`` ``state-dir``)."""


def _read(state: ledger_lib.ClientState) -> dict[str, dict]:
  path = state.directory / RECORD_FILE
  try:
    return ledger_lib.read_runs_record(
      state, RECORD_FILE, FORMAT, lambda nonce, entry: isinstance(entry.get("run_id"), int)
    )
  except ValueError as e:
    raise ReplayedRun(
      "state-dir",
      f"{path} cannot be read as this client's record of signed runs ({e}); refusing every "
      "signed run until it is restored (a new record would admit the runs computed before)",
    ) from None


def admit(
  state_dir: str | Path,
  nonce: str,
  run_id: int,
  *,
  check_new: Callable[[], None],
  details: dict | None = None,
) -> bool:
  """Admits the task of Flower run ``run_id`` signed with ``nonce``; True if the run is new.

  A new nonce is first passed to ``check_new`` (which raises to refuse it, e.g. a signature
  too old), then recorded with ``run_id`` and ``details`` (JSON values) before this returns.

  Raises:
    ReplayedRun: ``nonce`` is recorded under another run id, or the record is unreadable.
  """
  state = ledger_lib.ClientState(state_dir)
  with state.locked():
    runs = _read(state)
    seen = runs.get(nonce)
    if seen is not None:
      if seen["run_id"] == int(run_id):
        return False
      raise ReplayedRun(
        "run-nonce",
        f"this signed run (run-nonce {nonce}) was computed by this client as Flower run "
        f"{seen['run_id']}; run {int(run_id)} submits it again and is refused (to run it "
        "again or to resume it, the operator signs it again)",
      )
    check_new()
    runs[nonce] = {"run_id": int(run_id), "admitted_at": time.time(), **(details or {})}
    state.write_json(RECORD_FILE, {"format": FORMAT, "runs": runs})
  return True


def recorded(state_dir: str | Path) -> dict[str, dict]:
  """The record: ``{run-nonce: {"run_id": ..., "admitted_at": ..., ...}}``."""
  return _read(ledger_lib.ClientState(state_dir))
