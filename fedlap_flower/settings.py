"""The Flower app's settings: run config and node config onto the experiments' configs.

One named config describes both ways of running: ``experiments.run
--config=quickstart:dp`` and the Flower app with ``config = "quickstart:dp"``
build the same ml_collections config (``fedlap_runs/configs/``), so the same
data, partition, model, loop sizes, privacy parameters and seed.

Run config (``[tool.flwr.app.config]`` of ``fedlap_flower/app/pyproject.toml``,
overridden with ``flwr run ... --run-config 'KEY=VALUE ...'``; the ServerApp and
every ClientApp see the same values):

==============================  =============================================
key                             meaning
==============================  =============================================
``config``                      ``NAME[:ARG]`` of ``fedlap_runs/configs/`` (one
                                run, not a suite); never a path (a config file
                                is Python: it would run on every node)
``overrides``                   ``"FIELD=VALUE ..."``, as ``--config.FIELD=VALUE``
                                of ``experiments.run`` (``"seed=1 rounds=3"``),
                                of the fields :data:`OVERRIDABLE` allows
``run-dir``                     the server's outputs; ``""``: ``runs/flower/<label>``.
                                One that holds a run's outputs is refused
                                unless ``resume`` is true
``resume``                      continue the run of ``run-dir`` (the same config
                                and overrides) after its last completed round
                                (:mod:`fedlap_flower.server_state`); its clients
                                continue their carried state, kept under the
                                federated run's identity
                                (:mod:`fedlap_flower.federated_runs`)
``min-clients``                 fewest clients a round may aggregate (0: all
                                of the round's clients, ``data.clients_per_round``
                                or else ``data.num_clients``); fewer stops the run.
                                At least 3 where FedLAP's server radius is the
                                median (``server.radius_strategy``)
``round-timeout``               seconds the server waits for a round's replies
``join-timeout``                seconds a round waits for all ``K`` clients to be
                                connected before it starts with those there
                                (at least ``min-clients``; up to
                                ``round-timeout`` for those)
``max-epsilon``                 the server's cap on each client's epsilon; a
                                client takes the smaller of this and its own
``partition-keys``              ``"K=SHA256:... ..."``: partition ``K`` is the node
                                with that public key (``ssh-keygen -l -f
                                KEY.pub``); ``""``: first come
                                (:mod:`fedlap_flower.binding`)
``max-image-abs``               largest ``|x|`` of a synthetic image the server
                                accepts (0: 1000 x the normalised test split's
                                largest ``|pixel|``; :mod:`fedlap_flower.replies`)
``max-update-norm``             largest ``||w_k - w_g||`` of a FedAvg-wire reply
                                the server accepts: a number > 0, ``'auto'``
                                (derived from the DP mechanism and the client's
                                SGD, :func:`fedlap_jax.update_bounds.local_sgd_update_bound`;
                                refused where none is derivable), ``'none'`` (no
                                bound: one client moves the mean anywhere), or
                                ``''`` (default: ``'auto'`` where derivable, i.e.
                                DP-FedAvg / DP-FedProx, else ``'none'``; refused
                                under DP where none is derivable);
                                FedLAP's replies have their own bounds, so only
                                ``''`` is allowed for them
``max-classes-per-client``      the most classes a client holds, stated for a
                                federation whose parties read their own data
                                (0: not stated): FedDM's, DSC's and PSG's
                                synthetic sets have ``ipc`` slots for each; a
                                client holding more refuses by name, before its
                                ledger is touched. With the config's named
                                partition the partition says it (0 or its
                                value only); other methods take 0 only
``unsafe-dp-keys-from-server``  TEST ONLY: DP clients use the server's round
                                keys (the server could remove the noise);
                                also needs the client's consent, the
                                environment variable :data:`UNSAFE_ENV` = 1
``signer``, ``signature``,      the operator's signature over the bundle and
``signed-at``, ``run-nonce``    this run config, and the run's random nonce,
                                checked by every client
                                (:mod:`fedlap_flower.runtime.run_signature`)
==============================  =============================================

Node config (``flower-supernode --node-config 'KEY=VALUE ...'``; the
simulation engine sets ``partition-id`` and ``num-partitions`` itself):

* ``partition-id`` (required): the client's index ``k`` in ``0..K-1``;
* ``num-partitions`` (required): ``K``, must equal ``data.num_clients``;
* ``data-path``: an ``.npz`` with this client's own records (``x_train``,
  ``y_train``); without it the client takes partition ``k`` of the config's
  data, as ``experiments.run`` does;
* ``state-dir``: where its privacy ledger, ledger journal and synthetic set
  live; an existing one must be this user's and writable by it alone
  (:func:`fedlap_flower.ledger.check_private`). Without it, the client's own
  environment variable :data:`STATE_ROOT_ENV` gives ``<root>/client-<k>`` (the
  simulation engine's virtual nodes have no node config of their own). Under DP
  one of the two is required: a client keeps its ledger only where it says, never
  where the run config (its label) would put it. Without DP and without either,
  it is ``~/.fedlap_flower/<label>/client-<k>`` in the client user's home
  (:func:`default_state_dir`; new directories 0700). The run config never names
  a client's directory;
* ``max-epsilon``: the epsilon it will never exceed (the smaller of this and
  the run config's ``max-epsilon`` holds). A client given its own
  ``max-epsilon`` takes part in DP runs only: it refuses a run whose config
  turns DP off;
* ``max-delta``: the largest ``dp.delta`` it accepts, in ``(0, 1)`` (default
  ``min(1e-5, 1 / N_k)``, with ``N_k`` its record count); a run whose
  ``dp.delta`` exceeds it, or reaches ``1 / N_k``, is refused;
* ``max-ipc``, ``max-width``, ... (:data:`COMPUTE_CAPS`): the most a run may
  make it compute, one config field each (``client.ipc``, ``model.width``, ...;
  default: the largest value among the paper's named configs); a run above one
  is refused before the client loads its data or builds its model;
* ``models``: the ``model.name`` values a run may ask of it, comma-separated: catalog
  names (``convnet,scatternet_linear``) and user models ``MODULE:ATTR`` (as
  ``experiments.run`` takes them); without it, its environment's :data:`MODELS_ENV`,
  which is also the server's; without either, every catalog model and no user model
  (:func:`allowed_models`). A ScatterNet's scattering front end costs more per example
  than the ConvNet. Another name is refused before anything is imported, the data loaded
  or the model built.

What a run may name on a node (the run config comes from whoever submits the
run; every node, the server included, takes only this):

* code: the configs of ``fedlap_runs/configs/`` by name (:func:`load_config`
  refuses a path before it looks at the disk, so its message says nothing
  about what exists there); the catalog's models by name, and a
  ``model.name=MODULE:ATTR`` only where that side allows that exact string
  (a node's ``models``, the server's :data:`MODELS_ENV`), refused before any
  import;
* data: a client reads only its own ``data-path`` (or, without one, the named
  config's dataset from its usual place: tfds, scikit-learn's digits or a
  subset of the data cache); ``data.source`` may not be ``npz:PATH``, and
  ``data.data_dir`` / ``data.cache_dir`` may not be overridden. The server
  reads its test split from the named config's dataset, or from the npz its
  own environment names (:data:`SERVER_DATA_ENV`);
* overrides: an allow-list (:data:`OVERRIDABLE`) of fields that change the
  algorithm, the model, the partition and the normalisation, never a path,
  code, a ledger or a state directory;
* state: a client's state directory comes from its own node config or
  environment only (``state-dir``, :data:`STATE_ROOT_ENV`, else the fixed
  default under its home, in which the run's label is one checked path
  component); a run config carrying ``state-root`` is refused.

Every bad value raises :class:`SettingsError` (a :class:`fedlap_jax.ConfigError`
whose ``field`` is the run-config or node-config key), or the experiments'
``ConfigError`` for the config itself, naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

from fedlap_flower import method_work as _method_work
from fedlap_jax.checks import ConfigError, is_int, is_real

RUN_CONFIG_DEFAULTS: dict[str, Any] = {
  "config": "quickstart:dp",
  "overrides": "",
  "run-dir": "",
  "resume": False,
  "min-clients": 0,
  "round-timeout": 900.0,
  "join-timeout": 30.0,
  "max-epsilon": math.inf,
  "partition-keys": "",
  "max-image-abs": 0.0,
  "max-update-norm": "",
  "max-classes-per-client": 0,
  "unsafe-dp-keys-from-server": False,
  # Checked by the node before the ClientApp runs (fedlap_flower.runtime.run_signature).
  "signer": "",
  "signature": "",
  "signed-at": 0,
  "run-nonce": "",
}
# What a run may make a client compute: node-config key -> (the config field it caps, its
# default: the largest value among the paper's named configs).
COMPUTE_CAPS: dict[str, tuple[str, int]] = {
  "max-ipc": ("client.ipc", 200),  # cifar_ablation_ipc:200
  "max-iterations": ("client.iterations", 4),
  "max-outer": ("client.max_outer", 35),
  "max-batch-loop": ("client.batch_loop", 40),
  "max-boost-loop": ("client.boost_loop", 50),
  "max-inner-loop": ("client.inner_loop", 5),
  "max-calibration-epochs": ("client.calibration_epochs", 100),
  "max-batch-size": ("client.batch_size", 2028),
  "max-model-batch-size": ("client.model_batch_size", 512),
  "max-width": ("model.width", 128),
  "max-depth": ("model.depth", 3),
  "max-local-epochs": ("baseline.local_epochs", 5),
  "max-networks": ("condense.networks", 1000),
  "max-condense-batch-loop": ("condense.batch_loop", 10),
  "max-image-updates": ("feddm.image_updates", 1000),
}
NODE_CONFIG_KEYS = (
  "partition-id",
  "num-partitions",
  "data-path",
  "state-dir",
  "max-epsilon",
  "max-delta",
  "models",
  *COMPUTE_CAPS,
)
# A DP client uses round keys sent by the server only if its own environment says so.
UNSAFE_ENV = "FEDLAP_FLOWER_UNSAFE_DP_KEYS_FROM_SERVER"
# A client's own environment may name the root of its state directories (<root>/client-<k>).
STATE_ROOT_ENV = "FEDLAP_FLOWER_STATE_ROOT"
# Without state-dir or STATE_ROOT_ENV, a non-DP client keeps its state in
# DEFAULT_STATE_ROOT/<label>/client-<k> (created 0700).
DEFAULT_STATE_ROOT = "~/.fedlap_flower"
# Run-config keys that once named a directory on the clients' disks: refused with the reason.
REMOVED_RUN_CONFIG_KEYS = {
  "state-root": (
    "a client's state directory comes from its own node config (state-dir) or its own "
    f"environment ({STATE_ROOT_ENV}), else {DEFAULT_STATE_ROOT}/<label>/client-<k> in its "
    "home; a run config names nothing on a client's disk"
  )
}
# A label as one path component: what experiments.run's labels are made of, starting with a
# letter or digit (so never '.', '..' or a hidden name), at most 200 characters.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}")
# The server's own test data: an npz (x_train, y_train, x_test, y_test) its environment names,
# read in place of the named config's data.source (the run config never names a file).
SERVER_DATA_ENV = "FEDLAP_FLOWER_SERVER_DATA"
# The models (catalog names and MODULE:ATTR, comma-separated) the server's environment allows,
# and a client's where its node config has no ``models`` (:func:`allowed_models`).
MODELS_ENV = "FEDLAP_FLOWER_MODELS"
# The default max-delta is min(DEFAULT_MAX_DELTA, 1 / N_k).
DEFAULT_MAX_DELTA = 1e-5
# What a Flower run's overrides may set: an allow-list of config fields (a name ending in "."
# is a section: every field of it). None of them names a file, a directory or code:
# client / server / dp / model / baseline hold numbers and names of the algorithm; data.source
# is allowed only as one of PATHLESS_SOURCES (checked on the loaded config).
OVERRIDABLE = (
  "client.",
  "server.",
  "dp.",
  "model.",
  "baseline.",
  "feddm.",
  "condense.",
  "method",
  "seed",
  "rounds",
  "learning_rate",
  "synthetic_init",
  "lr_schedule",
  "client_backend",
  "eval_chunk_size",
  "snapshot_rounds",
  "plots",
  "progress_bar",
  "debug_nonprivate_stats",
  "termination_grace_seconds",
  "data.name",
  "data.source",
  "data.num_clients",
  "data.partition",
  "data.dirichlet_alpha",
  "data.clients_per_round",
  "data.participation_seed",
  "data.partition_seed",
  "data.train_fraction",
  "data.normalisation",
  "data.mean",
  "data.std",
  "data.features",
)
# data.source values of a Flower run: no path (subset:NAME is a fixed file of the data cache).
PATHLESS_SOURCES = ("tfds", "sklearn", "subset:NAME")
# max-update-norm's words: the default, a bound derived from the config, no bound.
UPDATE_NORM_WORDS = ("", "auto", "none")
UPDATE_NORM_ALLOWED = (
  "a number > 0, 'auto' (derived from the DP mechanism and the client's SGD), 'none' (no "
  "bound), or '' (the default: 'auto' where a bound is derivable, else 'none')"
)
# FedLAP (its own strategy) and every registry method the generic strategy runs.
METHODS = _method_work.METHODS


class SettingsError(ConfigError):
  """A bad run-config or node-config value (``field`` is the key)."""


# Fewest replies a FedLAP round with the ``median`` server radius aggregates: from three on,
# one client cannot take the median outside the range of the others' radii.
MEDIAN_RADIUS_MIN_CLIENTS = 3


def _fail(key: str, value, allowed: str):
  raise SettingsError(key, value, allowed)


def _is_real_or_inf(v) -> bool:
  """A finite real number (:func:`fedlap_jax.checks.is_real`) or ``inf``."""
  return is_real(v) or (isinstance(v, float) and v == math.inf)


# ----------------------------------------------------------------------------
# Named configs and overrides.
# ----------------------------------------------------------------------------


def overridable(field: str) -> bool:
  """Whether a Flower run's overrides may set ``field`` (dotted; :data:`OVERRIDABLE`)."""
  return any(
    field.startswith(a) and len(field) > len(a) if a.endswith(".") else field == a
    for a in OVERRIDABLE
  )


