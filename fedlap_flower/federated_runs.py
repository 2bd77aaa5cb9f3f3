"""The federated run a client's carried state belongs to: one identity across its resumes.

A run the operator resumes (the server's ``resume = true``) is a new Flower run (a new run id,
and under signed runs a new ``run-nonce``); the federated run it continues is the same. The
server draws that run's identity when the run starts (:func:`new_identity`: 128 random bits as
32 hex digits), keeps it in its run-dir (``run_info.json``, ``federated_run``) and sends it with
every train message (``federated-run``); a resumed run sends the stopped one's. A client whose
method carries state between rounds (SCAFFOLD's ``c_k``, a synthetic set, FedLAP's images under
``synthetic_init='noise'``) keeps it under that identity
(:meth:`fedlap_flower.ledger.ClientState.save_carried`), so round ``m + 1`` of a resumed run
reads what the client kept after its last round of the stopped one.

The identity comes from the server, so the client takes it as untrusted input
(:func:`admit`, under the state directory's lock): 32 hex digits only (never a path), and
recorded in ``<state-dir>/federated_runs.json`` (written atomically) with the digest of the
experiment it belongs to (:func:`config_digest` of the run's config, as the client builds it
from its run config: config, overrides, seed) and the Flower runs that used it. Refused:

* an identity recorded for another experiment: a server cannot make a client compute from the
  state of another experiment;
* another identity in a Flower run that already used one: a run's identity does not change.

The record also holds, per identity, the last round the server said took this client's reply
(``delivered``, :func:`record_delivered`), the round the client's carried state continues
from: a later message naming an earlier one (a fresh start, or a state the server had taken
a later one of) is refused. Which of its kept rounds a client computes from (never a fresh
start mid-run, never back before a round it computed) is :mod:`fedlap_flower.client_app`'s
rule. A record that cannot be read is refused, not reset. No ``flwr`` here.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from fedlap_flower import ledger as ledger_lib

RECORD_FILE = "federated_runs.json"
FORMAT = 1
IDENTITY = ledger_lib.RUN_IDENTITY
# The train message's key and run_info.json's.
MESSAGE_KEY = "federated-run"
RUN_INFO_KEY = "federated_run"
# The train message's key of the last round whose server update took this client's reply
# (0: none): the round its carried state continues from.
DELIVERED_KEY = "delivered-round"


class RefusedRun(ValueError):
  """An identity this client does not take: malformed, of another experiment, another one in
  the same Flower run, or a record it cannot read."""


def new_identity() -> str:
  """A new federated run's identity: 128 bits of the operating system's entropy, 32 hex
  digits."""
  return secrets.token_hex(16)


def config_digest(config_values: Any) -> str:
  """``sha256`` (hex) of a run's config values as JSON (sorted keys; tuples as lists)."""
  text = json.dumps(config_values, sort_keys=True, default=str, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def _entry_ok(identity: str, entry: dict) -> bool:
  flower = entry.get("flower_runs")
  delivered_round = entry.get("delivered")
  return (
    bool(IDENTITY.fullmatch(str(identity)))
    and isinstance(entry.get("config"), str)
    and isinstance(flower, list)
    and all(isinstance(r, int) for r in flower)
    and (
      delivered_round is None
      or (
        isinstance(delivered_round, int)
        and not isinstance(delivered_round, bool)
        and delivered_round >= 1
      )
    )
  )


def _read(state: ledger_lib.ClientState) -> dict[str, dict]:
  path = state.directory / RECORD_FILE
  try:
    return ledger_lib.read_runs_record(state, RECORD_FILE, FORMAT, _entry_ok)
  except ValueError as e:
    raise RefusedRun(
      f"{path} cannot be read as this client's record of federated runs ({e}); refusing to "
      "compute from a carried state until it is restored (a new record would take any "
      "identity a server sends)"
    ) from None


def admit(state: ledger_lib.ClientState, identity, flower_run: int, digest: str) -> str:
  """Takes ``identity`` for Flower run ``flower_run`` of the experiment ``digest``; returns it.

  Call it holding ``state.locked()``. A new identity, or a Flower run new to a known one, is
  recorded before this returns.

  Raises:
    RefusedRun: ``identity`` is not 32 hex digits, is recorded for another experiment, or
      ``flower_run`` used another identity; or the record is unreadable.
  """
  if not isinstance(identity, str) or not IDENTITY.fullmatch(identity):
    shown = repr(identity)[:40]
    raise RefusedRun(
      f"{MESSAGE_KEY}={shown} is invalid; allowed: the federated run's identity the server "
      "drew, 32 hex digits"
    )
  runs = _read(state)
  run = int(flower_run)
  for other, entry in runs.items():
    if other != identity and run in entry["flower_runs"]:
      raise RefusedRun(
        f"{MESSAGE_KEY}={identity} is refused: this client computed Flower run {run} as "
        f"federated run {other}, and a run's identity does not change. Allowed: {other}"
      )
  entry = runs.get(identity)
  if entry is not None and entry["config"] != digest:
    raise RefusedRun(
      f"{MESSAGE_KEY}={identity} is refused: this client kept it for another experiment "
      f"(config digest {entry['config'][:16]}..., this run's {digest[:16]}...); a run "
      "resumes with its own config and overrides. Allowed: a new run, or the identity of this "
      "experiment's run"
    )
  if entry is None or run not in entry["flower_runs"]:
    entry = entry or {"config": digest, "flower_runs": [], "started_at": time.time()}
    entry["flower_runs"] = [*entry["flower_runs"], run]
    runs[identity] = entry
    state.write_json(RECORD_FILE, {"format": FORMAT, "runs": runs})
  return identity


def recorded(state: ledger_lib.ClientState) -> dict[str, dict]:
  """The record: ``{identity: {"config": digest, "flower_runs": [...], "started_at": ...,
  "delivered": round}}`` (``delivered`` once the server said a round took the client's
  reply)."""
  return _read(state)


def delivered(state: ledger_lib.ClientState, identity: str) -> int:
  """The last round of federated run ``identity`` the server said took this client's reply
  (0: none yet). Call it holding ``state.locked()``, after :func:`admit`.

  Raises:
    RefusedRun: the record is unreadable.
  """
  return int(_read(state).get(identity, {}).get("delivered") or 0)


def record_delivered(state: ledger_lib.ClientState, identity: str, server_round: int) -> None:
  """Records that the server said round ``server_round`` of federated run ``identity`` took this
  client's reply (before the client computes from that round's state). Call it holding
  ``state.locked()``, after :func:`admit`.

  Raises:
    RefusedRun: the record is unreadable, or holds no entry of ``identity``.
  """
  path = state.directory / RECORD_FILE
  runs = _read(state)
  if identity not in runs:
    raise RefusedRun(f"{path} holds no federated run {identity}; it was admitted before")
  if runs[identity].get("delivered") != int(server_round):
    runs[identity]["delivered"] = int(server_round)
    state.write_json(RECORD_FILE, {"format": FORMAT, "runs": runs})
