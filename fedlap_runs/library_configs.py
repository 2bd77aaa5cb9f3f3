"""The library's configs built from an experiment config, and the checks done on the way.

:func:`library_config` builds the frozen library config of ``cfg.method`` as the method's
entry declares it (:mod:`fedlap_runs.method_entries`: where it reads the fields every method shares,
which sections are its own; :func:`fedlap_runs.sections.build`, the one builder).
Two stages of checks, before anything runs:

* :func:`validate_config` (static): names (method, dataset, source,
  partition, norm, backend), ranges, the method's privacy policy, and the core's own
  validation, by building the method's frozen dataclasses.
* :func:`validate_data` (after loading): what only the data can tell, e.g. a
  batch larger than the smallest client, a client with no data, ``ipc`` larger
  than a class with real-image initialisation, a class no client holds, a
  ``dp.delta`` of at least ``1 / min_k N_k``.

:func:`dp_mechanism` is the :class:`~fedlap_jax.accounting.DpMechanism` the
config's method declares (the one its ``FederatedAlgorithm`` carries), for
calibration before the algorithm is built.

Every error is a :class:`fedlap_jax.checks.ConfigError` (a ``ValueError``)
whose ``field`` is the config field as written on the command line (the core's
errors are renamed to it, e.g. ``ipc`` -> ``client.ipc``) and whose message
names the field, the value and what is allowed. Nothing is clamped silently.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from fedlap_jax import accounting, baselines
from fedlap_jax.methods.fedlap import config as core
from fedlap_jax import training as training_lib
from fedlap_jax import optim, participation
from fedlap_jax.checks import ConfigError, is_int, is_real
from fedlap_jax.dispatch import CLIENT_BACKENDS, resolve_weighting
from fedlap_jax.models import NORMS, SCATTER_J, max_depth
from fedlap_jax.synthetic import synthetic_labels

from fedlap_runs import catalog
from fedlap_runs import data as data_lib
from fedlap_runs import datasets as datasets_lib
from fedlap_runs import method_entries, sections


def _fail(field: str, value, allowed: str):
  raise ConfigError(field, value, allowed)


def library_config(cfg, *, max_client_size: int | None = None):
  """The frozen library config of ``cfg.method``, as its entry declares it
  (:func:`fedlap_runs.method_entries.entry`; ``max_client_size``, records of the largest client,
  fixes a baseline's static step count and is required under DP).

  Raises:
    ConfigError: naming the experiment config's field, the value and what is allowed.
  """
  spec = method_entries.entry(cfg.method).spec
  return sections.build(spec, cfg, max_client_size=max_client_size)


def dp_mechanism(cfg, client_sizes: Sequence[int]) -> accounting.DpMechanism | None:
  """The privacy mechanism ``cfg``'s method declares (the registry method's
  :meth:`~fedlap_jax.method.Method.mechanism` of its :func:`library_config`; a baseline's ``T``
  needs the largest of ``client_sizes``); ``None`` without DP."""
  if not cfg.dp.enabled:
    return None
  config = library_config(cfg, max_client_size=max(client_sizes))
  return method_entries.entry(cfg.method).mechanism(config)


def _get(cfg, field: str):
  node = cfg
  for part in field.split("."):
    node = node.get(part) if hasattr(node, "get") else None
  return node


def dp_coupled_fields(cfg) -> list[tuple[str, object, object, str]]:
  """The fields that must change with ``dp.enabled=True``: ``(field, value, value to set,
  why)`` for each, empty when the config is ready for DP (or DP is off).

  The method (a non-DP baseline or DSC has a DP twin), FedLAP's initialisation and radius
  (:class:`fedlap_jax.methods.fedlap.config.FedLAPConfig`'s DP rules), size-weighted averaging and a
  normalisation from the training split. :func:`validate_config` names them all in one error.
  """
  if cfg.dp.enabled is not True:
    return []
  out = []
  entry = method_entries.ENTRIES.get(cfg.method)
  if entry is not None and entry.dp_twin is not None:
    out.append(("method", cfg.method, *entry.dp_twin))
  for field, ok, fix, why in () if entry is None else entry.dp_fields:
    if not ok(_get(cfg, field)):
      out.append((field, _get(cfg, field), fix, why))
  try:  # the library's rule of the weighting under DP
    resolve_weighting(cfg.server.get("weighting"), private=True)
  except ConfigError as e:
    out.append((e.field, e.value, "uniform", "the analysis covers 1/K averaging"))
  d = cfg.data
  try:
    resolved = data_lib.resolve_normalisation(d.name, d.get("normalisation", "auto"))
  except ValueError:
    resolved = None  # validate_config names a bad value itself
  if resolved is not None and resolved not in data_lib.DP_SAFE_NORMALISATIONS:
    fix = "published" if d.name in catalog.PUBLISHED else "test_split"
    out.append(
      (
        "data.normalisation",
        d.get("normalisation", "auto"),
        fix,
        "the training split's statistics leak",
      )
    )
  return out


def _check_dp_coupled_fields(cfg) -> None:
  """Several fields that DP needs changed: one error naming all of them (one alone is refused
  by its own check, with its own message)."""
  fields = dp_coupled_fields(cfg)
  if len(fields) < 2:
    return
  flags = " ".join(f"--config.{f}={fix}" for f, _, fix, _ in fields)
  listed = "; ".join(f"{f}={fix!r} (now {v!r}: {why})" for f, v, fix, why in fields)
  raise ConfigError(
    "dp.enabled",
    True,
    f"with {flags}, or a DP config",
    message=f"dp.enabled=True needs {len(fields)} other fields changed with it: {listed}; "
    f"allowed: add {flags}, or start from a DP config (e.g. cifar_dp, mnist_dp_hybrid, "
    "quickstart:dp, mnist_fedavg_dp, mnist_psg)",
  )


def validate_config(cfg):
  """Static checks of a resolved config (no data needed).

  Returns:
    the method's library config, built on the way (:func:`library_config`); ``None`` for a
    method whose library config needs the data (a baseline's step count: its sections are
    checked one by one instead).

  Raises:
    ConfigError: naming the field, the value and what is allowed.
  """
  entry = method_entries.entry(cfg.method)
  seed = cfg.get("seed")
  if seed is not None and (not is_int(seed) or not 0 <= seed < 2**128):
    _fail(
      "seed",
      seed,
      "None (DP: drawn from the operating system's entropy; without DP: 0) or an integer "
      "in [0, 2**128) (a given seed is guessable: a DP run's outputs are then not private)",
    )
  if not is_int(cfg.rounds) or cfg.rounds < 1:
    _fail("rounds", cfg.rounds, "an integer >= 1")
  if not is_real(cfg.learning_rate) or cfg.learning_rate <= 0:
    _fail("learning_rate", cfg.learning_rate, "a finite number > 0")
  if cfg.client_backend not in CLIENT_BACKENDS:
    _fail("client_backend", cfg.client_backend, f"one of {CLIENT_BACKENDS}")
  if cfg.get("lr_schedule", "cosine") not in training_lib.LR_SCHEDULES:
    _fail("lr_schedule", cfg.lr_schedule, f"one of {training_lib.LR_SCHEDULES}")

  d = cfg.data
  if d.name not in data_lib.DATASETS:
    _fail("data.name", d.name, f"one of {data_lib.DATASETS}")
  try:
    kind, path = data_lib.parse_source(d.source)
  except ValueError as e:
    raise ConfigError(
      "data.source", d.source, f"one of {data_lib.SOURCES}", message=str(e)
    ) from None
  if kind == "tfds" and d.name not in catalog.TFDS_NAMES:
    _fail(
      "data.source",
      d.source,
      f"'sklearn' or 'npz:PATH' for data.name={d.name!r} (tfds serves {catalog.TFDS_NAMES})",
    )
  if kind == "sklearn" and d.name != "digits":
    _fail(
      "data.source",
      d.source,
      f"'tfds' or 'npz:PATH' for data.name={d.name!r} ('sklearn' serves only 'digits')",
    )
  if d.name == "custom" and kind != "npz":
    _fail("data.source", d.source, "'npz:PATH' for data.name='custom'")
  if (name := data_lib.subset_name(d.source)) is not None:
    subset = datasets_lib.SUBSETS.get(name)
    if subset is None:
      _fail("data.source", d.source, f"subset:NAME with NAME one of {tuple(datasets_lib.SUBSETS)}")
    if d.name != subset.tfds_name:
      _fail("data.name", d.name, f"{subset.tfds_name!r} with data.source={d.source!r}")
    if not os.path.isfile(path):
      _fail(
        "data.source",
        d.source,
        f"a subset that exists: build it with `python -m fedlap_runs.datasets {subset.name}` "
        f"(it writes {path})",
      )
  if kind == "npz" and not os.path.isfile(path):
    _fail(
      "data.source",
      d.source,
      "npz:PATH of an existing .npz file with arrays x_train, y_train, x_test, y_test",
    )
  if d.partition not in data_lib.PARTITIONS:
    _fail("data.partition", d.partition, f"one of {data_lib.PARTITIONS}")
  if not is_real(d.dirichlet_alpha) or d.dirichlet_alpha <= 0:
    _fail("data.dirichlet_alpha", d.dirichlet_alpha, "a finite number > 0")
  if not is_int(d.num_clients) or d.num_clients < 1:
    _fail("data.num_clients", d.num_clients, "an integer >= 1")
  participation.check_clients_per_round(d.get("clients_per_round"), d.num_clients)
  participation_seed = d.get("participation_seed", 0)
  if not is_int(participation_seed) or participation_seed < 0:
    _fail("data.participation_seed", participation_seed, "an integer >= 0 (public)")
  partition_seed = d.get("partition_seed", 0)
  if not is_int(partition_seed) or partition_seed < 0:
    _fail("data.partition_seed", partition_seed, "an integer >= 0 (public)")
  if not is_real(d.train_fraction) or not 0 < d.train_fraction <= 1:
    _fail("data.train_fraction", d.train_fraction, "a number in (0, 1]")
  _check_dp_coupled_fields(cfg)  # before the one-field checks: every field DP needs at once
  _validate_normalisation(cfg)

  m = cfg.model
  features, name = d.get("features", "pixels"), m.get("name", "convnet")
  if features not in data_lib.FEATURES:
    _fail("data.features", features, f"one of {data_lib.FEATURES}")
  if name in catalog.SCATTERED and features != "scattering":
    _fail(
      "data.features",
      features,
      f"'scattering' with model.name={name!r} (a ScatterNet's head alone)",
    )
  if name in catalog.SCATTERNETS and features == "scattering":
    _fail("model.name", name, f"one of {tuple(catalog.SCATTERED)} with data.features='scattering'")
  if catalog.model_factory(m.get("name", "convnet")) is None:  # the ConvNet's own fields
    if not is_int(m.width) or m.width < 1:
      _fail("model.width", m.width, "an integer >= 1")
    if not is_int(m.depth) or m.depth < 1:
      _fail("model.depth", m.depth, "an integer >= 1")
    if m.norm not in NORMS:
      _fail(
        "model.norm",
        m.norm,
        f"one of {NORMS} (BatchNorm is not offered: it breaks record-level DP)",
      )
    if not isinstance(m.conv_bias, bool):
      _fail("model.conv_bias", m.conv_bias, "True or False")

  if not isinstance(cfg.dp.enabled, bool):
    _fail("dp.enabled", cfg.dp.enabled, "True or False")
  if not isinstance(cfg.get("label", ""), str):
    _fail("label", cfg.label, "a string (display name in reports; '' = the method's name)")
  epsilon_for = cfg.dp.get("epsilon_for", accounting.REPLACE_ONE)
  if epsilon_for not in accounting.ADJACENCIES:
    _fail(
      "dp.epsilon_for",
      epsilon_for,
      f"one of {accounting.ADJACENCIES} (the neighbouring "
      "relation whose epsilon dp.target_epsilon and dp.match_epsilon_of calibrate)",
    )
  target = cfg.dp.get("target_epsilon")
  if target is not None:
    if not is_real(target) or target <= 0:
      _fail(
        "dp.target_epsilon",
        target,
        "None (use dp.noise_multiplier as given) or a finite "
        "number > 0 (epsilon in nats after the run's last round)",
      )
    if not cfg.dp.enabled:
      _fail(
        "dp.target_epsilon",
        target,
        "None when dp.enabled is False (only a DP run has an epsilon to calibrate)",
      )
    if cfg.dp.get("match_epsilon_of", ""):
      _fail(
        "dp.target_epsilon",
        target,
        f"None with dp.match_epsilon_of={cfg.dp.match_epsilon_of!r} (set one of the two)",
      )
  if not isinstance(cfg.get("debug_nonprivate_stats", False), bool):
    _fail("debug_nonprivate_stats", cfg.debug_nonprivate_stats, "True or False")
  refused = entry.privacy(bool(cfg.dp.enabled))
  if refused is not None:
    _fail("dp.enabled", cfg.dp.enabled, refused)
  if entry.one_shot and cfg.rounds != 1:
    _fail(
      "rounds",
      cfg.rounds,
      f"1 for method={cfg.method!r} (one-shot: the condensation "
      "and the server's training are round 1)",
    )
  try:  # the library's own checks of the baseline section, whatever the method
    baselines.LocalTraining(epochs=cfg.baseline.local_epochs, prox_mu=cfg.baseline.prox_mu)
  except ConfigError as e:
    raise sections.renamed(e, method_entries.BASELINE_SPEC.path(e.field)) from None
  # The optimiser sections are checked whatever the method; a method that does not read the
  # baseline section refuses a choice there (it would be ignored).
  for field, spec in method_entries.baseline_optimizers(cfg).items():
    if spec != optim.SGD and not method_entries.reads_baseline(entry):
      _fail(
        f"baseline.{field}",
        spec,
        f"plain SGD (name='sgd' and its defaults) for method={cfg.method!r} (the baseline section's "
        "optimisers are the FedAvg family's; this method does not read them)",
      )
  for path, spec in method_entries.section_optimizers(cfg).items():
    if spec != optim.SGD and not method_entries.reads_section(entry, path):
      _fail(
        path,
        spec,
        f"plain SGD (name='sgd' and its defaults) for method={cfg.method!r} (this method does "
        f"not read {path}: {method_entries.SECTION_OPTIMIZERS[path][1]})",
      )
  carry = cfg.server.get("carry_state", False)
  if carry is not False and (core.ServerConfig, "server") not in entry.spec.nested:
    _fail(
      "server.carry_state",
      carry,
      f"False for method={cfg.method!r} (this method does not read the server section's "
      "optimiser; only FedLAP's server carries its optimiser's state across rounds)",
    )

  if not is_int(cfg.checkpoint_every) or cfg.checkpoint_every < 1:
    _fail("checkpoint_every", cfg.checkpoint_every, "an integer >= 1 (rounds)")
  if not is_int(cfg.keep_checkpoints) or cfg.keep_checkpoints < 1:
    _fail("keep_checkpoints", cfg.keep_checkpoints, "an integer >= 1")
  grace = cfg.get("termination_grace_seconds", 20.0)
  if not is_real(grace) or grace < 0:
    _fail(
      "termination_grace_seconds",
      grace,
      "a finite number of seconds >= 0 (below the "
      "scheduler's delay between SIGTERM and SIGKILL, less a checkpoint save)",
    )
  if cfg.eval_chunk_size is not None and (
    not is_int(cfg.eval_chunk_size) or cfg.eval_chunk_size < 1
  ):
    _fail("eval_chunk_size", cfg.eval_chunk_size, "an integer >= 1, or None (backend default)")
  snaps = cfg.snapshot_rounds
  if not isinstance(snaps, (tuple, list)) or not all(is_int(r) and r >= 1 for r in snaps):
    _fail(
      "snapshot_rounds",
      snaps,
      "a tuple of rounds >= 1 (rounds after the last are "
      "not reached; the last round is always saved)",
    )

  if entry.check is not None:  # its library config needs the data (the largest client)
    entry.check(cfg)
    return None
  return library_config(cfg)


def _validate_normalisation(cfg) -> None:
  """``data.normalisation`` / ``data.mean`` / ``data.std``; under DP only sources that
  read no training record (``published``, ``given``, ``test_split``)."""
  d = cfg.data
  choice = d.get("normalisation", "auto")
  if choice not in data_lib.NORMALISATIONS:
    _fail("data.normalisation", choice, f"one of {data_lib.NORMALISATIONS}")
  mean, std = d.get("mean"), d.get("std")
  if choice == "given":
    for field, v, low in (("data.mean", mean, -math.inf), ("data.std", std, 0.0)):
      if not isinstance(v, (tuple, list)) or not v or not all(is_real(a) and a > low for a in v):
        _fail(
          field,
          v,
          "a tuple of finite numbers, one per channel (pixels in [0, 1])"
          + (", each > 0" if low == 0.0 else "")
          + " with data.normalisation='given'",
        )
    if len(mean) != len(std):
      _fail("data.std", std, f"as many numbers as data.mean={mean!r}")
  elif mean is not None or std is not None:
    _fail(
      "data.mean" if mean is not None else "data.std",
      mean if mean is not None else std,
      f"None with data.normalisation={choice!r} (set data.normalisation='given' to use "
      "your own mean and std)",
    )
  if choice == "published" and d.name not in catalog.PUBLISHED:
    _fail(
      "data.normalisation",
      choice,
      f"'given', 'test_split' or 'train_split' for "
      f"data.name={d.name!r} (published constants exist for {catalog.PUBLISHED})",
    )
  resolved = data_lib.resolve_normalisation(d.name, choice)
  if cfg.dp.enabled and resolved not in data_lib.DP_SAFE_NORMALISATIONS:
    _fail(
      "data.normalisation",
      choice,
      f"one of {data_lib.DP_SAFE_NORMALISATIONS} with DP (for data.name={d.name!r} "
      f"{choice!r} standardises with the mean and std of the private training split: one "
      "record changes them, they reach every synthetic image, and the accountant does not "
      "cover them); e.g. 'test_split' (statistics of the public test split) or 'given' "
      "(data.mean, data.std)",
    )


def validate_data(
  cfg,
  dataset: "data_lib.Dataset",
  client_indices: Sequence[np.ndarray],
  *,
  mechanism: accounting.DpMechanism | None = None,
) -> None:
  """Checks that need the data: client sizes and classes against the config.

  Args:
    cfg: the resolved config (already through :func:`validate_config`).
    dataset: the loaded :class:`fedlap_runs.data.Dataset`.
    client_indices: training-record indices of each client.
    mechanism: the run's DP mechanism, if built already (else :func:`dp_mechanism`).

  Raises:
    ConfigError: naming the field, the value and what is allowed.
  """
  d = cfg.data
  sizes = [len(i) for i in client_indices]
  for k, n in enumerate(sizes):
    if n == 0:
      raise ConfigError(
        "data.partition",
        d.partition,
        "every client holds >= 1 record",
        message=f"client {k} has no data with data.partition={d.partition!r}, data.num_clients="
        f"{d.num_clients}, data.train_fraction={d.train_fraction}, data.dirichlet_alpha="
        f"{d.dirichlet_alpha}; allowed: every client holds >= 1 record (use fewer clients, "
        f"a larger train_fraction or alpha, or another seed)",
      )
  h, w = dataset.image_shape[:2]
  deepest = max_depth(dataset.image_shape)
  name = cfg.model.get("name", "convnet")
  side = 2**SCATTER_J
  if name in catalog.SCATTERNETS and (h != w or h % side):
    _fail(
      "model.name",
      name,
      f"'convnet' or MODULE:ATTR for {h}x{w} images (a ScatterNet needs square images with a "
      f"side a multiple of {side})",
    )
  if catalog.model_factory(name) is None and cfg.model.depth > deepest:
    _fail(
      "model.depth",
      cfg.model.depth,
      f"at most {deepest} for {h}x{w} images (each block halves the side)",
    )

  smallest = int(np.argmin(sizes))
  if cfg.client.batch_size > sizes[smallest]:
    _fail(
      "client.batch_size",
      cfg.client.batch_size,
      f"at most {sizes[smallest]}, the size of the smallest client (client {smallest}); "
      "the Poisson rate q = batch_size / N_k must be <= 1",
    )
  if cfg.dp.enabled:
    (mechanism or dp_mechanism(cfg, sizes)).check_delta(sizes[smallest])

  ys = [dataset.y_train[i] for i in client_indices]
  held = set(np.concatenate(ys).tolist())
  for c in sorted(set(dataset.y_test.tolist()) - held):
    raise ConfigError(
      "data.partition",
      d.partition,
      "every class held by >= 1 client",
      message=f"class {c} appears in the test split but no client holds a training record of it, "
      f"so no synthetic label covers it (data.partition={d.partition!r}, "
      f"data.train_fraction={d.train_fraction}); allowed: every class held by >= 1 client",
    )

  entry = method_entries.entry(cfg.method)
  if not entry.synthetic:
    return
  ipc = cfg.client.ipc
  if entry.pooled:  # one pool of every client's records
    ys = [np.concatenate(ys)]
  labels, mask = synthetic_labels(ys, ipc)
  for k, y in enumerate(ys):
    covered = set(labels[k][mask[k]].tolist())
    missing = set(np.unique(y).tolist()) - covered
    if missing:  # an invariant of synthetic_labels; checked because the server relies on it
      raise ConfigError(
        "client.ipc",
        ipc,
        "every class a client holds is covered",
        message=f"client {k}: classes {sorted(missing)} have no synthetic labels "
        f"with client.ipc={ipc}; allowed: every class a client holds is covered",
      )
  if cfg.synthetic_init == "real":
    for k, y in enumerate(ys):
      classes, counts = np.unique(y, return_counts=True)
      j = int(np.argmin(counts))
      if ipc > counts[j]:
        _fail(
          "client.ipc",
          ipc,
          f"at most {counts[j]} with synthetic_init='real': "
          f"{'the pool' if entry.pooled else f'client {k}'} holds only "
          f"{counts[j]} records of class {classes[j]} (real initialisation draws ipc "
          "distinct records per class)",
        )


def check_target_epsilon(cfg, planned_epsilon: float) -> None:
  """Refuses a run whose ``dp.noise_multiplier`` was not calibrated to its ``dp.target_epsilon``.

  ``planned_epsilon`` is the epsilon of ``dp.epsilon_for`` the run's mechanism reaches after
  its last round (:meth:`fedlap_jax.accounting.DpMechanism.epsilon_after`).
  :func:`fedlap_runs.calibration.calibrate_noise` sets the sigma; this catches a config that skipped
  it (or a mechanism other than the one calibrated): the planned epsilon must be at most the
  target and within 1 % of it (unless sigma sits at the accounting floor,
  :data:`fedlap_jax.accounting.MIN_NOISE_MULTIPLIER`, where calibration stops).
  """
  target = cfg.dp.target_epsilon
  sigma = cfg.dp.noise_multiplier
  if planned_epsilon <= target * (1 + 1e-9) and (
    planned_epsilon >= 0.99 * target or sigma <= accounting.MIN_NOISE_MULTIPLIER * (1 + 1e-9)
  ):
    return
  raise ConfigError(
    "dp.target_epsilon",
    target,
    "the epsilon of dp.noise_multiplier",
    message=f"dp.target_epsilon={target!r} does not match dp.noise_multiplier="
    f"{sigma!r} (epsilon {planned_epsilon:.4f} after {cfg.rounds} rounds); "
    "allowed: a config whose noise_multiplier experiments.run calibrated "
    "(python -m experiments.run, or fedlap_runs.calibration.calibrate_noise(config))",
  )
