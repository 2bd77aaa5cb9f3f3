r"""Packs what a DP run may release into one archive, with no time in it.

  python -m experiments.release RUN_DIR OUT.tar.gz [--allow-not-private]

The archive holds exactly the files ``summary.md`` calls releasable
(:data:`experiments.outputs.RELEASABLE`, docs/privacy.md): ``synthetic/``, ``metrics.jsonl``,
``privacy_ledger.json``, ``run_info.json``, ``summary.md``, ``train.log``, the plots
(``*.png``) and ``config.json`` without its seed, under a folder named after ``RUN_DIR``.
Never the seed, ``checkpoints/``, ``timing.jsonl`` or anything else of the work dir.

Its files carry no time: each round's write time, to the second, is in a work dir's file
times (``tar`` and ``rsync -a`` carry them along), and how long a round took depends on its
Poisson draws (docs/privacy.md, "Not covered"). So every member's time is 0 (1970-01-01),
its owner 0 with no user or group name, its mode 0644, and the gzip header holds no time and
no file name (NumPy dates the ``.npz`` sets' zip entries 1980-01-01 whenever they are
written). Two archives of the same run are equal byte for byte.

A run whose outputs are not private is refused (exit status 2): its seed was given
(``--config.seed``: guessable), it ran without DP, or its ``metrics.jsonl`` holds raw
statistics (``debug_nonprivate_stats``). ``--allow-not-private`` packs it anyway (to share a
reproduction, not a private release). Exit status 0 once ``OUT`` is written (atomically).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import tarfile
from pathlib import Path

from experiments import outputs

from fedlap_runs import seeds


class ReleaseError(ValueError):
  """The run cannot be released as asked (``field``: what refuses it)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


def _without_seed(path: Path) -> bytes:
  config = json.loads(path.read_text())
  config.pop("seed", None)
  return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def releasable(run_dir: Path) -> dict[str, bytes]:
  """``{name in the run dir: contents to release}`` of :data:`experiments.outputs.RELEASABLE`
  (the ones the run wrote: a run without plots has no ``*.png``)."""

  def files(pattern):
    return sorted(p for p in run_dir.glob(pattern) if p.is_file() and not p.name.startswith("."))

  readers = {
    "synthetic/": lambda: {f"synthetic/{p.name}": p.read_bytes() for p in files("synthetic/*")},
    "the plots (*.png)": lambda: {p.name: p.read_bytes() for p in files("*.png")},
    "config.json without its seed": lambda: {"config.json": _without_seed(run_dir / "config.json")},
  }
  out = {}
  for name in outputs.RELEASABLE:
    if name in readers:
      out.update(readers[name]())
    elif "/" in name or " " in name:  # an entry this module does not know how to pack
      raise ValueError(f"outputs.RELEASABLE entry {name!r} has no reader in experiments.release")
    elif (run_dir / name).is_file():
      out[name] = (run_dir / name).read_bytes()
  return dict(sorted(out.items()))


def _check(run_dir: Path, allow_not_private: bool) -> None:
  if not (run_dir / "summary.md").is_file() or not (run_dir / "run_info.json").is_file():
    raise ReleaseError(
      f"RUN_DIR={str(run_dir)!r} is invalid: no summary.md / run_info.json; allowed: the work "
      "dir of a finished run of experiments.run (a suite's runs are in its subfolders)",
      "RUN_DIR",
    )
  info = json.loads((run_dir / "run_info.json").read_text())
  why = None
  if info.get("delta") is None:
    why = ("dp", "it ran without DP: nothing in it is private")
  elif info.get("seed_origin") != seeds.DRAWN:
    why = (
      "seed_origin",
      f"its seed was {info.get('seed_origin')} (--config.seed), and a given seed is "
      "guessable: whoever guesses it recomputes every noise draw",
    )
  elif info.get("nonprivate_stats"):
    why = ("nonprivate_stats", "its metrics.jsonl holds raw statistics of the clients' records")
  if why and not allow_not_private:
    raise ReleaseError(
      f"refusing to release {run_dir}: {why[1]}. Allowed: a DP run whose seed was drawn "
      "(leave --config.seed out), or --allow-not-private to pack it as a reproduction, not a "
      "private release",
      why[0],
    )


def pack(run_dir: str | os.PathLike, out: str | os.PathLike, *, allow_not_private=False) -> list:
  """Writes ``out`` (a ``.tar.gz`` of :func:`releasable`, timeless) and returns its member
  names.

  Raises:
    ReleaseError: ``run_dir`` is no finished run, or its outputs are not private and
      ``allow_not_private`` is off; nothing is written then.
  """
  run_dir, out = Path(run_dir), Path(out)
  _check(run_dir, allow_not_private)
  folder = run_dir.resolve().name
  raw = io.BytesIO()
  with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
    for name, data in releasable(run_dir).items():
      member = tarfile.TarInfo(f"{folder}/{name}")
      member.size, member.mode, member.mtime = len(data), 0o644, 0
      member.uid = member.gid = 0
      member.uname = member.gname = ""
      tar.addfile(member, io.BytesIO(data))
  packed = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0) as gz:
    gz.write(raw.getvalue())
  tmp = out.with_name(f".{out.name}.tmp")
  tmp.write_bytes(packed.getvalue())
  os.replace(tmp, out)
  with tarfile.open(out) as tar:
    return tar.getnames()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m experiments.release", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("run_dir", help="a finished DP run's work dir")
  parser.add_argument("out", help="the archive to write (.tar.gz)")
  parser.add_argument(
    "--allow-not-private",
    action="store_true",
    help="pack a run with a given seed, without DP or with raw statistics (not private)",
  )
  args = parser.parse_args(argv)
  try:
    names = pack(args.run_dir, args.out, allow_not_private=args.allow_not_private)
  except (ReleaseError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {len(names)} files")
  return 0


if __name__ == "__main__":
  sys.exit(main())