def _check_source(source) -> None:
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  try:
    kind, _ = data_lib.parse_source(source)
  except ValueError:
    kind = None
  if kind is None or (kind == "npz" and data_lib.subset_name(source) is None):
    allowed = (
      f"one of {PATHLESS_SOURCES}: a Flower run names no file (a client reads its own "
      f"data-path, the server the npz its environment's {SERVER_DATA_ENV} names)"
    )
    raise SettingsError(
      "data.source",
      source,
      allowed,
      message=f"overrides: data.source={source!r} is invalid; allowed: {allowed}",
    )


def server_data(cfg):
  """``cfg`` for the server's test split: ``data.source = 'npz:PATH'`` with the ``PATH`` of
  the server's environment variable :data:`SERVER_DATA_ENV`, else ``cfg`` itself."""
  path = os.environ.get(SERVER_DATA_ENV, "")
  if not path:
    return cfg
  out = cfg.copy_and_resolve_references()
  out.data.source = f"npz:{path}"
  return out


def allowed_models(node_config: Mapping[str, Any] | None = None) -> tuple[str, ...]:
  """The ``model.name`` values this side computes: the node config's ``models``, else the
  environment's :data:`MODELS_ENV` (the server's, and a client's without ``models``),
  comma-separated catalog names and ``MODULE:ATTR``; without either, the catalog's models.
  Set by the node's or the server's operator, never by the run config (whose submitter
  would choose code to run).

  Raises:
    SettingsError: naming ``models`` (or :data:`MODELS_ENV`): no entry, or one neither a
      catalog name nor ``MODULE:ATTR``.
  """
  from fedlap_runs import catalog  # pylint: disable=g-import-not-at-top

  nc = node_config or {}
  key = "models" if "models" in nc else MODELS_ENV
  text = nc["models"] if "models" in nc else os.environ.get(MODELS_ENV)
  if text is None:
    return catalog.MODELS
  allowed = (
    f"comma-separated names of {catalog.MODELS} and MODULE:ATTR, each a callable taking "
    "num_classes and returning a flax.linen.Module; at least one"
  )
  if not isinstance(text, str):
    _fail(key, text, allowed)
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  if not names:
    _fail(key, text, allowed)
  for n in names:
    module, sep, attr = n.partition(":")
    if n not in catalog.MODELS and not (module and sep and attr):
      _fail(key, n, allowed)
  return names


