"""A client's own state directory: privacy ledger, secret key, carried synthetic set.

Privacy at the edge: every client accounts for its own records (record-level
DP, ``q = B / N_k`` with its own ``N_k``, ``T`` noisy steps per round) in a
:class:`fedlap_jax.accounting.PrivacyLedger` kept in its state directory, and
composes every round it ever answered with these records, across runs and
restarts. Files (written atomically: temporary file, ``fsync``, ``os.replace``):

* ``privacy_ledger.json`` -- ``{"fingerprint": ..., "ledger": PrivacyLedger.to_dict(),
  "history": [{"run_id", "server_round", "steps", "epsilon", "keys", "time"}, ...]}``;
  restored with :meth:`PrivacyLedger.from_dict`, which recomputes every epsilon
  and refuses a tampered file;
* ``secret_key`` -- 8 random bytes (mode 0600), the client's PRNG secret: under
  DP the round's key (Poisson sampling, augmentation, Gaussian noise) is
  ``fold_in(secret, rounds spent so far)``, never known to the server and never
  reused (the count only grows);
* ``runs/<run_id>/synthetic.npz`` -- the synthetic images carried between
  rounds (``synthetic_init='noise'``).

The order of a DP round (:meth:`ClientState.spend` before computing): check that
the epsilon *after* the round stays within the client's maximum, record the
round (the file is on disk before any result exists), then compute and reply.
A crash after the spend leaves the ledger charged for a result nobody saw:
never under-counted. One process works in a state directory at a time
(``fcntl`` lock).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedlap_jax import accounting

LEDGER_FILE = "privacy_ledger.json"
SECRET_FILE = "secret_key"
# Fields a ledger must keep to compose later rounds with earlier ones (T may vary per round).
FIXED_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "min_client_size", "delta",
                        "participation")


# The ledger this process last wrote per file, with the file's text: a process that serves
# several rounds (a simulation worker) restores it without recomputing every round's RDP.
_WRITTEN: dict[Path, tuple[str, accounting.PrivacyLedger]] = {}


class LedgerError(ValueError):
  """The state directory holds a ledger of other records or another privacy setting."""


class BudgetExceeded(RuntimeError):
  """A round would take the client's epsilon past its maximum."""

  def __init__(self, epsilon: float, epsilon_after: float, max_epsilon: float):
    self.epsilon, self.epsilon_after, self.max_epsilon = epsilon, epsilon_after, max_epsilon
    super().__init__(
        f"refused: this round would raise epsilon from {epsilon:.4f} to {epsilon_after:.4f}, "
        f"above the client's max-epsilon={max_epsilon:g}")


