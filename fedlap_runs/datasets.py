"""Builds the fixed data subsets that the result tables use, with their checksums.

  python -m fedlap_runs.datasets mnist10k            # -> ~/.cache/fedlap_jax/mnist10k.npz (+ .sha256),
                                                     #    read by --config.data.source=subset:mnist10k
  python -m fedlap_runs.datasets fmnist10k --out DIR
  python -m fedlap_runs.datasets --list
  python -m fedlap_runs.datasets mnist_small --idx DIR --out OUT   # research sets from IDX files

Subsets (:data:`SUBSETS`) and the rule that makes each: from the TensorFlow
Datasets copy of ``tfds_name`` (downloaded once by tfds, or read from a prepared
``--data-dir``), in the order tfds reads its splits (``shuffle_files=False``):

* ``x_train, y_train``: the first ``train`` (8,000) records of the ``train`` split;
* ``x_test, y_test``: the first ``test`` (2,000) records of the ``test`` split;
* images ``uint8`` NHWC ``(N, 28, 28, 1)``, labels ``int64`` class indices.

The npz (arrays ``x_train, y_train, x_test, y_test``, the keys every
``--config.data.source=npz:PATH`` reads) is written byte for byte the same on
every build (uncompressed members, fixed timestamps; :func:`write_npz`), so its
SHA-256 identifies the data: ``NAME.npz.sha256`` beside it, in ``sha256sum -c``
format. :data:`PINNED_SHA256` holds the checksum the rule gives on the
published data sets; a build that differs is written, reported and exits 1.

The command prints the client sizes of the paper partition (5 clients x 2
classes, :func:`fedlap_runs.data.partition`) as a check against
:data:`ORIGINAL_PAPER_CLIENT_SIZES`, the sizes of the subset the project's
first result tables were measured on, whose construction was not recorded:
this rule does not reproduce them (docs/results.md, "Data").

Research sets (:data:`RESEARCH_SETS`: ``{mnist,fmnist}_{small,paper}``) are built
from the original IDX files (``--idx DIR``: ``train-images``, ``train-labels``,
``t10k-images``, ``t10k-labels``, each ``*idx3-ubyte`` / ``*idx1-ubyte``, plain
or ``.gz``), not from tfds. The rule (:func:`carve`): a fixed permutation
(``numpy.random.default_rng(0)``) of the 60,000 training records; its first
:data:`VALIDATION_RECORDS` are the validation split, the next ``train`` records the
training records (small: 8,000, ~1,600 per paper-partition client; paper: the other
55,000). Two files share those training records: ``NAME_val.npz`` holds the
validation split under ``x_test, y_test`` (choose recipes on it) and ``NAME.npz``
the data set's own test split (read once per final table).

Offline, with no prepared tfds copy, the command refuses with exit status 2
and says what to do (it never writes a partial subset).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import io
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

from fedlap_runs import catalog
from fedlap_runs import data as data_lib


@dataclasses.dataclass(frozen=True)
class Subset:
  """A subset: the first ``train`` / ``test`` records of tfds ``tfds_name``'s splits."""

  name: str
  tfds_name: str
  train: int
  test: int
  description: str


SUBSETS = {
  s.name: s
  for s in (
    Subset("mnist10k", "mnist", 8_000, 2_000, "MNIST digits, 28x28x1"),
    Subset("fmnist10k", "fashion_mnist", 8_000, 2_000, "Fashion-MNIST, 28x28x1"),
  )
}
NPZ_KEYS = data_lib.NPZ_KEYS
# SHA-256 of NAME.npz as this rule builds it from tfds's mnist / fashion_mnist 3.0.1
# (tensorflow-datasets 4.9.10).
PINNED_SHA256 = {
  "mnist10k": "630652cf19b24514a54a722d3b18577cfb8be61df3278d5e54050aa36e1c0996",
  "fmnist10k": "0541d96decaa0dbf6b47501eb5284fba2018b295c91156edd16d864c6665cade",
}
# Paper-partition client sizes (classes {5,6}, {1,2}, {0,8}, {9,3}, {4,7}) of the subsets
# the first result tables were measured on (None: not recorded).
ORIGINAL_PAPER_CLIENT_SIZES = {"mnist10k": (1513, 1700, 1571, 1570, 1646), "fmnist10k": None}


@dataclasses.dataclass(frozen=True)
class ResearchSet:
  """A research set: ``train`` training records of ``data`` carved by :func:`carve`."""

  name: str
  data: str  # "mnist" | "fashion_mnist"
  train: int
  description: str