def load_config(name: str, overrides: str = "", models: tuple[str, ...] | None = None):
  """The resolved, validated ml_collections config of ``NAME[:ARG]`` plus ``overrides``;
  ``model.name`` one of ``models`` (:func:`allowed_models`; ``None``: the catalog's).

  ``NAME`` must be a config of ``fedlap_runs/configs/`` (a path is refused, whether or not
  the file exists). ``overrides`` is ``"FIELD=VALUE ..."``, split with shell rules (quote a
  value that holds spaces), each ``FIELD`` one :func:`overridable` allows; each item is
  parsed as ``experiments.run``'s ``--config.FIELD=VALUE``
  (:func:`fedlap_runs.flags.load_config`: by the field's type, ``None`` for a None-able field).

  Returns:
    ``(cfg, label)``; ``label`` names the run as ``experiments.run`` does
    (``quickstart:dp_loops`` -> ``quickstart_dp_loops``).

  Raises:
    SettingsError: unknown config name, a suite config, a bad override (``field``: the
      config field whose value does not parse, else ``overrides``), or a method the Flower
      app does not offer.
    fedlap_runs.library_configs.ConfigError: the config itself is invalid.
  """
  from fedlap_runs import catalog, flags  # pylint: disable=g-import-not-at-top
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  if not isinstance(name, str) or not name:
    _fail("config", name, "NAME[:ARG] of fedlap_runs/configs/ (e.g. 'quickstart:dp_loops')")
  if not isinstance(overrides, str):
    _fail("overrides", overrides, "a string of FIELD=VALUE pairs separated by spaces")
  try:
    items = shlex.split(overrides)
  except ValueError as e:
    raise SettingsError(
      "overrides",
      overrides,
      "FIELD=VALUE pairs separated by spaces, quoted with shell rules",
      message=f"overrides={overrides!r} is invalid ({e}); allowed: "
      "FIELD=VALUE pairs separated by spaces, quoted with shell rules",
    ) from None
  for item in items:
    field = item.partition("=")[0]
    if "=" in item and field and not overridable(field):
      raise SettingsError(
        "overrides",
        field,
        f"the fields of {OVERRIDABLE}",
        message=f"overrides: {field!r} is not a field a Flower run may set; allowed: "
        f"{OVERRIDABLE} (a name ending in '.' is a section); the others can name files, "
        "directories or code",
      )
  try:
    cfg, label = flags.load_config(name, items, named_only=True)
  except library_configs.ConfigError as e:
    raise _settings_error(e, name) from None
  if "suite" in cfg:
    _fail(
      "config",
      name,
      f"one run, not a suite config (this one holds the runs "
      f"{list(cfg.suite.keys())}); name one run's config, e.g. 'quickstart:dp_loops' or "
      "'quickstart:nondp'",
    )
  _check_source(cfg.data.source)  # before validate_config, which looks for an npz file
  model = cfg.model.get("name", "convnet")
  models = catalog.MODELS if models is None else models
  if model not in models:  # before it is imported
    _fail(
      "model.name",
      model,
      f"one of {tuple(models)}: what this side computes (a node's node config 'models', "
      f"the server's {MODELS_ENV}); the run's submitter names no code",
    )
  library_configs.validate_config(cfg)
  if cfg.method not in METHODS:
    _fail(
      "config",
      f"{name} (method={cfg.method!r})",
      f"a config whose method is one of {METHODS} (every federated method); a method that "
      "pools every client's records in one place is not federated and runs with "
      "experiments.run",
    )
  return cfg, label


