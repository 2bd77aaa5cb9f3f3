"""Datasets and client partitions for the experiments (host side, NumPy).

Sources (``config.data.source``):

* ``tfds``: ``mnist``, ``fashion_mnist``, ``cifar10``, ``svhn_cropped`` (the rows of
  :mod:`fedlap_runs.catalog` that tfds serves) through TensorFlow Datasets (installed by the
  extra ``paper-data``, imported by nothing else), read once into NumPy and cached as ``.npz`` (under
  ``~/.cache/fedlap_jax`` unless ``data.cache_dir`` says otherwise), so later
  runs do not import TensorFlow at all. If the data is not prepared locally and
  the download host cannot be reached within a few seconds, loading fails at
  once with a message pointing to the npz option (an un-mocked ``tfds.load``
  would otherwise retry DNS for minutes).
* ``npz:PATH``: bring your own data, a NumPy ``.npz`` with ``x_train, y_train,
  x_test, y_test``; images NHWC, ``uint8`` (0..255) or float (0..1 for the
  known datasets, any scale for ``custom``), labels integers ``0..classes-1``.
* ``subset:NAME``: the fixed subset ``NAME`` (``mnist10k``, ``fmnist10k``) that
  ``python -m fedlap_runs.datasets NAME`` builds, with its checksum, in the
  data cache (``~/.cache/fedlap_jax/NAME.npz``; read as ``npz:`` reads).
* ``sklearn``: scikit-learn's bundled ``digits`` (8x8x1, real, offline), split
  into 1,400 train / 397 test records (stratified, fixed seed 0).

Normalisation (``config.data.normalisation``), per channel, of pixels in [0, 1]:

* ``published``: the authors' constants of the data set's row in
  :mod:`fedlap_runs.catalog` (MNIST 0.1307 / 0.3081, Fashion-MNIST 0.2861 / 0.3530,
  CIFAR-10 and SVHN per channel);
* ``given``: ``data.mean`` and ``data.std`` as the user supplies them;
* ``test_split``: the mean and std of the (public) test split;
* ``train_split``: the mean and std of the training split, i.e. of the
  clients' private records. Not allowed with DP: one record changes them, and
  they reach every released synthetic image, outside the accountant.
* ``auto`` (default): ``published`` where the dataset has constants, else
  ``train_split`` (so DP runs on ``digits`` / ``custom`` must choose).

Features (``config.data.features``): ``pixels`` (default), the images themselves, or
``scattering``: each normalised image replaced, once when loaded, by its 2-D scattering
transform (:func:`fedlap_jax.models.scattering`, ``J = 2``, ``L = 8``: ``(H / 4, W / 4, 81 C)``
float32), a fixed, data-independent function of each record alone (no privacy cost), for the
``scattered_`` models (a ScatterNet's head); the same model as ``scatternet_``, without the
transform's cost at every step. A method that learns synthetic sets then learns them in this
feature space.

Every loader rejects non-finite pixels and empty arrays. Images are kept as
stored (uint8 pixels stay uint8, also on the device) and normalised batch by
batch as they are read (:class:`Dataset`).

Partitions (``config.data.partition``): ``paper`` (client ``i`` owns every
record of classes ``order[c*i : c*(i+1)]`` with the paper's order
``[5, 6, 1, 2, 0, 8, 9, 3, 4, 7]`` and ``c = classes / clients``), ``iid``
(random disjoint, near-equal parts) and ``dirichlet`` (per class, client shares
drawn from ``Dirichlet(alpha)``, the usual label-skew benchmark). Client sizes
may differ; the training loop pads and masks them. The random schemes and the
subsample draw from the public ``data.partition_seed`` (:func:`client_split`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import threading
import zipfile
from pathlib import Path

import jax
import numpy as np

from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import normalise_pixels, pixel_normalisation
from fedlap_jax.models import SCATTER_J, scattering

from fedlap_runs import catalog
from fedlap_runs.catalog import PAPER_CLASS_ORDER

DATASETS = catalog.NAMES
SOURCES = ("tfds", "sklearn", "npz:PATH", "subset:NAME")
PARTITIONS = ("paper", "iid", "dirichlet")
NORMALISATIONS = ("auto", "published", "given", "test_split", "train_split")
FEATURES = ("pixels", "scattering")
# Sources of mean/std that do not read the clients' records (allowed under DP).
DP_SAFE_NORMALISATIONS = ("published", "given", "test_split")
DIGITS_TEST_SIZE = 397
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


class DataUnavailableError(RuntimeError):
  """The dataset is neither prepared locally nor downloadable (offline)."""


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A dataset in memory, images as stored, with their normalisation.

  Images stay in their stored form (``uint8`` pixels for the tfds datasets and
  uint8 npz files: a quarter of float32's memory, on the host and on the
  device); the model sees ``x * pixel_scale + pixel_offset`` per channel,
  applied to each batch as it is read (:meth:`normalise` on the host,
  :meth:`fedlap_jax.client_data.ClientData.images` on the device).

  Attributes:
    name: dataset name (one of :data:`DATASETS`).
    x_train, x_test: ``(N, H, W, C)`` stored images: ``uint8`` 0..255, or
      float32 (0..1 for the known datasets, any scale for ``custom``).
    y_train, y_test: ``(N,)`` int32 labels in ``[0, num_classes)``.
    num_classes: number of classes.
    mean, std: ``(C,)`` float32, the normalisation of pixels in [0, 1]
      (``(pixel - mean) / std``; ``x * std + mean`` undoes it).
    normalisation: where ``mean`` / ``std`` come from: ``published``,
      ``given``, ``test_split`` or ``train_split`` (see the module docstring).

  Derived: ``pixel_max`` (255 for uint8 images, else 1) and ``pixel_scale``,
  ``pixel_offset``, ``(C,)`` float32, the same normalisation applied to stored
  images (:func:`fedlap_jax.client_data.pixel_normalisation`).
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  mean: np.ndarray
  std: np.ndarray
  normalisation: str = "published"

  @property
  def pixel_max(self) -> float:
    """The stored value of a white pixel: 255 for uint8 images, 1 for float ones."""
    return _pixel_max(self.x_train)

  @functools.cached_property
  def _pixel_normalisation(self) -> tuple[np.ndarray, np.ndarray]:
    return pixel_normalisation(self.mean, self.std, self.pixel_max)

  @property
  def pixel_scale(self) -> np.ndarray:
    return self._pixel_normalisation[0]

  @property
  def pixel_offset(self) -> np.ndarray:
    return self._pixel_normalisation[1]

  def normalise(self, x: np.ndarray) -> np.ndarray:
    """Stored images ``(..., C)`` -> float32 model inputs (host side)."""
    return normalise_pixels(np.asarray(x), self.pixel_scale, self.pixel_offset)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.x_train.shape[1:])


def cache_root(cache_dir: str = "") -> Path:
  """The data cache: ``cache_dir``, or ``~/.cache/fedlap_jax`` for ``""``."""
  return Path(os.path.expanduser(cache_dir or "~/.cache/fedlap_jax"))


def subset_path(name: str) -> Path:
  """Where ``python -m fedlap_runs.datasets NAME`` writes subset ``name`` by default."""
  return cache_root() / f"{name}.npz"


def subset_name(source: str) -> str | None:
  """``'subset:NAME'`` -> ``'NAME'``; any other source -> ``None``."""
  if isinstance(source, str) and source.startswith("subset:") and len(source) > 7:
    return source[7:]
  return None


def parse_source(source: str) -> tuple[str, str | None]:
  """``'tfds'`` -> ``('tfds', None)``; ``'npz:/a/b.npz'`` -> ``('npz', '/a/b.npz')``.

  ``'subset:NAME'`` -> ``('npz', str(subset_path(NAME)))``: a subset is an npz
  file in a known place.
  """
  if source in ("tfds", "sklearn"):
    return source, None
  if isinstance(source, str) and source.startswith("npz:") and len(source) > 4:
    return "npz", os.path.expanduser(source[4:])
  if (name := subset_name(source)) is not None:
    return "npz", str(subset_path(name))
  raise ValueError(f"data.source={source!r} is invalid; allowed: one of {SOURCES}")


# ----------------------------------------------------------------------------
# Raw loaders: return (x_train, y_train, x_test, y_test) with images NHWC.
# ----------------------------------------------------------------------------


def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
  """True if a TCP connection to ``host:port`` opens within ~``timeout`` s.

  DNS resolution can hang far longer than the socket timeout when offline, so
  the probe runs in a daemon thread that is abandoned after ``timeout + 1`` s.
  """
  result = []

  def probe():
    try:
      with socket.create_connection((host, port), timeout=timeout):
        result.append(True)
    except OSError:
      result.append(False)

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout + 1.0)
  return bool(result and result[0])


def _cache_path(cache_dir: str, name: str) -> Path | None:
  if cache_dir == "none":
    return None
  return cache_root(cache_dir) / f"tfds_{name}.npz"


def _save_npz_atomic(path: Path, **arrays) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
  np.savez(tmp, **arrays)
  os.replace(tmp, path)


def _tfds():
  """TensorFlow Datasets, imported only here: the extra ``paper-data`` installs it."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(
      "data.source='tfds' needs tensorflow-datasets, which is not installed; allowed: "
      "pip install 'fedlap_jax[paper-data]' (TensorFlow and tfds, only to download the "
      "paper's data sets), or --config.data.source=npz:PATH"
    ) from None
  return tfds