VALIDATION_RECORDS = 5_000
RESEARCH_SETS = {
  s.name: s
  for d, data in (("mnist", "mnist"), ("fmnist", "fashion_mnist"))
  for s in (
    ResearchSet(f"{d}_small", data, 8_000, "small clients: 8,000 training records"),
    ResearchSet(f"{d}_paper", data, 55_000, "the paper's regime: 55,000 training records"),
  )
}
IDX_FILES = ("train-images", "train-labels", "t10k-images", "t10k-labels")
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# A fixed zip timestamp (the earliest zip can store) keeps the npz bytes build-independent.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def output_path(name: str, out_dir: str | os.PathLike | None = None) -> Path:
  """Where ``python -m fedlap_runs.datasets NAME [--out DIR]`` writes NAME's npz.

  Without ``out_dir``: :func:`fedlap_runs.data.subset_path`, where
  ``--config.data.source=subset:NAME`` reads it.
  """
  check_name(name)
  return Path(out_dir) / f"{name}.npz" if out_dir else data_lib.subset_path(name)


def check_name(name: str) -> Subset:
  if name not in SUBSETS:
    raise ValueError(f"NAME={name!r} is invalid; allowed: one of {tuple(SUBSETS)}")
  return SUBSETS[name]


def take_subset(subset: Subset, x_train, y_train, x_test, y_test) -> dict[str, np.ndarray]:
  """The rule: the first ``subset.train`` / ``subset.test`` records, as uint8 / int64.

  Args:
    subset: what to take.
    x_train, x_test: ``(N, H, W, C)`` uint8 images of the full splits, in tfds's order.
    y_train, y_test: ``(N,)`` integer labels.

  Returns:
    ``{"x_train": (train, H, W, C) uint8, "y_train": (train,) int64, "x_test": ...,
    "y_test": ...}``, C-contiguous.

  Raises:
    ValueError: a split shorter than the rule needs, or images that are not uint8 NHWC.
  """
  out = {}
  for split, x, y, n in (
    ("train", x_train, y_train, subset.train),
    ("test", x_test, y_test, subset.test),
  ):
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 4 or x.dtype != np.uint8:
      raise ValueError(
        f"{subset.tfds_name} x_{split} has shape {x.shape} and dtype {x.dtype}; "
        "allowed: uint8 NHWC images"
      )
    if len(x) < n or len(y) != len(x):
      raise ValueError(
        f"{subset.tfds_name} {split} split has {len(x)} images and {len(y)} "
        f"labels; allowed: at least {n} of each (the {subset.name} rule)"
      )
    out[f"x_{split}"] = np.ascontiguousarray(x[:n])
    out[f"y_{split}"] = np.ascontiguousarray(y[:n].astype(np.int64))
  return out


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
  """Writes ``arrays`` as an npz whose bytes depend on the arrays only (atomic).

  ``numpy.savez`` stamps each member with the current time; here every member
  is stored uncompressed with a fixed timestamp and permissions, in the order
  of :data:`NPZ_KEYS`, so the same arrays always give the same file.
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
    for key in NPZ_KEYS:
      buf = io.BytesIO()
      np.lib.format.write_array(
        buf, np.ascontiguousarray(arrays[key]), version=(1, 0), allow_pickle=False
      )
      info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE)
      info.create_system = 3  # Unix, on every platform
      info.external_attr = 0o644 << 16
      zf.writestr(info, buf.getvalue())
  os.replace(tmp, path)


def sha256_file(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def read_idx(raw: bytes, what: str = "IDX data") -> np.ndarray:
  """The array of an IDX file's bytes (gzip-compressed or not).

  Raises:
    ValueError: naming ``what``: a bad magic number, type code or length.
  """
  if raw[:2] == b"\x1f\x8b":
    raw = gzip.decompress(raw)
  if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES or raw[3] == 0:
    raise ValueError(
      f"{what} is invalid: header {raw[:4].hex()}; allowed: an IDX file (two zero "
      f"bytes, a type code in {sorted(_IDX_DTYPES)}, the number of dimensions)"
    )
  ndim, dtype = raw[3], np.dtype(_IDX_DTYPES[raw[2]])
  shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
  body = 4 + 4 * ndim
  if len(raw) - body != int(np.prod(shape)) * dtype.itemsize:
    raise ValueError(
      f"{what} is invalid: {len(raw) - body} data bytes for shape {shape}; allowed: "
      f"exactly {int(np.prod(shape)) * dtype.itemsize}"
    )
  return np.frombuffer(raw, dtype, offset=body).reshape(shape).astype(dtype.newbyteorder("="))


def find_idx(idx_dir: str | os.PathLike) -> dict[str, Path]:
  """``{stem: path}`` of :data:`IDX_FILES` in ``idx_dir`` (``stem*idx?-ubyte[.gz]``)."""
  found = {}
  for stem in IDX_FILES:
    paths = sorted(Path(idx_dir).glob(f"{stem}*idx[13]-ubyte*"))
    if len(paths) != 1:
      raise ValueError(
        f"--idx {idx_dir} is invalid: {len(paths)} files match {stem}*idx?-ubyte[.gz]; "
        f"allowed: a directory with exactly one of each of {IDX_FILES}"
      )
    found[stem] = paths[0]
  return found


def carve(research: ResearchSet, x_train, y_train, x_test, y_test) -> dict[str, dict]:
  """The research rule (module docstring): ``{"val": arrays, "test": arrays}``.

  ``x_*``: ``(N, 28, 28)`` or NHWC uint8 images of the full splits; ``y_*``: labels.
  Both results hold the same training records (uint8 NHWC, int64 labels).
  """
  x_train, x_test = (np.asarray(x) for x in (x_train, x_test))
  x_train, x_test = (x[..., None] if x.ndim == 3 else x for x in (x_train, x_test))
  n, need = len(x_train), VALIDATION_RECORDS + research.train
  if n < need or len(y_train) != n:
    raise ValueError(
      f"the train split has {n} images and {len(y_train)} labels; allowed: at least "
      f"{need} of each ({VALIDATION_RECORDS} validation + {research.train} training, "
      f"the {research.name} rule)"
    )
  order = np.random.default_rng(0).permutation(n)
  val, train = order[:VALIDATION_RECORDS], order[VALIDATION_RECORDS:need]
  common = {"x_train": x_train[train], "y_train": np.asarray(y_train)[train]}
  out = {}
  for split, (x, y) in (
    ("val", (x_train[val], np.asarray(y_train)[val])),
    ("test", (x_test, y_test)),
  ):
    arrays = {**common, "x_test": x, "y_test": np.asarray(y)}
    out[split] = {
      k: np.ascontiguousarray(v.astype(np.int64) if k[0] == "y" else v) for k, v in arrays.items()
    }
  return out


def build_research(name: str, idx_dir, out_dir=None) -> dict:
  """Writes ``NAME_val.npz`` and ``NAME.npz`` (+ ``.sha256``) from the IDX files in ``idx_dir``.

  Returns:
    ``{"paths", "sha256", "client_sizes"}`` (paths and checksums: validation, test).
  """
  research = RESEARCH_SETS[name]
  files = find_idx(idx_dir)
  raw = [read_idx(files[stem].read_bytes(), str(files[stem])) for stem in IDX_FILES]
  carved = carve(research, *raw)
  out = Path(out_dir) if out_dir else data_lib.cache_root()
  paths, digests = [], []
  for split, stem in (("val", f"{name}_val"), ("test", name)):
    path = out / f"{stem}.npz"
    write_npz(path, carved[split])
    digest = sha256_file(path)
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    paths.append(path)
    digests.append(digest)
  return {
    "paths": paths,
    "sha256": digests,
    "client_sizes": paper_client_sizes(carved["val"]["y_train"]),
  }


def paper_client_sizes(y_train: np.ndarray) -> tuple[int, ...]:
  """Record counts of the paper partition's 5 clients (2 classes each) of ``y_train``."""
  parts = data_lib.partition(np.asarray(y_train), num_clients=5, scheme="paper", num_classes=10)
  return tuple(int(len(p)) for p in parts)


