"""Crash-safe run state: orbax checkpoints, the metrics log, atomic JSON files.

A checkpoint (``WORKDIR/checkpoints/<round>/``) holds two items written by one
``orbax.checkpoint.CheckpointManager`` save:

* ``state``: the algorithm's whole state pytree (global parameters, synthetic
  sets, optimiser states, the PRNG key, the round counter), flattened to a dict
  of arrays; typed PRNG keys are stored as their raw ``key_data`` and wrapped
  again on restore.
* ``meta``: JSON with the privacy ledger (:meth:`PrivacyLedger.to_dict`), the
  privacy fingerprint of the run and the number of metrics records covered.

Orbax writes a save into a temporary directory and renames it into place when
it is complete, so a crash during a save leaves the previous checkpoint as the
latest usable one (unfinished temporaries are ignored and cleaned up).

``metrics.jsonl`` holds one JSON record per line, appended with flush + fsync;
:func:`read_metrics` skips a torn last line, and :func:`truncate_metrics`
atomically drops records beyond the restored round, so a resumed run's log
equals an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.types import PyTree

# A round's timing (it depends on the round's Poisson draws, so it is not covered by the
# guarantee): its own file, beside the releasable metrics.jsonl (both front ends).
TIMING_FILE = "timing.jsonl"
TIMING_FIELDS = ("round_seconds", "wall_seconds", "first_in_process")


def write_atomic(
  path: str | os.PathLike, write: Callable[[BinaryIO], Any], *, mode: int = 0o666
) -> None:
  """Writes ``path`` through ``write(f)`` (``f`` a binary file) so a kill leaves the old file or
  the new one, never a mix: a temporary file, fsync, ``os.replace``, fsync of the directory.

  The temporary has a random name in ``path``'s directory and is created with ``O_CREAT |
  O_EXCL | O_NOFOLLOW``: nothing planted there beforehand (a file, a symbolic link) is
  followed, truncated or reused, and ``os.replace`` replaces a link at ``path`` itself, never
  its target. ``mode``: the new file's permission bits (the umask applies; ``0o600`` for a
  file only its owner may read).
  """
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp{secrets.token_hex(8)}")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except Exception:
    tmp.unlink(missing_ok=True)
    raise
  _fsync_directory(path.parent)


def write_json_atomic(path: str | os.PathLike, obj, *, mode: int = 0o666) -> None:
  """Writes ``obj`` as JSON (indented, keys sorted) to ``path`` with :func:`write_atomic`."""
  text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"
  write_atomic(path, lambda f: f.write(text.encode()), mode=mode)


def _fsync_directory(directory: Path) -> None:
  """Makes a rename in ``directory`` durable (where the platform allows opening directories)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def check_writable(directory: str | os.PathLike) -> None:
  """Creates ``directory`` if needed and writes, syncs and removes a probe file in it.

  Raises:
    NotADirectoryError: ``directory`` (or a parent) is an existing file.
    OSError: it cannot be created or written (read-only, immutable, no space).
  """
  directory = Path(directory)
  if directory.exists() and not directory.is_dir():
    raise NotADirectoryError(f"{directory} is an existing file, not a directory")
  directory.mkdir(parents=True, exist_ok=True)
  probe = directory / f".write_probe{os.getpid()}"
  with open(probe, "w") as f:
    f.write("probe\n")
    f.flush()
    os.fsync(f.fileno())
  probe.unlink()


def _json_default(o):
  if isinstance(o, (np.integer,)):
    return int(o)
  if isinstance(o, (np.floating,)):
    return float(o)
  if isinstance(o, np.ndarray):
    return o.tolist()
  if isinstance(o, tuple):
    return list(o)
  raise TypeError(f"not JSON serialisable: {type(o)}")


# ----------------------------------------------------------------------------
# metrics.jsonl
# ----------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """All complete records of a metrics file (a torn last line is skipped)."""
  path = Path(path)
  if not path.exists():
    return []
  records = []
  with open(path) as f:
    for line in f:
      if not line.endswith("\n"):
        break  # torn write of the last record
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


def truncate_metrics(path: str | os.PathLike, max_round: int) -> list[dict]:
  """Keeps the records with ``round <= max_round`` (atomic rewrite); returns them."""
  path = Path(path)
  kept = [r for r in read_metrics(path) if r.get("round", 0) <= max_round]
  text = "".join(json.dumps(r, default=_json_default) + "\n" for r in kept)
  write_atomic(path, lambda f: f.write(text.encode()))
  return kept


