"""What the Flower app builds from a config: a party's run, keys, one client's data, the test split.

The server and every client build their run with :mod:`fedlap_runs.build`, the builder of
``experiments.run``, so a Flower client computes what client ``k`` of ``experiments.run``
computes:

* the library config and the DP mechanism (:func:`fedlap_runs.build.plan`), with
  ``dp.target_epsilon`` calibrated as ``experiments.run`` calibrates it: at the smallest
  client of the config's named data and partition, a public fact every party computes alike
  (:func:`client_run`, :func:`server_run`). A party that does not hold those client sizes (a
  client with its own ``data-path``, a server reading its own npz) refuses the target;
* the model and the keys: ``k_model, k_alg = split(key(seed))``, a ConvNet initialised with
  ``k_model`` (:func:`fedlap_runs.build.init`); the server's key chain starts at the state key
  the method's ``init`` derives from ``k_alg`` (FedLAP: the state key of ``init_state``; a
  baseline: ``k_alg`` itself). Every round the method's plan splits it (FedLAP: ``(next,
  k_init, k_clients, k_server)``, :func:`fedlap_jax.methods.fedlap.state.round_keys`), and client
  ``k`` takes slot ``k`` of the plan's own inputs (its key ``split(k_clients, K)[k]``);
* the round's participants: with ``data.clients_per_round = m < K`` the
  ``m`` clients :func:`fedlap_jax.participation.sample_clients` draws from the
  public ``(data.participation_seed, round)`` (:func:`participants`); the
  ``j``-th of them uses ``split(k_clients, m)[j]``, as
  :func:`fedlap_jax.participation.sampled_round` runs the round on their block
  (:func:`key_slot`);
* the learning rates come in the plan's message (:mod:`fedlap_flower.method_work`);
* one client's data (:func:`client_run`): partition ``k`` of the config's
  data, padded to the largest partition as ``stack_clients`` pads it. With a ``data-path``
  the client holds its own records instead (no padding).

No ``flwr`` here.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fedlap_jax as fl
from fedlap_jax import participation
from fedlap_jax.client_data import normalise_pixels

KEY_IMPL_WORDS = 2  # threefry2x32 key data: two uint32 words


def enable_compilation_cache() -> None:
  """Keeps compiled XLA programs on disk, where ``experiments.run`` keeps them
  (:func:`fedlap_runs.compilation_cache.enable`: ``$FEDLAP_COMPILATION_CACHE``, else JAX's
  own setting, else ``~/.cache/fedlap_jax/jax_compilation_cache``; ``none``: off).

  A SuperNode starts a new ClientApp process for every message, so without the
  cache every client would compile ``local_approx`` again in every round. The place comes
  from this machine's environment only, never from a run config (which the server sends):
  whoever chooses the directory could plant programs there that this process would run.
  ``FEDLAP_FLOWER_JAX_CACHE=off`` leaves JAX's setting alone (the in-process tests).
  """
  if os.environ.get("FEDLAP_FLOWER_JAX_CACHE") == "off":
    return
  from fedlap_runs import compilation_cache  # pylint: disable=g-import-not-at-top

  compilation_cache.enable()


def kept_exported(fn):
  """``fn`` (jitted, positional arguments) read back from where :func:`enable_compilation_cache`
  keeps programs, as ``experiments.run`` reads its round back
  (:func:`fedlap_runs.export_cache.wrap_program`): a node's fresh process then neither traces
  nor lowers it, and compiles it from JAX's cache. On exactly when JAX's persistent cache is;
  ``fn`` itself otherwise."""
  from fedlap_runs import export_cache  # pylint: disable=g-import-not-at-top

  return export_cache.wrap_program(fn)


# ----------------------------------------------------------------------------
# Model and keys.
# ----------------------------------------------------------------------------


def participants(cfg, server_round: int) -> np.ndarray:
  """``(m,)`` the clients of round ``server_round`` (1-based), sorted, as ``experiments.run`` draws.

  Uniform without replacement from the public ``data.participation_seed``
  (:func:`fedlap_jax.participation.sample_clients`); every client (``arange(K)``)
  when ``data.clients_per_round`` is ``None`` or ``K``.
  """
  return participation.sample_clients(
    int(cfg.data.get("participation_seed", 0)),
    int(server_round),
    int(cfg.data.num_clients),
    cfg.data.get("clients_per_round"),
  )


def key_slot(cfg, server_round: int, index: int) -> tuple[int, int] | None:
  """``(j, m)``: client ``index`` is the ``j``-th of the round's ``m`` participants.

  It takes slot ``j`` of the round plan's own inputs (its key ``split(k_clients, m)[j]``), as
  :func:`fedlap_jax.participation.sampled_round` gives it; ``None`` if the client does not
  take part in the round.
  """
  chosen = participants(cfg, server_round).tolist()
  return (chosen.index(index), len(chosen)) if index in chosen else None


def key_to_words(key: jax.Array) -> list[int]:
  """A PRNG key as a list of uint32 words (to send it in a message)."""
  return [int(w) for w in np.asarray(jax.random.key_data(key)).ravel()]


def words_to_key(words) -> jax.Array:
  """Inverse of :func:`key_to_words`."""
  data = np.asarray(list(words), np.uint32)
  if data.shape != (KEY_IMPL_WORDS,):
    raise ValueError(f"a round key must be {KEY_IMPL_WORDS} uint32 words; got {list(words)!r}")
  return jax.random.wrap_key_data(data)


# ----------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------


class Partition(NamedTuple):
  """One client's data.

  Attributes:
    index: the client's ``k``; num_clients: ``K``.
    data: :class:`fedlap_jax.ClientData` ``(N, ...)`` on the device (``N``:
      the largest partition in named-partition mode, else ``N_k``).
    num_records: ``N_k``, the client's real records.
    image_shape, num_classes: of the dataset.
    fingerprint: what identifies these records (for the privacy ledger).
  """

  index: int
  num_clients: int
  data: Any
  num_records: int
  image_shape: tuple
  num_classes: int
  fingerprint: dict


class ClientRun(NamedTuple):
  """What one client builds from the run config (once per run and partition).

  Attributes:
    plan: its :class:`fedlap_runs.build.Plan`: the (calibrated) config, the method's library
      config and DP mechanism (its ``data``: the run's facts only, no records).
    model: its :class:`fedlap_runs.build.Model` (``params``: the initial global model, the
      layout the parameters of a message unpack into).
    partition: its :class:`Partition`.
    k_alg: the algorithm's key of the seed (:class:`fedlap_runs.build.Init`): what a client
      that keeps its own carried state starts it from
      (:attr:`fedlap_jax.method.Method.client_init`).
  """

  plan: Any
  model: Any
  partition: Partition
  k_alg: Any = None


def own_records(image_shape, num_classes: int):
  """The :class:`fedlap_runs.build.Data` of a party that holds no partition of the config's
  data (a client's own records, a server's own test data): its :class:`~fedlap_runs.build.Facts`
  without client sizes."""
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  return build.Data(None, None, build.Facts(tuple(image_shape), int(num_classes)))


def named_plan(cfg):
  """The :class:`fedlap_runs.build.Plan` of the config's named data and partition, calibrated
  (``dp.target_epsilon``) at its smallest client as ``experiments.run`` calibrates: what the
  server and every client of a named-partition run compute alike."""
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  return build.plan(cfg, calibrate=True)


def client_run(cfg, index: int, num_clients: int, data_path: Path | None = None, *, plan=None):
  """Client ``index``'s :class:`ClientRun`: partition ``index`` of ``cfg.data``, or its own
  ``data_path`` npz.

  Args:
    plan: :func:`named_plan` of ``cfg`` if built already (a process serving several clients of
      a run); only without ``data_path``.

  Raises:
    fedlap_runs.library_configs.ConfigError: the data does not fit the config; with
      ``data_path``, a ``dp.target_epsilon`` (calibrating it needs the federation's client
      sizes, which a client holding only its own records does not have).
    ValueError: a bad own-data file.
  """
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  if data_path is None:
    p = named_plan(cfg) if plan is None else plan
    start = build.init(p, p.cfg.seed)
    dataset, indices = p.data.dataset, p.data.client_indices
    own = indices[index]
    data = fl.pad_client(
      dataset.x_train[own],
      dataset.y_train[own],
      capacity=max(len(i) for i in indices),
      pixel_scale=dataset.pixel_scale,
      pixel_offset=dataset.pixel_offset,
    )
    fingerprint = {
      "data": "partition",
      "dataset": cfg.data.name,
      "source": cfg.data.source,
      "partition": cfg.data.partition,
      "dirichlet_alpha": float(cfg.data.dirichlet_alpha),
      "num_clients": int(num_clients),
      "train_fraction": float(cfg.data.train_fraction),
      "seed": int(cfg.seed),
      "index": int(index),
      "num_records": int(len(own)),
    }
    part = Partition(
      index,
      num_clients,
      data,
      int(len(own)),
      tuple(dataset.image_shape),
      int(dataset.num_classes),
      fingerprint,
    )
    # The run's data stays with the caller's plan (the other partitions are not kept here).
    return ClientRun(
      p._replace(data=build.Data(None, None, p.facts)), start.model, part, start.k_alg
    )
  x, y, scale, offset, num_classes = load_own_data(cfg, data_path)
  if cfg.client.batch_size > len(y):
    raise library_configs.ConfigError(
      "client.batch_size",
      cfg.client.batch_size,
      f"at most {len(y)}",
      message=f"client.batch_size={cfg.client.batch_size} is invalid for data-path "
      f"{data_path}: it holds {len(y)} records; allowed: at most the client's records "
      "(q = B / N_k <= 1)",
    )
  p = build.plan(cfg, data=own_records(x.shape[1:], num_classes), calibrate=True)
  start = build.init(p, p.cfg.seed)
  with open(data_path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  fingerprint = {
    "data": "own",
    "path": str(data_path),
    "sha256": digest,
    "num_records": int(len(y)),
  }
  part = Partition(
    index,
    num_clients,
    fl.pad_client(x, y, capacity=len(y), pixel_scale=scale, pixel_offset=offset),
    int(len(y)),
    tuple(x.shape[1:]),
    num_classes,
    fingerprint,
  )
  return ClientRun(p, start.model, part, start.k_alg)


# Normalisations a client holding only its own records can apply exactly as the
# server applies them to the test split: fixed numbers, no statistics of any split.
OWN_DATA_NORMALISATIONS = ("published", "given")


def load_own_data(cfg, path: Path):
  """``(x, y, pixel_scale, pixel_offset, num_classes)`` of a client's own npz (``x_train``, ``y_train``).

  The normalisation is ``data.normalisation`` resolved as ``fedlap_runs.data``
  resolves it, and must be a fixed one (:data:`OWN_DATA_NORMALISATIONS`: the
  published constants of a row of :mod:`fedlap_runs.catalog`, or ``data.mean`` /
  ``data.std`` given in the config), the same on every client and on the
  server: ``test_split`` (the client does not hold the server's test split)
  and ``train_split`` (each client would standardise with its own statistics)
  are refused.

  Raises:
    fedlap_runs.library_configs.ConfigError: naming ``data.features`` for images the
      scattering cannot take.
    ValueError: naming ``data-path``: a file that is not an npz of plain
      arrays, missing arrays, no records or shapes that disagree, images
      neither uint8 nor float, labels not integers or outside ``0..9``, NaN /
      Inf pixels (checked as float32).
  """
  from fedlap_runs import catalog  # pylint: disable=g-import-not-at-top
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  name = cfg.data.name
  if name not in catalog.PUBLISHED:
    raise ValueError(
      f"data-path needs a dataset of known classes with a fixed normalisation; "
      f"data.name={name!r} is invalid; allowed: one of "
      f"{sorted(catalog.PUBLISHED)}"
    )
  classes = catalog.ROWS[name].num_classes
  choice = cfg.data.get("normalisation", "auto")
  source = data_lib.resolve_normalisation(name, choice)
  if source not in OWN_DATA_NORMALISATIONS:
    reads = (
      "the server's test split"
      if source == "test_split"
      else "each client's own records, so every client would differ"
    )
    raise ValueError(
      f"data-path needs a fixed normalisation; data.normalisation={choice!r} "
      f"is invalid for a client holding only its own records ({source!r} reads "
      f"{reads}); allowed: one of {OWN_DATA_NORMALISATIONS} (or 'auto', "
      f"'published' for data.name={name!r})"
    )
  try:
    with np.load(path, allow_pickle=False) as f:
      missing = [k for k in ("x_train", "y_train") if k not in f.files]
      if missing:
        raise ValueError(
          f"data-path {path} lacks arrays {missing} (has {sorted(f.files)}); "
          "allowed: an npz with x_train (N, H, W, C) and y_train (N,)"
        )
      x, y = np.asarray(f["x_train"]), np.asarray(f["y_train"])
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    if str(e).startswith("data-path "):
      raise
    raise ValueError(
      f"data-path {path} cannot be read as an npz of numeric arrays "
      f"({type(e).__name__}: {e}); allowed: np.savez output with x_train "
      "(N, H, W, C) and y_train (N,), no object arrays"
    ) from None
  if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or x.size == 0:
    raise ValueError(
      f"data-path {path}: x_train {x.shape} / y_train {y.shape}; allowed: "
      "N >= 1 NHWC images (H, W, C >= 1) and N labels"
    )
  if not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)):
    raise ValueError(f"data-path {path}: x_train has dtype {x.dtype}; allowed: uint8 or float")
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"data-path {path}: y_train has dtype {y.dtype}; allowed: integer labels")
  if y.min() < 0 or y.max() >= classes:
    raise ValueError(
      f"data-path {path}: labels in [{y.min()}, {y.max()}]; allowed: 0..{classes - 1}"
    )
  y = y.astype(np.int32)
  if x.dtype != np.uint8:
    # Checked as float32, the dtype the client computes in (1e300 as float64 becomes Inf).
    with np.errstate(over="ignore"):
      x = x.astype(np.float32)
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    if bad:
      raise ValueError(
        f"data-path {path}: x_train holds {bad} NaN or Inf values (as float32); "
        "allowed: finite pixels"
      )
  _, mean, std = data_lib.normalisation_stats(cfg.data, x, x)  # fixed numbers: reads no pixel
  scale, offset = fl.pixel_normalisation(mean, std, 255.0 if x.dtype == np.uint8 else 1.0)
  if cfg.data.get("features", "pixels") == "scattering":  # as fedlap_runs.data loads them
    x = data_lib.scattering_features(x, lambda b: normalise_pixels(b, scale, offset))
    scale, offset = np.ones(x.shape[-1], np.float32), np.zeros(x.shape[-1], np.float32)
  return x, y, scale, offset, classes


class TestSplit(NamedTuple):
  """The server's test data, stored as the dataset stores it, with its normalisation."""

  x: jax.Array
  y: jax.Array
  pixel_scale: np.ndarray
  pixel_offset: np.ndarray
  image_shape: tuple
  num_classes: int


def test_split(dataset) -> TestSplit:
  """The test split of a loaded :class:`fedlap_runs.data.Dataset`."""
  return TestSplit(
    jnp.asarray(dataset.x_test),
    jnp.asarray(dataset.y_test),
    np.asarray(dataset.pixel_scale),
    np.asarray(dataset.pixel_offset),
    tuple(dataset.image_shape),
    int(dataset.num_classes),
  )


def load_test_split(cfg) -> TestSplit:
  """The test split of ``cfg.data`` (what ``experiments.run`` evaluates on)."""
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  try:
    dataset = data_lib.load_dataset(cfg.data)
  except ValueError as e:
    raise library_configs.ConfigError(
      "data.source", cfg.data.source, "data the config can use", message=str(e)
    ) from None
  return test_split(dataset)


def server_run(cfg, data_cfg=None):
  """The server's ``(plan, init, test split)``: its :class:`fedlap_runs.build.Plan`, the
  :class:`fedlap_runs.build.Init` of the seed (the initial model, ``k_alg``) and the
  :class:`TestSplit`.

  ``data_cfg``: ``cfg`` with the server's own test data (:func:`fedlap_flower.settings.server_data`;
  ``None`` or ``cfg`` itself: the config's named data). With the named data the server builds
  the run as every client of a named-partition run does (:func:`named_plan`: the same client
  sizes, so the same calibrated sigma) and evaluates on its test split; with its own data it
  knows no client sizes, and refuses ``dp.target_epsilon``.

  Raises:
    fedlap_runs.library_configs.ConfigError: the config or the data; ``dp.target_epsilon``
      with the server's own data.
  """
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  if data_cfg is None or data_cfg is cfg:
    p = named_plan(cfg)
    test = test_split(p.data.dataset)
  else:
    test = load_test_split(data_cfg)
    p = build.plan(cfg, data=own_records(test.image_shape, test.num_classes), calibrate=True)
  return p, build.init(p, p.cfg.seed), test