def build(
  name: str,
  out_dir: str | os.PathLike | None = None,
  *,
  data_dir: str | None = None,
  cache_dir: str = "",
) -> dict:
  """Builds NAME's npz and its ``.sha256`` file from tfds (see the module docstring).

  Args:
    name: one of :data:`SUBSETS`.
    out_dir: where to write (default: the data cache, :func:`fedlap_runs.data.cache_root`).
    data_dir: a tfds data_dir holding a prepared copy (default: tfds's own).
    cache_dir: :func:`fedlap_runs.data.load_tfds`'s cache of the full data set
      (``""``: the default cache, ``"none"``: no cache).

  Returns:
    ``{"path", "sha256", "pinned", "client_sizes"}`` (``pinned``: the expected
    checksum, ``""`` where none is pinned).

  Raises:
    fedlap_runs.data.DataUnavailableError: offline and no prepared copy.
  """
  subset = check_name(name)
  raw = data_lib.load_tfds(subset.tfds_name, data_dir=data_dir, cache_dir=cache_dir)
  arrays = take_subset(subset, *raw)
  path = output_path(name, out_dir)
  write_npz(path, arrays)
  digest = sha256_file(path)
  path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
  return {
    "path": path,
    "sha256": digest,
    "pinned": PINNED_SHA256.get(name, ""),
    "client_sizes": paper_client_sizes(arrays["y_train"]),
  }