def _tfds_split_to_numpy(ds) -> tuple[np.ndarray, np.ndarray]:
  """All of a finite ``(image, label)`` tf.data split as two NumPy arrays.

  Batches by the split's cardinality rather than ``batch_size=-1``, which
  aborts the process under ``tfds.testing.mock_data`` without metadata.
  """
  tfds = _tfds()

  n = int(ds.cardinality())
  if n <= 0:  # unknown cardinality: concatenate batches
    xs, ys = zip(*tfds.as_numpy(ds.batch(4096)))
    return np.concatenate(xs), np.concatenate(ys)
  x, y = next(iter(tfds.as_numpy(ds.batch(n))))
  return np.asarray(x), np.asarray(y)


def load_tfds(
  name: str, *, data_dir: str | None = None, cache_dir: str = "", network_timeout: float = 2.0
):
  """Loads a tfds dataset into NumPy once and caches it (see module docstring).

  Raises:
    DataUnavailableError: if the data is not prepared under ``data_dir`` and
      the download host does not answer within ``network_timeout`` seconds.
  """
  if name not in catalog.TFDS_NAMES:
    raise ValueError(
      f"data.name={name!r} is invalid for data.source='tfds'; allowed: one of {catalog.TFDS_NAMES}"
    )
  cache = _cache_path(cache_dir, name)
  if cache is not None and cache.exists():
    return _read_npz(cache, f"the cached copy of {name} ({cache}; delete it to download again)")

  tfds = _tfds()

  kwargs = dict(split=["train", "test"], as_supervised=True, data_dir=data_dir or None)
  try:
    train, test = tfds.load(name, download=False, **kwargs)
  except (AssertionError, FileNotFoundError, tfds.core.registered.DatasetNotFoundError):
    host, port = catalog.ROWS[name].download
    if not _reachable(host, port, network_timeout):
      raise DataUnavailableError(
        f"data.name={name!r}: tfds has no prepared copy under data_dir="
        f"{data_dir or '~/tensorflow_datasets'!r} and cannot download it ({host}:{port} "
        f"is unreachable; this machine looks offline). Either prepare it on a machine "
        f"with internet and copy the tfds data_dir here (--config.data.data_dir=DIR), or "
        f"bring the data as an npz file with arrays x_train, y_train, x_test, y_test "
        f"(NHWC): --config.data.source=npz:/path/to/{name}.npz"
      ) from None
    train, test = tfds.load(name, download=True, **kwargs)
  x_train, y_train = _tfds_split_to_numpy(train)
  x_test, y_test = _tfds_split_to_numpy(test)
  if cache is not None:
    _save_npz_atomic(cache, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  return x_train, y_train, x_test, y_test


def _read_npz(path, what: str):
  """``(x_train, y_train, x_test, y_test)`` of an npz file; one-line errors naming ``what``."""
  try:
    f = np.load(path, allow_pickle=False)
    if not isinstance(f, np.lib.npyio.NpzFile):
      raise ValueError("it holds a single .npy array")
    with f:
      missing = [k for k in NPZ_KEYS if k not in f.files]
      if missing:
        raise ValueError(f"missing arrays {missing} (has {sorted(f.files)})")
      return tuple(np.asarray(f[k]) for k in NPZ_KEYS)
  except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "pickle" in detail:  # numpy's advice to allow pickles does not apply here
      detail = "not a NumPy .npz archive, or it holds object arrays"
    raise ValueError(
      f"{what} is invalid: {detail}; allowed: an .npz written by numpy.savez "
      f"holding the numeric arrays {list(NPZ_KEYS)}"
    ) from None


def load_npz(path: str):
  """Reads ``x_train, y_train, x_test, y_test`` from an npz file and checks them."""
  if not os.path.isfile(path):
    raise ValueError(
      f"data.source='npz:{path}' is invalid: no such file; allowed: "
      "npz:PATH of an existing .npz with arrays x_train, y_train, x_test, y_test"
    )
  arrays = _read_npz(path, f"data.source='npz:{path}'")
  x_train, y_train, x_test, y_test = arrays
  for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    if x.ndim != 4:
      raise ConfigError(
        f"x_{split}",
        x.shape,
        "NHWC images",
        message=f"npz x_{split} has shape {x.shape}; allowed: NHWC images (4-D, "
        "add a trailing channel axis for grey images)",
      )
    if not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)):
      raise ConfigError(
        f"x_{split}",
        str(x.dtype),
        "uint8 or float",
        message=f"npz x_{split} has dtype {x.dtype}; allowed: uint8 or float",
      )
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
      raise ConfigError(
        f"y_{split}",
        (y.shape, str(y.dtype)),
        "1-D integer class labels",
        message=f"npz y_{split} has shape {y.shape} and dtype {y.dtype}; allowed: 1-D integer "
        "class labels",
      )
    if len(x) != len(y):
      raise ConfigError(
        f"y_{split}",
        len(y),
        f"{len(x)} labels, one per image",
        message=f"npz x_{split} has {len(x)} images but y_{split} {len(y)} labels",
      )
  if x_train.shape[1:] != x_test.shape[1:]:
    raise ConfigError(
      "x_test",
      x_test.shape[1:],
      "the same HWC shape as x_train",
      message=f"npz image shapes differ: x_train {x_train.shape[1:]} vs x_test "
      f"{x_test.shape[1:]}; allowed: the same HWC shape",
    )
  return x_train, y_train, x_test, y_test


