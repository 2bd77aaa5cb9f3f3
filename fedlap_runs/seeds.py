"""A run's secret seed: given, drawn from the operating system's entropy, or read back.

The seed keys every pseudo-random draw of a run (model initialisation, Poisson sampling,
noise): whoever knows it recomputes the noise of a DP run. So (README, "The seed"):

* ``config.seed`` given (an integer, ``--config.seed=S``): used as is. Under DP a given seed
  is guessable (0, or 1, 2 of a sweep), so the run says that its outputs are not private: it
  reproduces a run, it may not be published as one.
* ``config.seed = None`` (the default) under DP: :data:`SEED_BITS` bits of the operating
  system's entropy (:func:`draw`), kept in the work dir's ``config.json`` (secret). A re-run
  on the same work dir reads it back (:func:`resolve`), so the run resumes; a new seed is never
  drawn for a work dir that holds a run, and a run that differs from the one that drew the
  seed is refused (:func:`experiments.resume.check_seed_binding`).
* ``config.seed = None`` without DP: 0.

Keys (:func:`run_key`): a seed below :data:`DRAWN_MIN` is ``jax.random.key(seed)`` (threefry,
as every seed before); a drawn seed keys an ``rbg`` PRNG whose key data holds all 128 bits (a
threefry key holds 64 bits, of which ``jax.random.key`` fills 32), as the Flower app's DP
clients draw their round keys.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedlap_jax.checks import ConfigError

SEED_BITS = 128
# Drawn seeds are at least this; smaller seeds key threefry as jax.random.key(seed) always did.
DRAWN_MIN = 2**64
# Seeds a config may give (config.seed): the integers below this.
SEED_LIMIT = 2**SEED_BITS
# How a run came by its seed (run_info.json's "seed_origin"; the value itself is secret).
GIVEN, DRAWN, DEFAULT = "given", "drawn", "default"


class Seed(NamedTuple):
  """A resolved seed.

  Attributes:
    value: the seed (secret under DP).
    origin: :data:`GIVEN` (the config's), :data:`DRAWN` (operating-system entropy, this run or
      the work dir's earlier one) or :data:`DEFAULT` (0, a run without DP).
    resumed: read back from the work dir's ``config.json``.
  """

  value: int
  origin: str
  resumed: bool = False

  @property
  def private(self) -> bool:
    """Whether the seed is fit for a DP run whose outputs are released (drawn)."""
    return self.origin == DRAWN


def draw() -> int:
  """:data:`SEED_BITS` bits of the operating system's entropy (``secrets``), at least
  :data:`DRAWN_MIN` (a draw below it, probability ``2**-64``, is drawn again)."""
  while (seed := secrets.randbits(SEED_BITS)) < DRAWN_MIN:
    pass
  return seed


class SeedError(ValueError):
  """A work dir holds a run whose seed cannot be read back."""


def stored_seed(workdir: Path) -> tuple[int | None, str | None]:
  """The seed in ``workdir/config.json`` and its origin in ``run_info.json`` (None if absent)."""
  seed = origin = None
  try:
    seed = json.loads((workdir / "config.json").read_text()).get("seed")
  except (OSError, ValueError, AttributeError):
    pass
  try:
    origin = json.loads((workdir / "run_info.json").read_text()).get("seed_origin")
  except (OSError, ValueError, AttributeError):
    pass
  if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
    seed = None
  return seed, origin if origin in (GIVEN, DRAWN, DEFAULT) else None


def holds_checkpoints(workdir: Path) -> bool:
  checkpoints = workdir / "checkpoints"
  return checkpoints.is_dir() and any(checkpoints.iterdir())


def resolve(seed: int | None, *, private: bool, workdir: str | Path | None) -> Seed:
  """The seed of a run with ``config.seed = seed`` (``private``: DP on) in ``workdir``
  (``None``: no work dir to read a seed back from).

  Raises:
    SeedError: ``seed`` is None under DP and ``workdir`` holds checkpoints but no seed in its
      ``config.json`` (removed before sharing the work dir?): drawing a new one would start
      another run over this one's ledger.
  """
  stored, origin = (None, None) if workdir is None else stored_seed(Path(workdir))
  if seed is not None:
    return Seed(int(seed), GIVEN, resumed=stored == seed)
  if stored is not None:
    inferred = DRAWN if stored >= DRAWN_MIN else (DEFAULT if not private and stored == 0 else GIVEN)
    return Seed(stored, origin or inferred, resumed=True)
  if not private:
    return Seed(0, DEFAULT)
  if workdir is not None and holds_checkpoints(Path(workdir)):
    raise SeedError(
      f"refusing to resume {workdir}: it holds checkpoints but its config.json has no seed, "
      "and a DP run's seed is drawn only for a new run (a new seed would start another run "
      "over this one's privacy ledger); allowed: put the run's seed back into config.json, "
      "give it as --config.seed=SEED, or use a new --workdir"
    )
  return Seed(draw(), DRAWN)


def run_key(seed: int):
  """The PRNG key of ``seed``: ``jax.random.key(seed)`` below :data:`DRAWN_MIN`, else an
  ``rbg`` key holding the seed's 128 bits (four ``uint32`` words)."""
  import jax  # pylint: disable=g-import-not-at-top

  if not 0 <= seed < SEED_LIMIT:
    raise ConfigError("seed", seed, f"an integer in [0, 2**{SEED_BITS})")
  if seed < DRAWN_MIN:
    return jax.random.key(seed)
  words = np.array([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)], dtype=np.uint32)
  return jax.random.wrap_key_data(words, impl="rbg")


def describe(seed: Seed, *, private: bool) -> str | None:
  """The line ``train.log`` gives about the seed of a DP run (never its value); None without
  DP."""
  if not private:
    return None
  if seed.origin == DRAWN:
    how = (
      "the one drawn for this work dir, read back from config.json"
      if seed.resumed
      else f"drawn from the operating system's entropy ({SEED_BITS} bits)"
    )
    return f"seed: {how}; it is in config.json, which must stay secret (with checkpoints/)"
  return (
    "WARNING the seed was given (--config.seed): a given seed is guessable, so this run's "
    "outputs are not private (they reproduce a run; do not publish them as private); leave "
    "--config.seed out to draw one from the operating system's entropy"
  )