def _list(out_dir) -> None:
  for subset in SUBSETS.values():
    path = output_path(subset.name, out_dir)
    state = "not built"
    if path.exists():
      digest = sha256_file(path)
      pinned = PINNED_SHA256.get(subset.name, "")
      state = (
        "built, checksum as pinned"
        if digest == pinned
        else f"built, sha256 {digest}" + (" (differs from the pinned one)" if pinned else "")
      )
    print(
      f"{subset.name}: {subset.description}; first {subset.train:,} train / "
      f"{subset.test:,} test records of tfds {subset.tfds_name!r}; {path}: {state}"
    )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m fedlap_runs.datasets", description=__doc__.splitlines()[0]
  )
  parser.add_argument("name", nargs="?", help=f"one of {', '.join([*SUBSETS, *RESEARCH_SETS])}")
  parser.add_argument(
    "--out",
    default=None,
    help=f"output directory (default: the data cache, {data_lib.cache_root()})",
  )
  parser.add_argument(
    "--data-dir", default=None, help="a tfds data_dir with a prepared copy (default: tfds's own)"
  )
  parser.add_argument(
    "--cache-dir",
    default="",
    help="fedlap_runs.data's cache of the full data set (default: the data "
    "cache; 'none': no cache), as --config.data.cache_dir",
  )
  parser.add_argument(
    "--idx",
    default=None,
    help=f"a directory of the original IDX files (needed by {', '.join(RESEARCH_SETS)})",
  )
  parser.add_argument("--list", action="store_true", help="list the subsets and what is built")
  args = parser.parse_args(argv)
  if args.list:
    _list(args.out)
    return 0
  if args.name is None:
    parser.error(f"NAME is required; allowed: one of {(*SUBSETS, *RESEARCH_SETS)} (or --list)")
  if args.name in RESEARCH_SETS:
    if args.idx is None:
      parser.error(f"--idx DIR is required for {args.name} (a research set built from IDX files)")
    try:
      result = build_research(args.name, args.idx, args.out)
    except (ValueError, OSError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    for path, digest in zip(result["paths"], result["sha256"]):
      print(f"wrote {path}\nsha256 {digest}")
    print(f"paper-partition client sizes: {', '.join(map(str, result['client_sizes']))}")
    return 0
  try:
    result = build(args.name, args.out, data_dir=args.data_dir, cache_dir=args.cache_dir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except data_lib.DataUnavailableError:
    subset = SUBSETS[args.name]
    host, port = catalog.ROWS[subset.tfds_name].download
    where = args.data_dir or "tfds's default data_dir"
    print(
      f"error: cannot build {args.name}: tfds has no prepared copy of "
      f"{subset.tfds_name!r} under {where} and its download host {host}:{port} is "
      "unreachable (this machine looks offline). Run this command once on a machine with "
      "internet access (tfds downloads and prepares the data), or pass --data-dir DIR "
      "with a tfds data_dir that holds a prepared copy. Nothing was written.",
      file=sys.stderr,
    )
    return 2
  sizes = result["client_sizes"]
  original = ORIGINAL_PAPER_CLIENT_SIZES.get(args.name)
  print(f"wrote {result['path']}\nsha256 {result['sha256']}  ({result['path']}.sha256)")
  print(f"paper-partition client sizes: {', '.join(map(str, sizes))}")
  if original is not None:
    same = "the same" if tuple(original) == sizes else "different"
    print(f"  the first result tables' subset had {', '.join(map(str, original))}: {same}")
  pinned = result["pinned"]
  if not pinned:
    print("no checksum is pinned for this subset: pin the one above")
    return 0
  if result["sha256"] != pinned:
    print(
      f"error: the checksum differs from the pinned one, {pinned}: tfds gave other records "
      "or another order (another tfds or dataset version?); the file is kept for "
      "inspection",
      file=sys.stderr,
    )
    return 1
  print("checksum: as pinned")
  return 0


if __name__ == "__main__":
  sys.exit(main())