def _settings_error(e: ConfigError, name: str) -> SettingsError:
  """:func:`fedlap_runs.flags.load_config`'s error as the run config's ``config`` or
  ``overrides``."""
  from fedlap_runs import flags  # pylint: disable=g-import-not-at-top

  if e.field == "config":
    text = str(e)
    why = (
      text.replace("--config=", "config=", 1)
      if text.startswith("--config=")
      else f"config={name!r} is invalid: {text.strip().splitlines()[-1]}"
    )
    return SettingsError("config", name, e.allowed, message=why)
  if e.field == "overrides":
    return SettingsError("overrides", e.value, e.allowed)
  if e.allowed == flags.CONFIG_FIELDS:
    return SettingsError(
      "overrides",
      e.field,
      e.allowed,
      message=f"overrides: {e.field!r} is not a field of the config; allowed: {e.allowed}",
    )
  return SettingsError(
    e.field,
    e.value,
    e.allowed,
    message=f"overrides: {e.field}={e.value!r} is invalid; allowed: {e.allowed}",
  )


# ----------------------------------------------------------------------------
# Run settings (server and clients) and node settings (one client).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The run config, checked; ``cfg`` is the resolved experiments config."""

  config_name: str
  overrides: str
  label: str
  cfg: Any
  run_dir: Path
  min_clients: int
  round_timeout: float
  join_timeout: float
  max_epsilon: float
  unsafe_dp_keys_from_server: bool
  partition_keys: Mapping[str, int] = dataclasses.field(default_factory=dict)
  max_image_abs: float = 0.0
  resume: bool = False
  max_update_norm: float | str | None = ""
  max_classes_per_client: int = 0

  @property
  def num_clients(self) -> int:
    return int(self.cfg.data.num_clients)

  @property
  def dp(self) -> bool:
    return bool(self.cfg.dp.enabled)