def load_digits():
  """scikit-learn's bundled 8x8 digits, pixels scaled to [0, 1], fixed split."""
  from sklearn import datasets, model_selection  # pylint: disable=g-import-not-at-top

  digits = datasets.load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[..., None]
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
    x, y, test_size=DIGITS_TEST_SIZE, stratify=y, random_state=0
  )
  return x_train, y_train, x_test, y_test


# ----------------------------------------------------------------------------
# Normalisation and the public loader.
# ----------------------------------------------------------------------------


def _pixel_max(x: np.ndarray) -> float:
  """The stored value of a white pixel: 255 for uint8 images, 1 for float ones in [0, 1]."""
  return 255.0 if x.dtype == np.uint8 else 1.0


def _stored(x: np.ndarray) -> np.ndarray:
  """Images as kept in memory: uint8 unchanged, any float as float32."""
  return x if x.dtype == np.uint8 else x.astype(np.float32)


def resolve_normalisation(name: str, choice: str) -> str:
  """``data.normalisation`` with ``auto`` resolved: ``published`` where ``name`` has
  constants (:data:`fedlap_runs.catalog.PUBLISHED`), else ``train_split``."""
  if choice not in NORMALISATIONS:
    raise ValueError(f"data.normalisation={choice!r} is invalid; allowed: one of {NORMALISATIONS}")
  if choice == "auto":
    return "published" if name in catalog.PUBLISHED else "train_split"
  return choice


