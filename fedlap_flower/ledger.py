"""A client's own state directory: privacy ledger, its journal, carried client state.

Privacy at the edge: every client accounts for its own records (record-level
DP, ``q = B / N_k`` with its own ``N_k``, ``T`` noisy steps per round; the
mechanism its method declares, :class:`fedlap_jax.accounting.DpMechanism`) in a
:class:`fedlap_jax.accounting.PrivacyLedger` kept in its state directory, and
composes every round it ever answered with these records, across runs and
restarts. Its ``epsilon`` is the replace-one figure (the guarantee with the
record count ``N_k`` public, as a client's epsilon reveals it); the ledger
also keeps the add/remove figure. Files (written atomically: temporary file,
``fsync``, ``os.replace``, ``fsync`` of the directory):

* ``privacy_ledger.json`` -- ``{"fingerprint": ..., "ledger": PrivacyLedger.to_dict(),
  "history": [{"run_id", "server_round", "steps", "epsilon", "keys", "time"}, ...],
  "journaled": true}``; restored with :meth:`PrivacyLedger.from_dict`, which
  recomputes every epsilon and refuses a tampered file;
* ``privacy_journal.jsonl`` -- append-only, one line per spent round
  ``{"rounds", "steps", "epsilon", "time"}`` (rounds and noisy steps spent so
  far), each ``fsync``-ed: the high-water mark of the budget spent;
* ``runs/<federated run>/carried-<round>.npz`` -- a client's carried state after
  that round of a federated run (:attr:`fedlap_jax.method.Method.carried`:
  SCAFFOLD's control variate, a synthetic set; FedLAP's images under
  ``synthetic_init='noise'``), its named arrays and the round
  (:meth:`ClientState.save_carried`). The directory is named by the federated
  run's identity, which a resumed run keeps (:mod:`fedlap_flower.federated_runs`,
  whose record ``federated_runs.json`` lives here too); the state of the round a
  later one was computed from stays until that later round has a successor, so a
  round redone after a stop starts from what it started from. Read back against
  the structure the client computes itself, a file of other arrays, shapes,
  dtypes or another round refused (:meth:`ClientState.load_carried`).

Round keys: under DP each round's key (Poisson sampling, augmentation, Gaussian
noise) is drawn from the operating system's entropy (:func:`fresh_round_key`,
128 bits), never derived from a count on disk, so no state of the disk makes a
client reuse a round's noise.

Rollback: a ledger whose spent budget went down is refused
(:class:`LedgerError`). The ledger is checked against the journal's high-water
mark (more rounds or steps in the journal than in the ledger, a journal missing
beside a ledger that says it has one, or a journal beside no ledger) and
against the rounds this process itself recorded. This detects a ledger file
restored alone (from a backup, a snapshot, another copy) or deleted. It does
not detect the whole state directory (ledger and journal together) restored to
an earlier state, or the journal truncated by hand as well, by whoever controls
the disk, when no process that saw the later state is running: only storage
the client's operator keeps append-only (or off the machine) defends against
that. A state directory is never to be restored: its ledger only grows.

The order of a DP round (:meth:`ClientState.spend` before computing): check that
the epsilon *after* the round stays within the client's maximum, record the
round (ledger, then journal, both on disk before any result exists), then
compute and reply. A crash after the spend leaves the ledger charged for a
result nobody saw: never under-counted. One process works in a state directory
at a time (``fcntl`` lock).

The directory is the client's alone: an existing one that another user owns,
or that its group or the world may write, is refused, and so is one with a parent
that another user than root owns, or that its group or the world may write without
the sticky bit: whoever could rename the directory away would reset its ledger
(:func:`check_private`). Its files are opened relative to the directory's
descriptor, itself opened without following a link and checked to be the
directory checked first (a directory moved away or replaced since is refused);
a new one, and each parent it needs, is created ``0700``. Every file in it is created ``0600``, and
without following a link planted in its place: the ledger and the carried
set through a temporary of a random name opened ``O_EXCL | O_NOFOLLOW``, the journal and
the lock ``O_NOFOLLOW``; a carried state is read ``O_NOFOLLOW`` too. The carried states'
``runs/<run>`` directories are opened the same way, each relative to its parent's
descriptor: a link or a file in the place of either is refused, never followed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import fcntl
import json
import os
import re
import secrets
import stat
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from fedlap_jax import accounting
from fedlap_jax.checks import ConfigError
from fedlap_jax.method import Wire

from fedlap_flower.refusal import Refusal

LEDGER_FILE = "privacy_ledger.json"
JOURNAL_FILE = "privacy_journal.jsonl"
# A carried client state per federated run and round (its named arrays and that round).
CARRIED_FILE = "carried-{round}.npz"
CARRIED_ROUND = "__round__"
_CARRIED_NAME = re.compile(r"carried-([0-9]+)\.npz")
# A federated run's identity (:mod:`fedlap_flower.federated_runs`): one path component.
RUN_IDENTITY = re.compile(r"[0-9a-f]{32}")
# Fields a ledger must keep to compose later rounds with earlier ones (T may vary per round;
# the headline's neighbouring relation is recomputed from the recorded steps).
FIXED_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "min_client_size", "delta")
# Bits of operating-system entropy in every DP round key.
ROUND_KEY_BITS = 128
# Permission bits of every file in a state directory (its owner only) and of its directories.
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
# Open flags that refuse to follow a symbolic link planted at the path.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)


# The ledger this process last wrote per file, with the file's text: a process that serves
# several rounds (a simulation worker) restores it without recomputing every round's epsilon.
_WRITTEN: dict[Path, tuple[str, accounting.PrivacyLedger]] = {}
# The (rounds, noisy steps) this process recorded last per ledger file: a high-water mark
# that survives any change of the files while the process runs.
_HIGH_WATER: dict[Path, tuple[int, int]] = {}


class LedgerError(Refusal):
  """The state directory holds a ledger of other records, another privacy setting, or a
  ledger whose spent budget went down.

  Attributes:
    field: what is refused: ``state-dir`` (who may change it, or it was moved), a file of it
      (:data:`LEDGER_FILE`, :data:`JOURNAL_FILE`), the ledger's ``fingerprint`` (other
      records) or the privacy setting that differs (``noise_multiplier``, ...).
  """


class BudgetExceeded(RuntimeError):
  """A round would take the client's epsilon past its maximum."""

  def __init__(
    self, epsilon: float, epsilon_after: float, max_epsilon: float, *, at_least: bool = False
  ):
    self.epsilon, self.epsilon_after, self.max_epsilon = epsilon, epsilon_after, max_epsilon
    self.at_least = at_least  # epsilon_after is a lower bound (the cheap bound refused it)
    to = "to at least" if at_least else "to"
    super().__init__(
      f"refused: this round would raise epsilon from {epsilon:.4f} {to} {epsilon_after:.4f}, "
      f"above the client's max-epsilon={max_epsilon:g}"
    )

  def __reduce__(self):  # pickled whole (a process boundary keeps the figures)
    args = (self.epsilon, self.epsilon_after, self.max_epsilon)
    return functools.partial(type(self), at_least=self.at_least), args