def with_defaults(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
  """``run_config`` over :data:`RUN_CONFIG_DEFAULTS`; unknown keys are refused (a key of
  :data:`REMOVED_RUN_CONFIG_KEYS` with the reason)."""
  run_config = dict(run_config or {})
  for key, why in REMOVED_RUN_CONFIG_KEYS.items():
    if key in run_config:
      raise SettingsError(
        key, run_config[key], why, message=f"run config key {key!r} is not allowed: {why}"
      )
  unknown = sorted(set(run_config) - set(RUN_CONFIG_DEFAULTS))
  if unknown:
    raise SettingsError(
      "run config",
      unknown,
      str(sorted(RUN_CONFIG_DEFAULTS)),
      message=f"run config keys {unknown} are unknown; allowed: {sorted(RUN_CONFIG_DEFAULTS)}",
    )
  return {**RUN_CONFIG_DEFAULTS, **run_config}


def run_settings(
  run_config: Mapping[str, Any] | None, models: tuple[str, ...] | None = None
) -> RunSettings:
  """Checks the run config and resolves its experiments config; ``models``: the models this
  side computes (:func:`allowed_models`; ``None``: the catalog's)."""
  rc = with_defaults(run_config)
  cfg, label = load_config(rc["config"], rc["overrides"], models)
  k = int(cfg.data.num_clients)
  per_round = int(cfg.data.get("clients_per_round") or k)
  min_clients = rc["min-clients"]
  if not is_int(min_clients) or not 0 <= min_clients <= per_round:
    _fail(
      "min-clients",
      min_clients,
      f"an integer in [0, {per_round}] (0: all {per_round} "
      "clients of a round, data.clients_per_round or data.num_clients)",
    )
  # Whatever the method: only FedLAP reads the strategy, and no other's default is "median".
  if (
    cfg.get("server", {}).get("radius_strategy") == "median"
    and (min_clients or per_round) < MEDIAN_RADIUS_MIN_CLIENTS
  ):
    _fail(
      "min-clients",
      min_clients,
      f"at least {MEDIAN_RADIUS_MIN_CLIENTS} with server.radius_strategy='median' (the median "
      "of two radii is their mean: one client at the radius floor halves the server's radius)",
    )
  timeout = rc["round-timeout"]
  if not is_real(timeout) or not 0 < timeout:
    _fail("round-timeout", timeout, "a finite number of seconds > 0")
  join = rc["join-timeout"]
  if not is_real(join) or not 0 <= join:
    _fail("join-timeout", join, "a finite number of seconds >= 0")
  max_eps = rc["max-epsilon"]
  if not _is_real_or_inf(max_eps) or max_eps <= 0:
    _fail("max-epsilon", max_eps, "a number > 0 (inf: no cap from the server)")
  unsafe = rc["unsafe-dp-keys-from-server"]
  if not isinstance(unsafe, bool):
    _fail("unsafe-dp-keys-from-server", unsafe, "true or false")
  if not isinstance(rc["resume"], bool):
    _fail("resume", rc["resume"], "true or false")
  if not isinstance(rc["run-dir"], str):
    _fail("run-dir", rc["run-dir"], "a path (a string; '' for the default)")
  from fedlap_flower import binding  # pylint: disable=g-import-not-at-top

  keys = rc["partition-keys"]
  if not isinstance(keys, str):
    _fail("partition-keys", keys, "a string of PARTITION=SHA256:... pairs ('' for first come)")
  try:
    partition_keys = binding.parse_partition_keys(keys, k)
  except ValueError as e:
    raise SettingsError(
      "partition-keys", keys, "PARTITION=SHA256:... pairs", message=str(e)
    ) from None
  max_image = rc["max-image-abs"]
  if not is_real(max_image) or not 0 <= max_image:
    _fail("max-image-abs", max_image, "a finite number > 0, or 0 for the default bound")
  max_update = _update_norm(rc["max-update-norm"])
  max_classes = rc[_method_work.MAX_CLASSES_KEY]
  if not is_int(max_classes) or max_classes < 0:
    _fail(
      _method_work.MAX_CLASSES_KEY,
      max_classes,
      "an integer >= 1, the most classes a client holds (0: not stated)",
    )
  run_dir = Path(rc["run-dir"] or os.path.join("runs", "flower", label)).expanduser()
  return RunSettings(
    rc["config"],
    rc["overrides"],
    label,
    cfg,
    run_dir,
    min_clients or per_round,
    float(timeout),
    float(join),
    float(max_eps),
    unsafe,
    partition_keys,
    float(max_image),
    rc["resume"],
    max_update,
    int(max_classes),
  )


def _update_norm(value) -> float | str | None:
  """``max-update-norm`` checked: a float > 0, ``'auto'``, ``''`` or ``None`` (``'none'``)."""
  if isinstance(value, str) and value in UPDATE_NORM_WORDS:
    return None if value == "none" else value
  if is_real(value) and value > 0:
    return float(value)
  _fail("max-update-norm", value, UPDATE_NORM_ALLOWED)


@dataclasses.dataclass(frozen=True)
class NodeSettings:
  """One client's node config, checked against the run.

  ``max_delta`` is the node's ``max-delta`` (``None``: the default,
  :meth:`delta_bound`).
  """

  partition_id: int
  num_partitions: int
  data_path: Path | None
  state_dir: Path | None
  max_epsilon: float
  requires_dp: bool = False
  max_delta: float | None = None

  def delta_bound(self, num_records: int) -> float:
    """The largest ``dp.delta`` this client accepts with ``num_records`` records."""
    default = min(DEFAULT_MAX_DELTA, 1.0 / num_records)
    return default if self.max_delta is None else self.max_delta


def node_settings(node_config: Mapping[str, Any], run: RunSettings) -> NodeSettings:
  """Checks a client's node config (see the module docstring)."""
  nc = dict(node_config or {})
  unknown = sorted(set(nc) - set(NODE_CONFIG_KEYS))
  if unknown:
    raise SettingsError(
      "node config",
      unknown,
      str(list(NODE_CONFIG_KEYS)),
      message=f"node config keys {unknown} are unknown; allowed: {list(NODE_CONFIG_KEYS)}",
    )
  k = run.num_clients
  for key in ("partition-id", "num-partitions"):
    if key not in nc:
      raise SettingsError(
        key,
        None,
        f"flower-supernode --node-config 'partition-id=K num-partitions={k}'",
        message=f"node config {key} is missing; allowed: flower-supernode "
        f"--node-config 'partition-id=K num-partitions={k}'",
      )
  num = nc["num-partitions"]
  if not is_int(num) or num != k:
    _fail("num-partitions", num, f"{k}, the data.num_clients of config {run.config_name!r}")
  pid = nc["partition-id"]
  if not is_int(pid) or not 0 <= pid < k:
    _fail("partition-id", pid, f"an integer in [0, {k - 1}]")
  data_path = nc.get("data-path")
  if data_path is not None:
    if not isinstance(data_path, str) or not os.path.isfile(os.path.expanduser(data_path)):
      _fail("data-path", data_path, "the path of an existing .npz file with x_train, y_train")
    data_path = Path(data_path).expanduser()
  state_dir = nc.get("state-dir")
  if state_dir is not None and (not isinstance(state_dir, str) or not state_dir):
    _fail("state-dir", state_dir, "a directory path")
  env_root = os.environ.get(STATE_ROOT_ENV, "")
  if state_dir:
    state_dir = Path(state_dir).expanduser()
  elif env_root:
    state_dir = Path(env_root).expanduser() / f"client-{pid}"
  elif run.dp:
    raise SettingsError(
      "state-dir",
      None,
      "this client's own state directory",
      message="node config state-dir is missing; a DP client keeps its "
      "privacy ledger only where its own node config says (never where the "
      "run config would put it). Allowed: flower-supernode --node-config "
      f"\"... state-dir='/var/lib/fedlap/site_k'\", or {STATE_ROOT_ENV} in "
      "the client's environment",
    )
  else:
    state_dir = default_state_dir(run.label, pid)
  max_eps = nc.get("max-epsilon", math.inf)
  if not _is_real_or_inf(max_eps) or max_eps <= 0:
    _fail("max-epsilon", max_eps, "a number > 0")
  max_delta = nc.get("max-delta")
  if max_delta is not None and (not is_real(max_delta) or not 0 < max_delta < 1):
    _fail("max-delta", max_delta, "a probability in the open interval (0, 1)")
  check_compute(nc, run.cfg)
  return NodeSettings(
    pid,
    num,
    data_path,
    state_dir,
    min(float(max_eps), run.max_epsilon),
    requires_dp="max-epsilon" in nc,
    max_delta=None if max_delta is None else float(max_delta),
  )


def check_compute(node_config: Mapping[str, Any], cfg) -> None:
  """Refuses a run that would make this client compute more than its node config allows
  (:data:`COMPUTE_CAPS`: each ``max-`` key caps one config field; default: the paper's largest).

  Raises:
    SettingsError: a cap that is not an integer >= 1 (naming the node-config key), or a config
      field above its cap (naming the field, its value and the key that allows more).
  """
  for key, (field, default) in COMPUTE_CAPS.items():
    cap = node_config.get(key, default)
    if not is_int(cap) or cap < 1:
      _fail(key, cap, "an integer >= 1")
    value = cfg
    for part in field.split("."):
      value = value.get(part) if hasattr(value, "get") else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
      raise SettingsError(
        field,
        value,
        f"at most {cap}",
        message=f"{field}={value!r} is more than this client computes; allowed: at most {cap} "
        f"(its node config's {key}{'' if key in node_config else ', the default'})",
      )


def default_state_dir(label: str, partition_id: int) -> Path:
  """A non-DP client's state directory without ``state-dir`` or :data:`STATE_ROOT_ENV`:
  ``~/.fedlap_flower/<label>/client-<k>`` in this (the client's) user's home.

  ``label`` comes from the run config, so it must be one plain path component
  (:data:`_LABEL`: letters, digits, ``_ . + -``, starting with a letter or digit); any other
  is refused rather than rewritten, so two labels never share a directory.

  Raises:
    SettingsError: ``label`` could leave ``~/.fedlap_flower`` or is not a plain name.
  """
  if not isinstance(label, str) or not _LABEL.fullmatch(label):
    raise SettingsError(
      "config",
      label,
      "a run label of letters, digits and _ . + - that starts with a letter or digit",
      message=f"the run label {label!r} cannot name a client's state directory; allowed: "
      "letters, digits and _ . + -, starting with a letter or digit (or give the client a "
      f"state-dir or {STATE_ROOT_ENV})",
    )
  return Path(DEFAULT_STATE_ROOT).expanduser() / label / f"client-{partition_id}"


def unsafe_consent() -> bool:
  """True if this client's environment allows server-chosen DP keys (tests only)."""
  return os.environ.get(UNSAFE_ENV, "") == "1"