def check_finite_and_nonempty(x_train, y_train, x_test, y_test) -> None:
  """Refuses empty splits and NaN / Inf pixels, naming the array and the count.

  Under DP a non-finite record would get clip factor 0 and vanish silently; a
  non-finite test image would turn the test metrics into noise.
  """
  for name, a in (
    ("x_train", x_train),
    ("y_train", y_train),
    ("x_test", x_test),
    ("y_test", y_test),
  ):
    if a.shape[0] == 0:
      raise ConfigError(
        name,
        a.shape,
        "at least 1 record",
        message=f"{name} has 0 records (shape {a.shape}); allowed: at least 1 record "
        "in each of x_train, y_train, x_test, y_test",
      )
  for name, x in (("x_train", x_train), ("x_test", x_test)):
    if np.issubdtype(x.dtype, np.floating):
      bad = ~np.isfinite(x)
      if bad.any():
        records = int(bad.reshape(len(x), -1).any(axis=1).sum())
        raise ConfigError(
          name,
          (int(bad.sum()), records),
          "finite pixel values",
          message=f"{name} holds {int(bad.sum())} non-finite values (NaN or Inf) in "
          f"{records} of its {len(x)} records; allowed: finite pixel values",
        )


def _channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and std (std >= 1e-6) of stored images, as pixels in [0, 1]."""
  pixel_max = _pixel_max(x)
  mean = (x.mean(axis=(0, 1, 2), dtype=np.float64) / pixel_max).astype(np.float32)
  std = np.maximum(x.std(axis=(0, 1, 2), dtype=np.float64) / pixel_max, 1e-6).astype(np.float32)
  return mean, std


def normalisation_stats(data_cfg, x_train: np.ndarray, x_test: np.ndarray):
  """``(source, mean, std)`` of ``data_cfg.normalisation`` (see the module docstring).

  Returns:
    The resolved source name and two ``(C,)`` float32 arrays for pixels in [0, 1].
  """
  name, channels = data_cfg.name, x_train.shape[-1]
  source = resolve_normalisation(name, data_cfg.get("normalisation", "auto"))
  if source == "published":
    if name not in catalog.PUBLISHED:
      raise ValueError(
        f"data.normalisation='published' is invalid for data.name={name!r}; "
        f"allowed: 'given', 'test_split' or 'train_split' (published constants "
        f"exist for {catalog.PUBLISHED})"
      )
    row = catalog.ROWS[name]
    mean, std = np.asarray(row.mean, np.float32), np.asarray(row.std, np.float32)
    if mean.shape[0] != channels:
      raise ConfigError(
        "data.name",
        name,
        f"images of {name}, or data.name='custom' for other data",
        message=f"data.name={name!r} expects {mean.shape[0]} channel(s) but the images "
        f"have shape {x_train.shape[1:]}; allowed: images of {name}, or "
        "data.name='custom' for other data",
      )
  elif source == "given":
    mean, std = (np.asarray(data_cfg.get(f), np.float32) for f in ("mean", "std"))
    for field, v in (("data.mean", mean), ("data.std", std)):
      if v.shape != (channels,):
        raise ConfigError(
          field,
          data_cfg.get(field[5:]),
          f"{channels} number(s), one per channel of the {x_train.shape[1:]} images",
        )
  elif source == "test_split":
    mean, std = _channel_stats(x_test)
  else:
    mean, std = _channel_stats(x_train)
  return source, mean, std


def load_dataset(data_cfg) -> Dataset:
  """Loads ``data_cfg.name`` from ``data_cfg.source`` and normalises it.

  Args:
    data_cfg: the ``config.data`` section (name, source, data_dir, cache_dir,
      normalisation, mean, std).

  Returns:
    A :class:`Dataset` (images as stored with their normalisation, int32 labels).

  Raises:
    ValueError: naming the field or array, the value and what is allowed.
  """
  name = data_cfg.name
  if name not in DATASETS:
    raise ValueError(f"data.name={name!r} is invalid; allowed: one of {DATASETS}")
  kind, path = parse_source(data_cfg.source)
  if kind == "tfds":
    raw = load_tfds(
      name, data_dir=data_cfg.get("data_dir"), cache_dir=data_cfg.get("cache_dir", "")
    )
  elif kind == "npz":
    raw = load_npz(path)
  else:
    if name != "digits":
      raise ValueError(
        f"data.source='sklearn' is invalid with data.name={name!r}; allowed: "
        "data.name='digits' (the only sklearn dataset)"
      )
    raw = load_digits()
  check_finite_and_nonempty(*raw)
  x_train, y_train, x_test, y_test = raw
  if (x_train.dtype == np.uint8) != (x_test.dtype == np.uint8):
    raise ConfigError(
      "x_test",
      str(x_test.dtype),
      f"{x_train.dtype} like x_train (both uint8 or both float)",
      message=f"x_train has dtype {x_train.dtype} but x_test {x_test.dtype}; allowed: "
      "both uint8 or both float",
    )
  x_train, x_test = _stored(x_train), _stored(x_test)
  y_train = np.asarray(y_train).astype(np.int32)
  y_test = np.asarray(y_test).astype(np.int32)

  source, mean, std = normalisation_stats(data_cfg, x_train, x_test)
  num_classes = catalog.ROWS[name].num_classes or int(max(y_train.max(), y_test.max())) + 1
  for split, y in (("train", y_train), ("test", y_test)):
    outside = np.unique(y[(y < 0) | (y >= num_classes)])
    if outside.size:
      raise ValueError(
        f"y_{split} holds label(s) {outside.tolist()[:10]} outside the {num_classes} classes "
        f"of data.name={name!r}; allowed: integers in [0, {num_classes - 1}]"
      )
  features = data_cfg.get("features", "pixels")
  if features not in FEATURES:
    raise ConfigError("data.features", features, f"one of {FEATURES}")
  dataset = Dataset(name, x_train, y_train, x_test, y_test, num_classes, mean, std, source)
  return _scattered(dataset) if features == "scattering" else dataset


def scattering_features(x: np.ndarray, normalise, *, chunk: int = 500) -> np.ndarray:
  """Stored images ``(N, H, W, C)`` -> the scattering of ``normalise(x)``, ``(N, H / 4, W / 4,
  81 C)`` float32, computed ``chunk`` images at a time (``data.features='scattering'``).

  Raises:
    ConfigError: naming ``data.features`` for images that are not square with a side a
      multiple of 4.
  """
  _, h, w, _ = x.shape
  side = 2**SCATTER_J
  if h != w or h % side:
    raise ConfigError(
      "data.features",
      "scattering",
      f"'pixels' for {h}x{w} images (the scattering needs square images with a side a "
      f"multiple of {side})",
    )
  transform = jax.jit(scattering)
  return np.concatenate(
    [np.asarray(transform(normalise(x[i : i + chunk]))) for i in range(0, len(x), chunk)]
  )


def _scattered(dataset: Dataset) -> Dataset:
  """``dataset`` with its images replaced by their scattering (model inputs as they are:
  mean 0, std 1 per feature channel)."""
  x_train, x_test = (
    scattering_features(x, dataset.normalise) for x in (dataset.x_train, dataset.x_test)
  )
  channels = x_train.shape[-1]
  return dataclasses.replace(
    dataset,
    x_train=x_train,
    x_test=x_test,
    mean=np.zeros(channels, np.float32),
    std=np.ones(channels, np.float32),
  )


# ----------------------------------------------------------------------------
# Subsampling and partitions.
# ----------------------------------------------------------------------------


def subsample(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
  """Indices of a class-stratified ``fraction`` of the records (sorted).

  Each class keeps ``round(fraction * n_c)`` records chosen at random (the
  paper's "5 %, 10 %, 50 %, 100 % of the training set").
  """
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"data.train_fraction={fraction!r} is invalid; allowed: a number in (0, 1]")
  if fraction == 1.0:
    return np.arange(len(y))
  rng = np.random.default_rng([seed, 17])
  keep = []
  for c in np.unique(y):
    idx = np.flatnonzero(y == c)
    keep.append(rng.choice(idx, int(round(fraction * len(idx))), replace=False))
  return np.sort(np.concatenate(keep))


def partition(
  y: np.ndarray,
  *,
  num_clients: int,
  scheme: str,
  num_classes: int,
  alpha: float = 0.5,
  seed: int = 0,
) -> list[np.ndarray]:
  """Splits record indices among clients.

  Args:
    y: ``(N,)`` training labels.
    num_clients: ``K``.
    scheme: ``paper``, ``iid`` or ``dirichlet`` (see the module docstring).
    num_classes: number of classes of the dataset.
    alpha: Dirichlet concentration (``dirichlet`` only); small = more skew.
    seed: seed of the random schemes.

  Returns:
    ``K`` sorted int64 index arrays (disjoint; possibly empty, which the
    caller's validation reports).

  Raises:
    ConfigError: naming ``data.partition``, ``data.num_clients`` or ``data.dirichlet_alpha``.
  """
  if scheme not in PARTITIONS:
    raise ConfigError("data.partition", scheme, f"one of {PARTITIONS}")
  if not isinstance(num_clients, int) or num_clients < 1:
    raise ConfigError("data.num_clients", num_clients, "an integer >= 1")
  rng = np.random.default_rng([seed, 29])
  if scheme == "paper":
    if num_classes % num_clients:
      allowed = (
        f"a divisor of {num_classes} (each client owns num_classes / num_clients whole classes)"
      )
      raise ConfigError(
        "data.num_clients",
        num_clients,
        allowed,
        message=f"data.num_clients={num_clients} is invalid with data.partition='paper' and "
        f"{num_classes} classes; allowed: {allowed}",
      )
    order = PAPER_CLASS_ORDER if num_classes == 10 else tuple(range(num_classes))
    per = num_classes // num_clients
    return [np.flatnonzero(np.isin(y, order[i * per : (i + 1) * per])) for i in range(num_clients)]
  if scheme == "iid":
    return [np.sort(part) for part in np.array_split(rng.permutation(len(y)), num_clients)]
  if not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha > 0):
    raise ConfigError("data.dirichlet_alpha", alpha, "a finite number > 0")
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    idx = rng.permutation(np.flatnonzero(y == c))
    shares = rng.dirichlet(np.full(num_clients, float(alpha)))
    cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
    for k, chunk in enumerate(np.split(idx, cuts)):
      parts[k].append(chunk)
  return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def load_split(data_cfg) -> tuple[Dataset, list[np.ndarray]]:
  """The dataset of ``data_cfg`` (:func:`load_dataset`) and each client's record indices
  (:func:`client_split`).

  Raises:
    ConfigError: the data does not load (named ``data.source``) or does not split as
      configured (named by the partition's field).
    DataUnavailableError: tfds data missing and no network.
  """
  try:
    dataset = load_dataset(data_cfg)
    return dataset, list(client_split(dataset, data_cfg))
  except ConfigError:  # names its own field (a partition the data does not allow)
    raise
  except ValueError as e:  # bad data
    raise ConfigError(
      "data.source", data_cfg.source, "data the config can use", message=str(e)
    ) from None


def client_split(dataset: Dataset, data_cfg) -> list[np.ndarray]:
  """Training-record indices of each client: subsample, then partition, both drawn from the
  public ``data_cfg.partition_seed`` (default 0), never from the run's secret ``seed``.

  The partition is released (``client_sizes`` and ``client_classes``, and a DP client's epsilon
  depends on its size): random sizes drawn from the secret seed (``dirichlet``) would let anyone
  test seed guesses offline, and the seed determines every noise draw.
  """
  seed = int(data_cfg.get("partition_seed", 0))
  keep = subsample(dataset.y_train, data_cfg.train_fraction, seed)
  parts = partition(
    dataset.y_train[keep],
    num_clients=data_cfg.num_clients,
    scheme=data_cfg.partition,
    num_classes=dataset.num_classes,
    alpha=data_cfg.dirichlet_alpha,
    seed=seed,
  )
  return [keep[p] for p in parts]