def fresh_round_key() -> jax.Array:
  """A PRNG key of :data:`ROUND_KEY_BITS` bits from the operating system's entropy.

  ``secrets.token_bytes`` (``os.urandom``) as four ``uint32`` words of an
  ``rbg`` key, whose key data holds all 128 bits (a ``threefry2x32`` key
  holds 64).
  """
  words = np.frombuffer(secrets.token_bytes(ROUND_KEY_BITS // 8), dtype=np.uint32).copy()
  return jax.random.wrap_key_data(words, impl="rbg")


def make_private_dirs(directory: Path) -> None:
  """Creates ``directory`` and each missing parent ``0700`` (``mkdir -p`` would give the
  parents the umask's mode); existing ones are left as they are."""
  missing = []
  while not os.path.lexists(directory) and directory.parent != directory:
    missing.append(directory)
    directory = directory.parent
  for d in reversed(missing):
    try:
      d.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError:  # made meanwhile by another process; check_private judges it
      pass


def check_private(directory: Path) -> None:
  """Refuses a state directory another user could change, or move away.

  Raises:
    LedgerError: ``directory`` is not a directory, is owned by another user than this
      process's, or its group or every user may write it; or one of its parents is owned by
      another user than root or this process's, or its group or every user may write it
      without the sticky bit (which keeps others from renaming what they do not own).
  """
  st = os.stat(directory)
  why = None
  if not stat.S_ISDIR(st.st_mode):
    why = "is not a directory"
  elif st.st_uid != os.geteuid():
    why = f"is owned by user {st.st_uid}, not by this client's user {os.geteuid()}"
  elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    why = f"may be written by its group or by every user (mode {stat.S_IMODE(st.st_mode):04o})"
  if why is not None:
    raise LedgerError(
      "state-dir",
      f"state-dir {directory} {why}: another user could replace its privacy ledger. "
      f"Allowed: a directory of this user that only it may write (chmod go-w), or a new one",
    )
  for parent in directory.resolve().parents:
    st = os.stat(parent)
    if st.st_uid not in (0, os.geteuid()):
      why = f"is owned by user {st.st_uid}, neither root nor this client's user {os.geteuid()}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
      why = f"may be written by its group or by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
      continue
    raise LedgerError(
      "state-dir",
      f"state-dir {directory}: its parent {parent} {why}; another user could rename the "
      "state directory away and the client would start a new ledger. Allowed: a state-dir "
      "whose every parent is root's or this user's and written by them alone (or sticky, as "
      "/tmp)",
    )


def read_runs_record(
  state: "ClientState", name: str, fmt: int, entry_ok: Callable[[str, Any], bool]
) -> dict:
  """The ``runs`` of a client's JSON record of runs in its state directory, file ``name``
  (``{"format": fmt, "runs": {key: entry}}``; ``{}``: no file), each ``(key, entry)`` passing
  ``entry_ok``.

  Raises:
    ValueError: the file cannot be read as such a record (the reason).
  """
  try:
    text = state.read_text(name)
    if text is None:
      return {}
    data = json.loads(text)
    runs = data["runs"]
    if data.get("format") != fmt or not isinstance(runs, dict):
      raise ValueError(f"format {data.get('format')!r}")
    for key, entry in runs.items():
      if not isinstance(entry, dict) or not entry_ok(key, entry):
        raise ValueError(f"entry {key!r}: {entry!r}")
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(str(e)) from None
  return runs


def _spent(ledger: accounting.PrivacyLedger) -> tuple[int, int]:
  return ledger.rounds, sum(ledger.steps)


class ClientState:
  """One client's state directory (see the module docstring)."""

  def __init__(self, directory: str | os.PathLike):
    directory = Path(directory).expanduser()
    make_private_dirs(directory)
    self.directory = directory.resolve()  # one key per directory in the process's caches
    check_private(self.directory)
    st = os.stat(self.directory)
    self._identity = (st.st_dev, st.st_ino)

  @contextlib.contextmanager
  def _opened(self):
    """The state directory's descriptor, opened without following a link and checked to be
    the directory checked at construction; its files are opened relative to it."""
    fd = os.open(self.directory, os.O_RDONLY | DIRECTORY | NOFOLLOW)
    try:
      st = os.fstat(fd)
      if (st.st_dev, st.st_ino) != self._identity:
        raise LedgerError(
          "state-dir",
          f"state-dir {self.directory} is no longer the directory this client checked (it "
          "was moved or replaced); refusing to read or write its state there. Allowed: the "
          "state directory as this client left it",
        )
      yield fd
    finally:
      os.close(fd)

  def read_text(self, name: str) -> str | None:
    """The text of file ``name`` of the state directory (``None``: no file), read without
    following a link."""
    with self._opened() as d:
      try:
        fd = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=d)
      except FileNotFoundError:
        return None
    with os.fdopen(fd, "r") as f:
      return f.read()

  def write_json(self, name: str, obj) -> None:
    """Writes ``obj`` as JSON (indented, keys sorted) to file ``name`` of the state directory,
    atomically and ``0600``: a temporary of a random name created ``O_EXCL | O_NOFOLLOW``
    relative to the directory's descriptor, ``fsync``, ``os.replace``, ``fsync`` of the
    directory."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    with self._opened() as d:
      _write_at(d, name, lambda f: f.write(data))

  @contextlib.contextmanager
  def locked(self):
    """Holds an exclusive lock on the directory for a round."""
    with self._opened() as d:
      fd = os.open(".lock", os.O_RDWR | os.O_CREAT | NOFOLLOW, FILE_MODE, dir_fd=d)
    with os.fdopen(fd, "r+b") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        yield self
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  # -- the journal -----------------------------------------------------------------

  def _journal_mark(self) -> tuple[int, int] | None:
    """The largest ``(rounds, steps)`` the journal records; None without a journal.

    A torn last line (a crash while appending) is ignored; any other
    unreadable line is refused.
    """
    path = self.directory / JOURNAL_FILE
    text = self.read_text(JOURNAL_FILE)
    if text is None:
      return None
    lines = text.split("\n")
    mark = (0, 0)
    for i, line in enumerate(lines):
      if not line.strip():
        continue
      try:
        entry = json.loads(line)
        mark = max(mark, (int(entry["rounds"]), int(entry["steps"])))
      except (ValueError, KeyError, TypeError):
        if i == len(lines) - 1:  # no newline after it: an append cut short
          break
        raise LedgerError(
          JOURNAL_FILE,
          f"{path} line {i + 1} is not a journal entry ({line[:80]!r}); "
          "refusing to guess the privacy spent. Allowed: the journal this "
          "client appended to",
        ) from None
    return mark

  def _append_journal(self, ledger: accounting.PrivacyLedger) -> None:
    rounds, steps = _spent(ledger)
    line = json.dumps(
      {"rounds": rounds, "steps": steps, "epsilon": ledger.epsilon, "time": time.time()},
      sort_keys=True,
    )
    with self._opened() as d:
      try:
        os.stat(JOURNAL_FILE, dir_fd=d, follow_symlinks=False)
        new = False
      except FileNotFoundError:
        new = True
      flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW
      fd = os.open(JOURNAL_FILE, flags, FILE_MODE, dir_fd=d)
      try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
      finally:
        os.close(fd)
      if new:
        os.fsync(d)

  def _check_not_rolled_back(
    self, ledger: accounting.PrivacyLedger | None, stored: dict | None
  ) -> None:
    where = self.directory / LEDGER_FILE
    mark = self._journal_mark()
    spent = (0, 0) if ledger is None else _spent(ledger)
    if stored is not None and stored.get("journaled") and mark is None:
      raise LedgerError(
        JOURNAL_FILE,
        f"{self.directory / JOURNAL_FILE} is missing, yet {where} was written with it; the "
        "high-water mark of the budget spent is gone, refusing to spend. Allowed: the "
        "state directory as this client left it",
      )
    for name, high in (("journal", mark), ("this process", _HIGH_WATER.get(where))):
      if high is not None and (spent[0] < high[0] or spent[1] < high[1]):
        raise LedgerError(
          LEDGER_FILE,
          f"{where} records {spent[0]} rounds and {spent[1]} noisy steps, but the {name} "
          f"recorded {high[0]} rounds and {high[1]} steps: the spent budget went down (the "
          "ledger was replaced by an older or a missing one). Refusing to spend; allowed: "
          "the ledger this client last wrote",
        )

  # -- the ledger ------------------------------------------------------------------

  def _text(self) -> str | None:
    return self.read_text(LEDGER_FILE)

  def _read(self, text: str | None = None) -> dict | None:
    text = self._text() if text is None else text
    if text is None:
      return None
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise LedgerError(
        LEDGER_FILE,
        f"{self.directory / LEDGER_FILE} is not valid JSON ({e}); refusing "
        "to guess the privacy spent. Allowed: the file this client "
        "wrote",
      ) from None

  def ledger(self, fingerprint: dict, **privacy) -> accounting.PrivacyLedger:
    """The stored ledger of these records, or a new one (``privacy``: PrivacyLedger's fields).

    Restoring recomputes every recorded round's epsilon
    (:meth:`PrivacyLedger.from_dict`); a process that wrote the file itself
    reuses its ledger. A stored ledger of another ``adjacency`` is the same
    spending: it is recomputed with this one.

    Raises:
      LedgerError: the stored ledger describes other records (``fingerprint``)
        or another setting of ``FIXED_PRIVACY_FIELDS``, was tampered with, or
        records less than the journal or this process recorded (module
        docstring).
    """
    where = self.directory / LEDGER_FILE
    text = self._text()
    stored = self._read(text)
    new = accounting.PrivacyLedger(**privacy)
    if stored is None:
      self._check_not_rolled_back(None, None)
      return new
    if stored.get("fingerprint") != fingerprint:
      raise LedgerError(
        "fingerprint",
        f"{where} accounts for other records ({stored.get('fingerprint')}) than this "
        f"client's ({fingerprint}); allowed: the state-dir of these records",
      )
    cached = _WRITTEN.get(where)
    if cached is not None and cached[0] == text:
      ledger = copy.deepcopy(cached[1])
    else:
      try:
        ledger = accounting.PrivacyLedger.from_dict(stored["ledger"])
      except (KeyError, ValueError, TypeError) as e:
        raise LedgerError(LEDGER_FILE, f"{where}: {e}") from None
    self._check_not_rolled_back(ledger, stored)
    differ = [k for k in FIXED_PRIVACY_FIELDS if getattr(ledger, k) != getattr(new, k)]
    diff = [f"{k}: stored {getattr(ledger, k)!r} vs now {getattr(new, k)!r}" for k in differ]
    if diff:
      raise LedgerError(
        differ[0],
        f"{where} composes rounds of another privacy setting ({'; '.join(diff)}); its "
        "rounds cannot be composed with this run's. Allowed: the same noise_multiplier, "
        "batch_size, records and delta",
      )
    if ledger.adjacency != new.adjacency:
      ledger = ledger.with_adjacency(new.adjacency)
    return ledger

  def history(self) -> list[dict]:
    stored = self._read()
    return [] if stored is None else list(stored.get("history", []))

  def rounds_of_run(self, run_id: int) -> int:
    """Rounds the history records as charged in Flower run ``run_id``."""
    return sum(1 for h in self.history() if h.get("run_id") == run_id)

  def epsilon_after(self, ledger: accounting.PrivacyLedger, steps: int) -> float:
    """The epsilon ``ledger`` would show after one more round of ``steps`` (nothing is stored)."""
    return copy.deepcopy(ledger).record_round(steps)  # the copy keeps the composed RDP

  def spend(
    self,
    ledger: accounting.PrivacyLedger,
    fingerprint: dict,
    steps: int,
    max_epsilon: float,
    entry: dict[str, Any],
  ) -> float:
    """Checks the budget, records one round and writes the ledger and the journal (before any
    computation).

    A round that a cheap lower bound of the epsilon after it already puts above
    ``max_epsilon`` is refused without computing that epsilon
    (:meth:`~fedlap_jax.accounting.PrivacyLedger.epsilon_lower_bound_after`), so a far
    exceeded budget costs a fraction of one accounting.

    Raises:
      BudgetExceeded: the epsilon after the round would exceed ``max_epsilon``
        (nothing is recorded).
    """
    at_least = ledger.epsilon_lower_bound_after(steps)
    if at_least > max_epsilon:
      raise BudgetExceeded(ledger.epsilon, at_least, max_epsilon, at_least=True)
    after = ledger.epsilon_after(steps)
    if after > max_epsilon:
      raise BudgetExceeded(ledger.epsilon, after, max_epsilon)
    eps = ledger.record_round(steps)
    history = self.history()
    history.append({**entry, "steps": int(steps), "epsilon": eps, "time": time.time()})
    path = self.directory / LEDGER_FILE
    # Ledger first, then the journal: a crash between them leaves the ledger ahead of the
    # journal (accepted), never behind it.
    self.write_json(
      LEDGER_FILE,
      {
        "fingerprint": fingerprint,
        "ledger": ledger.to_dict(),
        "history": history,
        "journaled": True,
      },
    )
    self._append_journal(ledger)
    _WRITTEN[path] = (self._text() or "", copy.deepcopy(ledger))
    _HIGH_WATER[path] = max(_HIGH_WATER.get(path, (0, 0)), _spent(ledger))
    return eps

  # -- carried state ---------------------------------------------------------------

  def _run_dir(self, run) -> Path:
    """``runs/<run>``: ``run`` a federated run's identity (:mod:`fedlap_flower.federated_runs`),
    32 hex digits, never a path."""
    if not isinstance(run, str) or not RUN_IDENTITY.fullmatch(run):
      raise ValueError(f"{run!r} is not a federated run's identity (32 hex digits)")
    return self.directory / "runs" / run

  @contextlib.contextmanager
  def _run_opened(self, run, create: bool = False):
    """The descriptor of ``runs/<run>`` (``None``: absent and not ``create``), each directory
    opened relative to its parent's descriptor without following a link (with ``create``,
    made ``0700`` first where missing); the carried files are opened relative to it.

    Raises:
      ConfigError: naming ``state-dir``: a link or a file in the place of either directory.
    """
    where = self._run_dir(run)
    opened: list[int] = []
    try:
      with self._opened() as parent:
        for part in ("runs", run):
          if create:
            with contextlib.suppress(FileExistsError):
              os.mkdir(part, DIRECTORY_MODE, dir_fd=parent)
          try:
            parent = os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=parent)
          except FileNotFoundError:
            parent = -1
            break
          except OSError as e:  # ELOOP, ENOTDIR: a link or a file planted there
            raise _carried_error(
              where, f"cannot be opened as a directory without following a link ({e})"
            ) from None
          opened.append(parent)
      yield None if parent < 0 else parent
    finally:
      for fd in opened:
        os.close(fd)

  def carried_path(self, run, server_round: int) -> Path:
    """``runs/<run>/carried-<round>.npz``: the state kept after ``server_round`` of ``run``."""
    return self._run_dir(run) / CARRIED_FILE.format(round=int(server_round))

  def save_carried(self, run, server_round: int, arrays: dict[str, np.ndarray]) -> None:
    """Keeps a client's carried state after ``server_round`` of federated run ``run``: its named
    arrays (:func:`fedlap_flower.method_work.tree_to_arrays` of the carried fields; FedLAP's
    images as ``x``) and the round, written atomically ``0600`` (:meth:`carried_path`) relative
    to the run directory's descriptor (:meth:`_run_opened`)."""
    if CARRIED_ROUND in arrays:
      raise ValueError(f"{CARRIED_ROUND!r} is reserved for the round in a carried state")
    arrays = {**arrays, CARRIED_ROUND: np.asarray(int(server_round), np.int64)}
    with self._run_opened(run, create=True) as d:
      _write_at(d, CARRIED_FILE.format(round=int(server_round)), lambda f: np.savez(f, **arrays))

  def carried_rounds(self, run) -> list[int]:
    """The rounds of ``run`` this client keeps a carried state of, ascending."""
    with self._run_opened(run) as d:
      found = () if d is None else (_CARRIED_NAME.fullmatch(n) for n in os.listdir(d))
      return sorted(int(m.group(1)) for m in found if m)

  def drop_carried(self, run, rounds) -> None:
    """Removes the carried states of ``rounds`` of ``run`` (those no later round can need)."""
    with self._run_opened(run) as d:
      for r in rounds if d is not None else ():
        with contextlib.suppress(FileNotFoundError):
          os.unlink(CARRIED_FILE.format(round=int(r)), dir_fd=d)

  def _load_carried_arrays(self, run, server_round: int) -> dict[str, np.ndarray] | None:
    """The arrays of :meth:`carried_path` (``None``: no file), read relative to the run
    directory's descriptor without following a link.

    Raises:
      ConfigError: naming ``state-dir``: a link, or a file that is not an npz of plain arrays.
    """
    path = self.carried_path(run, server_round)
    with self._run_opened(run) as d:
      if d is None:
        return None
      try:
        fd = os.open(path.name, os.O_RDONLY | NOFOLLOW, dir_fd=d)
      except FileNotFoundError:
        return None
      except OSError as e:  # ELOOP: a link planted at the path
        raise _carried_error(path, f"cannot be opened without following a link ({e})") from None
    try:
      with os.fdopen(fd, "rb") as f, np.load(f, allow_pickle=False) as z:
        return {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
      raise _carried_error(
        path, f"is not an npz of plain arrays ({type(e).__name__}: {e})"
      ) from None

  def load_carried(self, run, server_round: int, expected: Wire) -> dict[str, np.ndarray] | None:
    """The arrays this client kept after ``server_round`` of federated run ``run`` (``None``:
    none kept).

    Raises:
      ConfigError: naming ``state-dir`` and the file: a link there, not an npz, no round or
        another round than its name's, or an array missing, unexpected, of another shape or
        dtype than ``expected``, or not finite (:meth:`fedlap_jax.method.Wire.check`).
    """
    path = self.carried_path(run, server_round)
    arrays = self._load_carried_arrays(run, server_round)
    if arrays is None:
      return None
    held = arrays.pop(CARRIED_ROUND, None)
    if held is None or held.shape != () or not np.issubdtype(held.dtype, np.integer):
      raise _carried_error(path, f"holds no round ({CARRIED_ROUND!r}, an integer)")
    if int(held) != int(server_round):
      raise _carried_error(
        path, f"holds the state of round {int(held)}, not of round {int(server_round)}"
      )
    try:
      expected.check(arrays)
    except ConfigError as e:
      raise _carried_error(path, f"holds {e.field!r} = {e.value!r}; allowed: {e.allowed}") from None
    return arrays


def _write_at(d: int, name: str, write: Callable) -> None:
  """Writes file ``name`` of the directory of descriptor ``d`` through ``write(f)`` (``f`` a
  binary file), atomically and ``0600``: a temporary of a random name created ``O_EXCL |
  O_NOFOLLOW`` relative to ``d``, ``fsync``, ``os.replace``, ``fsync`` of the directory."""
  tmp = f".{name}.tmp{secrets.token_hex(8)}"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, FILE_MODE, dir_fd=d)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp, dir_fd=d)
    raise
  os.fsync(d)


def _carried_error(path: Path, why: str) -> ConfigError:
  return ConfigError(
    "state-dir",
    str(path),
    "the carried state this client wrote",
    message=f"state-dir: the carried state {path} {why}; refusing to compute from it. "
    "Allowed: the file this client wrote in the run's earlier round",
  )