def append_metrics(path: str | os.PathLike, record: dict) -> None:
  """Appends one record as a single line, flushed and fsync'ed."""
  line = json.dumps(record, default=_json_default) + "\n"
  with open(path, "a") as f:
    f.write(line)
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------
# State <-> flat dict of arrays.
# ----------------------------------------------------------------------------


def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaf_names(tree: PyTree) -> list[str]:
  paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  names = []
  for i, (path, _) in enumerate(paths):
    label = re.sub(r"[^A-Za-z0-9_]+", "_", jax.tree_util.keystr(path)).strip("_")
    names.append(f"{i:04d}_{label}"[:120])
  return names


def flatten_state(state: PyTree) -> dict[str, np.ndarray]:
  """``{name: array}`` of every leaf; typed PRNG keys become their ``key_data``."""
  leaves = jax.tree.leaves(state)
  return {
    name: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
    for name, x in zip(_leaf_names(state), leaves)
  }


def unflatten_state(flat: dict[str, Any], template: PyTree) -> PyTree:
  """Inverse of :func:`flatten_state` with ``template``'s structure, dtypes and key impls."""
  names = _leaf_names(template)
  leaves, treedef = jax.tree.flatten(template)
  missing = [n for n in names if n not in flat]
  if missing or len(flat) != len(names):
    raise ValueError(
      f"checkpoint does not match this run's state: missing leaves {missing[:5]}, "
      f"{len(flat)} stored vs {len(names)} expected; allowed: a checkpoint "
      "written by the same method and config"
    )
  out = []
  for name, t in zip(names, leaves):
    v = np.asarray(flat[name])
    if _is_key(t):
      out.append(jax.random.wrap_key_data(jnp.asarray(v), impl=jax.random.key_impl(t)))
      continue
    if v.shape != np.shape(t):
      raise ValueError(
        f"checkpoint leaf {name} has shape {v.shape}, expected {np.shape(t)}; "
        "allowed: a checkpoint written by the same config"
      )
    out.append(jnp.asarray(v, dtype=jnp.asarray(t).dtype))
  return jax.tree.unflatten(treedef, out)


def _abstract(flat: dict[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]:
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}


# ----------------------------------------------------------------------------
# Checkpointer.
# ----------------------------------------------------------------------------


class Checkpointer:
  """Round-indexed orbax checkpoints of ``(state, meta)`` in ``directory``.

  Args:
    directory: where checkpoints live (created if missing).
    keep: how many most recent checkpoints to keep (>= 1).
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    self._ocp = ocp
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=False, create=True, cleanup_tmp_directories=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_round(self) -> int | None:
    """The round of the newest complete checkpoint, or ``None``."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_rounds(self) -> list[int]:
    self._manager.reload()
    return list(self._manager.all_steps())

  def save(self, round_index: int, state: PyTree, meta: dict) -> None:
    """Saves ``state`` and the JSON ``meta`` as checkpoint ``round_index`` (atomic).

    The ``meta`` item is written after the ``state`` item.
    """
    ocp = self._ocp
    meta = json.loads(json.dumps(meta, default=_json_default))
    self._manager.save(
      int(round_index),
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(flatten_state(state)), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )
    self._manager.wait_until_finished()

  def set_aside(self, round_index: int, destination: str | os.PathLike) -> Path:
    """Moves checkpoint ``round_index`` (e.g. a damaged one) to ``destination/<round>``
    (``.1``, ``.2``, ... appended if taken); returns the new path. Nothing is deleted."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    target = destination / str(int(round_index))
    n = 0
    while target.exists():
      n += 1
      target = destination / f"{int(round_index)}.{n}"
    os.replace(self.directory / str(int(round_index)), target)
    self._manager.reload()
    return target

  def read_meta(self, round_index: int) -> dict:
    """The JSON ``meta`` item of checkpoint ``round_index`` alone (no arrays read)."""
    ocp = self._ocp
    restored = self._manager.restore(
      int(round_index), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )
    return dict(restored["meta"])

  def restore(self, template: PyTree, round_index: int | None = None) -> tuple[PyTree, dict]:
    """Restores ``(state, meta)``; ``template`` supplies structure and key types."""
    ocp = self._ocp
    if round_index is None:
      round_index = self.latest_round()
    if round_index is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._manager.restore(
      int(round_index),
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract(flatten_state(template))),
        meta=ocp.args.JsonRestore(),
      ),
    )
    return unflatten_state(restored["state"], template), dict(restored["meta"])

  def close(self) -> None:
    self._manager.close()
