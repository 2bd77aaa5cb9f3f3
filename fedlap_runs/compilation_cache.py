"""Compile once per machine: JAX's persistent compilation cache for the programs a run builds.

A run's round program takes XLA tens of seconds to compile, every time a process
starts. With the cache on, the compiled executables are kept on disk, and a later
process that builds the same program (the same config on the same machine, a resumed
run, a Flower client's next round) reads it back instead: what it still pays is
tracing and lowering the program, and reading the entry.

Where it lives (:func:`resolve`, the first that applies):

1. the config field ``compilation_cache_dir``: a directory, or ``"none"`` (off);
2. the environment variable ``FEDLAP_COMPILATION_CACHE``: the same;
3. JAX's own setting, when something set it already (``JAX_COMPILATION_CACHE_DIR``,
   ``jax.config``);
4. ``~/.cache/fedlap_jax/jax_compilation_cache``, beside the data cache
   (:func:`fedlap_runs.data.cache_root`).

What is kept, and up to what size: :func:`enable`. Entries are keyed by JAX
(``jax/_src/cache_key.py``: the program, the jaxlib version, the backend, ``XLA_FLAGS``, the
compile options and the devices), so another JAX version, device or set of flags compiles
afresh; an entry is locked while it is written and read, so concurrent processes (a Flower
SuperNode's ClientApps) share one directory.

Whoever can write to the cache directory can make a process that reads it run their
code (JAX's own warning), so the directory must belong to this user and be writable
by no one else: it is created ``0700``, and one that another user owns or that group
or others may write is refused (:func:`enable`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fedlap_jax.checks import ConfigError

FIELD = "compilation_cache_dir"
ENV = "FEDLAP_COMPILATION_CACHE"
OFF = "none"
DIRNAME = "jax_compilation_cache"
# Programs that took less than this to compile are not kept: a locked write of an entry costs
# ~5 ms plus ~0.05 ms per entry already in the cache (the size limit's scan), more than the
# single-operation programs of eager code (10-60 ms on two cores) save. A round program, the
# model's initialisation under jit and the evaluation all take longer.
MIN_COMPILE_SECS = 0.1
# The cache's size limit (bytes); beyond it, the least recently used entries are removed.
MAX_BYTES = 1 << 30
# JAX's own environment variables for the two numbers (read by JAX when it starts).
MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
MAX_BYTES_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"


def default_dir() -> Path:
  """``~/.cache/fedlap_jax/jax_compilation_cache``: beside the data cache."""
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  return data_lib.cache_root() / DIRNAME


def resolve(setting: str = "", *, field: str = FIELD) -> Path | None:
  """The cache directory ``setting`` (a config's ``compilation_cache_dir``) stands for.

  ``""`` defers to ``$FEDLAP_COMPILATION_CACHE``, then to JAX's own setting, then to
  :func:`default_dir` (see the module docstring); ``"none"`` (field or variable) turns the
  cache off and gives ``None``. A relative path is taken from the current directory.

  Raises:
    ConfigError: ``setting`` is not a string (naming ``field``).
  """
  import jax  # pylint: disable=g-import-not-at-top

  if not isinstance(setting, str):
    raise ConfigError(field, setting, f"a directory, '' (the default) or {OFF!r} (no cache)")
  value = setting or os.environ.get(ENV, "")
  if value == OFF:
    return None
  if value:
    return Path(os.path.abspath(os.path.expanduser(value)))
  given = jax.config.jax_compilation_cache_dir
  if given:
    return Path(os.path.abspath(os.path.expanduser(given)))
  return default_dir()


def _private_directory(path: Path, field: str) -> None:
  """Creates ``path`` (``0700``) if needed; refuses one that others could write to."""
  allowed = (
    f"a directory this user owns and only this user may write, '' (the default) or {OFF!r} "
    "(no cache)"
  )
  try:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
  except OSError as e:
    raise ConfigError(
      field,
      str(path),
      allowed,
      message=f"{field}={str(path)!r} is invalid: the compilation cache cannot be created "
      f"there ({e.strerror or e}); allowed: {allowed}",
    ) from None
  if not stat.S_ISDIR(info.st_mode):
    raise ConfigError(
      field,
      str(path),
      allowed,
      message=f"{field}={str(path)!r} is invalid: it is not a directory; allowed: {allowed}",
    )
  why = None
  if hasattr(os, "getuid") and info.st_uid != os.getuid():
    why = "another user owns it"
  elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    why = f"group or others may write to it (mode {stat.filemode(info.st_mode)})"
  if why:
    raise ConfigError(
      field,
      str(path),
      allowed,
      message=f"{field}={str(path)!r} is invalid: {why}, and whoever can write to a "
      f"compilation cache can make this process run their code; allowed: {allowed}",
    )


def prepare(setting: str = "", *, field: str = FIELD) -> Path | None:
  """The directory of ``setting`` (:func:`resolve`), created if needed and checked; JAX's
  settings are left alone (:func:`enable` applies them).

  Raises:
    ConfigError: as :func:`enable`.
  """
  path = resolve(setting, field=field)
  if path is not None:
    _private_directory(path, field if setting or not os.environ.get(ENV) else ENV)
  return path


def enable(setting: str = "", *, field: str = FIELD) -> Path | None:
  """Turns JAX's persistent compilation cache on (or off) for this process.

  ``setting`` is resolved by :func:`resolve`. With a directory, JAX keeps every program
  that took at least :data:`MIN_COMPILE_SECS` to compile there, up to :data:`MAX_BYTES`
  (unless JAX's own environment variables set these numbers). The setting applies to the
  programs compiled from now on; calling it again with another setting switches.

  Returns:
    The directory, or ``None`` when the cache is off.

  Raises:
    ConfigError: naming ``field`` (or ``FEDLAP_COMPILATION_CACHE`` when the value came from
      there): not a string, a directory that cannot be created, or one that another user
      owns or that group or others may write to.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import (  # pylint: disable=g-import-not-at-top
    compilation_cache as jax_cache,
  )

  path = prepare(setting, field=field)

  def opened_with():  # what JAX reads when it opens its cache (the threshold it reads per entry)
    return (
      jax.config.jax_enable_compilation_cache,
      jax.config.jax_compilation_cache_dir,
      jax.config.jax_compilation_cache_max_size,
    )

  before = opened_with()
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if MIN_COMPILE_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    if MAX_BYTES_ENV not in os.environ:
      jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  if opened_with() != before:  # JAX opens its cache once; it reopens after a reset
    jax_cache.reset_cache()
  return path