def write_json_atomic(path: Path, obj) -> None:
  """``obj`` as JSON to ``path``: temporary file, flush, fsync, ``os.replace``."""
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class ClientState:
  """One client's state directory (see the module docstring)."""

  def __init__(self, directory: str | os.PathLike):
    self.directory = Path(directory)
    self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

  @contextlib.contextmanager
  def locked(self):
    """Holds an exclusive lock on the directory for a round."""
    with open(self.directory / ".lock", "a") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        yield self
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  # -- the secret key ------------------------------------------------------------

  def secret_key(self) -> jax.Array:
    """The client's secret PRNG key, created once (8 bytes from ``os.urandom``)."""
    path = self.directory / SECRET_FILE
    if not path.exists():
      try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
      except FileExistsError:
        pass
      else:
        with os.fdopen(fd, "wb") as f:
          f.write(os.urandom(8))
          f.flush()
          os.fsync(f.fileno())
    data = path.read_bytes()
    if len(data) != 8:
      raise LedgerError(f"{path} holds {len(data)} bytes; allowed: the 8 bytes written when "
                        "the state directory was created")
    return jax.random.wrap_key_data(np.frombuffer(data, np.uint32).copy())

  # -- the ledger ------------------------------------------------------------------

  def _text(self) -> str | None:
    path = self.directory / LEDGER_FILE
    return path.read_text() if path.exists() else None

  def _read(self) -> dict | None:
    text = self._text()
    if text is None:
      return None
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise LedgerError(f"{self.directory / LEDGER_FILE} is not valid JSON ({e}); refusing to guess the privacy "
                        "spent. Restore it from a backup; allowed: the file this client "
                        "wrote") from None

  def ledger(self, fingerprint: dict, **privacy) -> accounting.PrivacyLedger:
    """The stored ledger of these records, or a new one (``privacy``: PrivacyLedger's fields).

    Restoring recomputes every recorded round's epsilon
    (:meth:`PrivacyLedger.from_dict`), a cost that grows with the rounds
    recorded (1.0 s per round of T = 10 steps on the project's 2-core CPU at a
    load average of 14); a process that wrote the file itself reuses its ledger.

    Raises:
      LedgerError: the stored ledger describes other records (``fingerprint``)
        or another setting of ``FIXED_PRIVACY_FIELDS``, or was tampered with.
    """
    where = self.directory / LEDGER_FILE
    text = self._text()
    stored = self._read()
    if stored is None:
      return accounting.PrivacyLedger(**privacy)
    if stored.get("fingerprint") != fingerprint:
      raise LedgerError(
          f"{where} accounts for other records ({stored.get('fingerprint')}) than this "
          f"client's ({fingerprint}); allowed: the state-dir of these records")
    cached = _WRITTEN.get(where)
    if cached is not None and cached[0] == text:
      ledger = copy.deepcopy(cached[1])
    else:
      try:
        ledger = accounting.PrivacyLedger.from_dict(stored["ledger"])
      except (KeyError, ValueError, TypeError) as e:
        raise LedgerError(f"{where}: {e}") from None
    new = accounting.PrivacyLedger(**privacy)
    diff = [f"{k}: stored {getattr(ledger, k)!r} vs now {getattr(new, k)!r}"
            for k in FIXED_PRIVACY_FIELDS if getattr(ledger, k) != getattr(new, k)]
    if diff:
      raise LedgerError(
          f"{where} composes rounds of another privacy setting ({'; '.join(diff)}); its "
          "rounds cannot be composed with this run's. Allowed: the same noise_multiplier, "
          "batch_size, records and delta")
    return ledger

  def history(self) -> list[dict]:
    stored = self._read()
    return [] if stored is None else list(stored.get("history", []))

  def epsilon_after(self, ledger: accounting.PrivacyLedger, steps: int) -> float:
    """The epsilon ``ledger`` would show after one more round of ``steps`` (nothing is stored)."""
    return copy.deepcopy(ledger).record_round(steps)  # the copy keeps the composed RDP

  def spend(self, ledger: accounting.PrivacyLedger, fingerprint: dict, steps: int,
            max_epsilon: float, entry: dict[str, Any]) -> float:
    """Checks the budget, records one round and writes the ledger (before any computation).

    Raises:
      BudgetExceeded: the epsilon after the round would exceed ``max_epsilon``
        (nothing is recorded).
    """
    after = self.epsilon_after(ledger, steps)
    if after > max_epsilon:
      raise BudgetExceeded(ledger.epsilon, after, max_epsilon)
    eps = ledger.record_round(steps)
    history = self.history()
    history.append({**entry, "steps": int(steps), "epsilon": eps, "time": time.time()})
    path = self.directory / LEDGER_FILE
    write_json_atomic(path, {"fingerprint": fingerprint, "ledger": ledger.to_dict(),
                             "history": history})
    _WRITTEN[path] = (path.read_text(), copy.deepcopy(ledger))
    return eps

  # -- the carried synthetic set ---------------------------------------------------

  def _synthetic_path(self, run_id) -> Path:
    return self.directory / "runs" / str(run_id) / "synthetic.npz"

  def load_synthetic(self, run_id) -> np.ndarray | None:
    """The images carried from this run's last round of this client, or None."""
    path = self._synthetic_path(run_id)
    if not path.exists():
      return None
    with np.load(path, allow_pickle=False) as f:
      return np.asarray(f["x"])

  def save_synthetic(self, run_id, server_round: int, x: np.ndarray) -> None:
    path = self._synthetic_path(run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".synthetic.tmp{os.getpid()}.npz")
    with open(tmp, "wb") as f:
      np.savez(f, x=np.asarray(x, np.float32), round=server_round)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
