"""What ``experiments/`` knows of each method, in one table (:data:`ENTRIES`, by ``cfg.method``).

The table is built from the library's registry (:data:`fedlap_jax.methods.REGISTRY`), one
entry per registry method: the algorithm (:func:`fedlap_jax.rounds.algorithm`), the mechanism,
the privacy policy, the DP twin, the carried and pooled data come from the method's value; what
is the experiment's own (how a config class is written in an experiment config: :data:`SPECS`)
is kept here, one row per library config class. A method that extends another (FedAdam) takes
that one's row, its config built on the other's with its own section (:func:`extended_spec`).
Every other module of ``experiments/`` is generic: it looks a method up here and calls what its
:class:`Entry` holds. An entry says

* how the method's library config is built (``spec``, an :class:`fedlap_runs.sections.Spec`:
  where it reads the fields every method shares, such as ``client.batch_size`` and
  ``server.weighting``, and which sections are its own);
* how its :class:`~fedlap_jax.algorithm.FederatedAlgorithm` is built (``algorithm``);
* its privacy policy (``privacy``: DP required, refused or optional, and what the config
  needs changed with DP on: ``dp_twin``, ``dp_fields``) and what else its config must hold
  (``check``, ``one_shot``);
* what the data must allow (``synthetic``: it learns synthetic sets with one label per slot;
  ``pooled``: one pool of every client's records);
* how its clients run (``side_by_side``).

It also holds the round summaries of methods whose metrics need their own reading
(:func:`metrics_view`) and the methods' labels (:func:`label`, :func:`labels`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import numpy as np

from fedlap_jax import baselines, optim, rounds
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax import dp_config as dp_config_lib
from fedlap_jax.methods.fedlap import config as core
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.state import RoundMetrics
from fedlap_jax.method import Method, ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY, fedlap
from fedlap_jax.models import embed_fn, init_fn

from fedlap_runs import sections
from fedlap_runs.configs import schema
from fedlap_runs.sections import Spec

# Entries of config.dp that the experiment reads (DPConfig does not have them).
DP_EXPERIMENT_FIELDS = ("enabled", "match_epsilon_of", "target_epsilon", "epsilon_for")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One method as ``experiments/`` runs it (see the module docstring).

  Attributes:
    name: ``cfg.method``.
    spec: how its library config is built (:func:`fedlap_runs.sections.build`).
    algorithm: ``algorithm(config, model, facts, *, client_backend, cfg)`` -> its
      :class:`~fedlap_jax.algorithm.FederatedAlgorithm` (``model``, ``facts``: of
      :mod:`fedlap_runs.build`).
    privacy: ``privacy(dp_enabled)`` -> ``None`` if the method runs so, else what ``dp.enabled``
      must be instead (the ``allowed`` of the error).
    check: the static checks of the config that building the library config does not do
      (``None``: building it is the check).
    dp_twin: ``(method, why)``: the method ``dp.enabled=True`` needs instead of this one.
    dp_fields: ``(field, ok, value, why)``: what DP needs of the other fields.
    one_shot: every client's work is round 1 (``rounds`` must be 1).
    synthetic: it learns synthetic sets (one label per slot, ``client.ipc`` per class).
    pooled: its synthetic sets are learnt from one pool of every client's records.
    side_by_side: its clients' rounds may run side by side (``client_backend='auto'``).
    mechanism: its library config -> its DP mechanism (``None`` without DP): the registry
      method's :meth:`~fedlap_jax.method.Method.mechanism`.
  """

  name: str
  spec: Spec
  algorithm: Callable[..., Any]
  privacy: Callable[[bool], str | None]
  check: Callable[[Any], None] | None = None
  dp_twin: tuple[str, str] | None = None
  dp_fields: tuple = ()
  one_shot: bool = False
  synthetic: bool = False
  pooled: bool = False
  side_by_side: bool = False
  mechanism: Callable[[Any], Any] | None = None


# -- the library configs -------------------------------------------------------------------


def dp_config(cfg) -> dp_config_lib.DPConfig | None:
  """``config.dp`` as a :class:`fedlap_jax.dp_config.DPConfig`, or ``None`` when disabled."""
  if not cfg.dp.enabled:
    return None
  return sections.build_section(dp_config_lib.DPConfig, cfg, "dp", ignore=DP_EXPERIMENT_FIELDS)


def server_config(cfg) -> core.ServerConfig:
  """``config.server`` as a :class:`fedlap_jax.methods.fedlap.config.ServerConfig`; its
  ``optimizer`` from
  the section ``server.optimizer`` (plain SGD there, the default: ``None``, the SGD of
  ``server.momentum`` and ``server.weight_decay``)."""
  spec = optimizer_section(cfg, "server.optimizer")
  return sections.build_section(
    core.ServerConfig, cfg, "server", ignore=("optimizer",), optimizer=_other_than_sgd(spec)
  )


def _other_than_sgd(spec: optim.Optimizer) -> optim.Optimizer | None:
  """A section's spec for a field whose ``None`` is the SGD of numeric fields beside it
  (``server.optimizer``, ``client.image_optimizer``): plain SGD there (the default) is
  ``None``."""
  return None if spec == optim.SGD else spec


def _fedlap_values(cfg, max_client_size):
  del max_client_size
  client = sections.build_section(
    core.ClientConfig,
    cfg,
    "client",
    spec=FEDLAP_SPEC,
    ignore=("model_optimizer", "image_optimizer"),
    dp=dp_config(cfg),
    model_optimizer=optimizer_section(cfg, "client.model_optimizer"),
    image_optimizer=_other_than_sgd(optimizer_section(cfg, "client.image_optimizer")),
  )
  return {"client": client, "server": server_config(cfg)}


FEDLAP_SPEC = Spec(
  make=lambda cfg, **values: core.FedLAPConfig(**values),
  reads={
    "rounds": "rounds",
    "learning_rate": "learning_rate",
    "synthetic_init": "synthetic_init",
    "lr_schedule": "lr_schedule",
  },
  derive=_fedlap_values,
  derived={"client": "client", "server": "server"},
  nested=((core.ClientConfig, "client"), (core.ServerConfig, "server")),
)


# The baselines' optimiser sections (config.baseline.NAME: fedlap_jax.optim.Optimizer specs).
BASELINE_OPTIMIZERS = ("client_optimizer", "server_optimizer")


def optimizer_section(cfg, path: str) -> optim.Optimizer:
  """The :class:`fedlap_jax.optim.Optimizer` of config section ``path`` (``baseline.NAME``);
  an error names ``path.field``."""
  section, _, name = path.partition(".")
  try:
    return schema.build(optim.Optimizer, cfg[section][name], path)
  except ConfigError as e:
    if e.field.startswith(f"{path}."):
      raise
    raise sections.renamed(e, f"{path}.{e.field}") from None


def baseline_optimizers(cfg) -> dict[str, optim.Optimizer]:
  """``{client_optimizer, server_optimizer}`` of ``config.baseline``."""
  return {f: optimizer_section(cfg, f"baseline.{f}") for f in BASELINE_OPTIMIZERS}


# The optimiser sections of the library dataclasses written as sections (config path -> the
# dataclass whose field it is, and whose optimiser it is in words): FedLAP's client model and
# images, the synthetic-set servers', FedDM's and DSC's / PSG's images.
SECTION_OPTIMIZERS = {
  "client.model_optimizer": (core.ClientConfig, "an optimiser of FedLAP's clients"),
  "client.image_optimizer": (core.ClientConfig, "an optimiser of FedLAP's clients"),
  "server.optimizer": (
    core.ServerConfig,
    "the optimiser of the servers that train on synthetic sets",
  ),
  "feddm.image_optimizer": (feddm.FedDMConfig, "FedDM's synthetic images' optimiser"),
  "condense.image_optimizer": (
    condensation.CondensationConfig,
    "DSC's and PSG's synthetic images' optimiser",
  ),
}


def section_optimizers(cfg) -> dict[str, optim.Optimizer]:
  """``{path: spec}`` of :data:`SECTION_OPTIMIZERS` (``client.model_optimizer``,
  ``client.image_optimizer``, ``server.optimizer``, ``feddm.image_optimizer``,
  ``condense.image_optimizer``)."""
  return {path: optimizer_section(cfg, path) for path in SECTION_OPTIMIZERS}


def reads_section(entry: "Entry", path: str) -> bool:
  """Whether ``entry``'s library config holds the dataclass of config section ``path``'s
  parent (``client.model_optimizer``: a :class:`~fedlap_jax.methods.fedlap.config.ClientConfig`
  written as ``client``; ``feddm.image_optimizer``: FedDM's own section), so that the method reads
  the optimiser there."""
  cls, parent = SECTION_OPTIMIZERS[path][0], path.partition(".")[0]
  spec = entry.spec
  return (cls, parent) in spec.nested or (spec.cls is cls and spec.section == parent)


def _baseline_values(cfg, max_client_size):
  dp = dp_config(cfg)
  return {
    **baseline_optimizers(cfg),
    "dp": dp,
    "max_client_size": max_client_size,
    # Under DP the per-client training loss (a non-private diagnostic that costs a forward
    # pass) is tracked only with debug_nonprivate_stats.
    "track_loss": dp is None or bool(cfg.get("debug_nonprivate_stats", False)),
  }


def reads_baseline(entry: "Entry") -> bool:
  """Whether ``entry``'s library config is built from the ``baseline`` section (the FedAvg
  family and the methods that extend it)."""
  return entry.spec.derive is _baseline_values


def _config_name(method: str) -> str:
  """The registry method whose library config ``method``'s builds on (itself by default)."""
  return REGISTRY.method(method).extends or method


BASELINE_SPEC = Spec(
  make=lambda cfg, **values: baselines.baseline_config(_config_name(cfg.method), **values),
  reads={
    "rounds": "rounds",
    "learning_rate": "learning_rate",
    "lr_schedule": "lr_schedule",
    "local_epochs": "baseline.local_epochs",
    "prox_mu": "baseline.prox_mu",
    "batch_size": "client.batch_size",
    "poisson_capacity": "client.poisson_capacity",
    "weighting": "server.weighting",
    "server_lr": "baseline.server_lr",
  },
  derive=_baseline_values,
  derived={
    "dp": "dp.enabled",
    "client_optimizer": "baseline.client_optimizer",
    "server_optimizer": "baseline.server_optimizer",
  },
  strip=("local.",),
)


def _image_optimizer(cfg, section: str) -> optim.Optimizer | None:
  """The synthetic images' spec of FedDM's or DSC's / PSG's own section
  (``SECTION.image_optimizer``; plain SGD there, the default: ``None``, the SGD of
  ``SECTION.image_momentum``)."""
  return _other_than_sgd(optimizer_section(cfg, f"{section}.image_optimizer"))


FEDDM_SPEC = Spec(
  make=lambda cfg, **values: schema_build(
    feddm.FedDMConfig, cfg, "feddm", ignore=("image_optimizer",), **values
  ),
  reads={
    "ipc": "client.ipc",
    "batch_size": "client.batch_size",
    "synthetic_init": "synthetic_init",
    "poisson_capacity": "client.poisson_capacity",
    "learning_rate": "learning_rate",
  },
  derive=lambda cfg, _: {
    "server": server_config(cfg),
    "image_optimizer": _image_optimizer(cfg, "feddm"),
  },
  derived={"server": "server", "image_optimizer": "feddm.image_optimizer"},
  section="feddm",
  cls=feddm.FedDMConfig,
  nested=((core.ServerConfig, "server"),),
)


def schema_build(cls, cfg, section: str, *, ignore=(), **values):
  """``cls`` from the method's own section, less ``ignore`` (entries built elsewhere, such as
  the optimiser sections); errors are renamed by the caller's spec."""
  return schema.build(cls, cfg[section], section, ignore=ignore, **values)


def _condense_values(cfg, max_client_size):
  del max_client_size
  dp, server = dp_config(cfg), server_config(cfg)
  c = cfg.condense
  outer, inner = c.outer_loop, c.inner_loop
  if outer is None or inner is None:
    try:
      published = condensation.dc_loops(cfg.client.ipc)
    except ConfigError as e:
      raise ConfigError(
        "client.ipc",
        e.value,
        e.allowed,
        message=f"client.ipc={e.value!r} has no published condensation loops; "
        f"allowed: {e.allowed} (condense.outer_loop, condense.inner_loop)",
      ) from None
    outer = published[0] if outer is None else outer
    inner = published[1] if inner is None else inner
  return {
    "outer_loop": outer,
    "inner_loop": inner,
    "classwise": REGISTRY.method(cfg.method).privacy != "required",  # PSG: class-agnostic
    "dp": dp,
    "server": server,
    "image_optimizer": _image_optimizer(cfg, "condense"),
  }


def _oneshot(cfg, *, server, learning_rate, **values):
  cond = schema_build(
    condensation.CondensationConfig,
    cfg,
    "condense",
    ignore=("lr_decay", "outer_loop", "inner_loop", "image_optimizer"),
    **values,
  )
  return condensation.OneShotConfig(
    method=cfg.method,
    condensation=cond,
    server=server,
    learning_rate=learning_rate,
    lr_decay=cfg.condense.lr_decay,
  )


ONESHOT_SPEC = Spec(
  make=_oneshot,
  reads={
    "ipc": "client.ipc",
    "batch_size": "client.batch_size",
    "synthetic_init": "synthetic_init",
    "poisson_capacity": "client.poisson_capacity",
    "learning_rate": "learning_rate",
  },
  derive=_condense_values,
  derived={
    "outer_loop": "condense.outer_loop",
    "inner_loop": "condense.inner_loop",
    "classwise": "method",
    "method": "method",
    "dp": "dp.enabled",
    "server": "server",
    "condensation": "condense",
    "image_optimizer": "condense.image_optimizer",
  },
  section="condense",
  cls=condensation.CondensationConfig,
  nested=((core.ServerConfig, "server"),),
)

# The fields of the one-shot methods' two dataclasses that the config writes elsewhere
# (fedlap_runs/configs/default.py leaves them out of config.condense).
FEDDM_SHARED = FEDDM_SPEC.shared()
CONDENSE_SHARED = tuple(
  f
  for f in ONESHOT_SPEC.shared()
  if f in schema.fields(condensation.CondensationConfig) and f not in ("outer_loop", "inner_loop")
)
# OneShotConfig's fields that _oneshot fills from elsewhere (config.condense holds lr_decay).
ONESHOT_SHARED = ("method", "condensation", "server", "learning_rate")


# -- the algorithms ------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _embed_fn(module):
  """One ``embed(params, x) -> (features, logits)`` per Flax module (FedDM)."""
  return embed_fn(module)


@functools.lru_cache(maxsize=4)
def _init_fn(module, image_shape):
  """One ``init(key) -> params`` per Flax module and image shape (DSC, PSG)."""
  return init_fn(module, image_shape)


def model_fns(model, image_shape) -> ModelFns:
  """The run's :class:`~fedlap_jax.method.ModelFns` of its :class:`fedlap_runs.build.Model`:
  ``apply_fn``, FedDM's ``embed_fn``, DSC / PSG's ``init_fn`` (one function each per module)."""
  return ModelFns(
    model.apply_fn, _embed_fn(model.module), _init_fn(model.module, tuple(image_shape))
  )


def algorithm(method: Method):
  """``algorithm(config, model, facts, *, client_backend, cfg)`` of ``method``: the registry's
  method bound by :func:`fedlap_jax.rounds.algorithm` to the run's model and facts."""

  def build(config, model, facts, *, client_backend, cfg):
    fns = model_fns(model, facts.image_shape)
    run = run_facts(cfg, facts, model.num_params)
    return rounds.algorithm(method, config, fns, run, client_backend=client_backend)

  return build


def run_facts(cfg, facts, num_params: int, max_classes_per_client: int | None = None) -> RunFacts:
  """The :class:`~fedlap_jax.method.RunFacts` of a run from its config and its
  :class:`fedlap_runs.build.Facts` (both front ends build them here).

  ``max_classes_per_client``: the most classes a client holds as a party states it that reads
  only its own data; taken only where ``facts`` does not know it (a named partition does).
  """
  known = facts.max_classes_per_client
  return RunFacts(
    tuple(facts.image_shape),
    int(cfg.data.num_clients),
    int(num_params),
    max_classes_per_client if known is None else known,
    facts.max_client_size,
    cfg.data.get("clients_per_round"),
  )


# -- the privacy policies and checks -------------------------------------------------------


def _privacy(method: Method):
  """``privacy(dp_enabled)`` of ``method`` (its :attr:`~fedlap_jax.method.Method.privacy`):
  ``None`` when it runs so, else what ``dp.enabled`` must be, with the method's note."""
  if method.privacy == "optional":
    return lambda enabled: None
  dp = method.privacy == "required"
  note = f" ({method.privacy_note})" if method.privacy_note else ""
  return lambda enabled: None if enabled == dp else f"{dp} for method={method.name!r}{note}"


def _check_baseline(cfg) -> None:
  """A baseline's config needs the data's largest client to be built (its step count): before
  the data, the library checks the whole config built on a stand-in largest client of one
  batch."""
  sections.build(entry(cfg.method).spec, cfg, max_client_size=cfg.client.batch_size)


# What FedLAP-DP needs of the other fields: (field, test of the value, the value to set, why).
FEDLAP_DP_FIELDS = (
  ("synthetic_init", lambda v: v == "noise", "noise", "real images would be published"),
  (
    "client.calibrate_radius",
    lambda v: v is False,
    False,
    "a radius measured on real data is not private",
  ),
  (
    "server.radius_strategy",
    lambda v: v in ("constant", "fixed"),
    "constant",
    "the other strategies read r_k measured on real data",
  ),
)


# The experiment binding of each library config class: how the config is built from the
# experiment config and what else it must hold.
SPECS = {
  core.FedLAPConfig: dict(spec=FEDLAP_SPEC, dp_fields=FEDLAP_DP_FIELDS),
  baselines.BaselineConfig: dict(spec=BASELINE_SPEC, check=_check_baseline),
  feddm.FedDMConfig: dict(spec=FEDDM_SPEC),
  condensation.OneShotConfig: dict(spec=ONESHOT_SPEC, one_shot=True),
}


def _entry(method: Method) -> Entry:
  """The entry of a registry method (of one that extends another: that one's, its config
  built on the other's)."""
  if method.extends is not None:
    base = _entry(REGISTRY.method(method.extends))
    return dataclasses.replace(
      base,
      name=method.name,
      spec=extended_spec(base.spec, method),
      algorithm=algorithm(method),
      privacy=_privacy(method),
      dp_twin=method.dp_twin,
      mechanism=method.mechanism,
    )
  return Entry(
    method.name,
    algorithm=algorithm(method),
    privacy=_privacy(method),
    dp_twin=method.dp_twin,
    synthetic="synthetic" in method.carried,
    pooled=not method.federated,
    side_by_side=method.side_by_side,
    mechanism=method.mechanism,
    **SPECS[method.config_type],
  )


def extended_spec(base: Spec, method: Method) -> Spec:
  """``base`` whose config ``method.extend`` builds on, with the method's own section
  (``config.<name>``, the fields of ``method.own_section``; absent: their defaults)."""
  assert method.extend is not None and method.own_section is not None
  extend, own, name = method.extend, method.own_section, method.name

  def make(cfg, **values):
    try:
      section = schema.build(own, cfg[name], name) if name in cfg else own()
    except ConfigError as e:
      if e.field.startswith(f"{name}."):
        raise
      raise sections.renamed(e, f"{name}.{e.field}") from None
    return extend(base.make(cfg, **values), section)

  return base._replace(make=make, section=name, cls=own)


def _entries() -> dict[str, Entry]:
  return {name: _entry(m) for name, m in REGISTRY.items()}


ENTRIES: dict[str, Entry] = _entries()


def entry(method: str) -> Entry:
  """The entry of ``method``.

  Raises:
    ConfigError: ``method`` is none of the registry's (:data:`fedlap_jax.methods.REGISTRY`).
  """
  if method not in ENTRIES:
    raise ConfigError("method", method, f"one of {tuple(ENTRIES)}")
  return ENTRIES[method]


def label(method: str, dp: bool) -> str:
  """Display name of ``method`` (the registry's :attr:`~fedlap_jax.method.Method.label`),
  e.g. ``"FedLAP-DP"``; an unknown name is its own label."""
  return REGISTRY[method].label(dp) if method in REGISTRY else method


def labels() -> tuple[str, ...]:
  """Every method's labels (without DP, then with), in the registry's order (report columns)."""
  return tuple(dict.fromkeys(m.label(dp) for m in REGISTRY.values() for dp in (False, True)))


# -- round metrics that need their own reading ---------------------------------------------


class MetricsView(NamedTuple):
  """How a round's metrics of one type are summarised (:mod:`experiments.outputs`).

  Attributes:
    summary: ``summary(metrics, num_clients) -> {name: value}``, the record's fields.
    nonprivate: the summary's names that are raw statistics of the clients' records.
    non_finite: ``non_finite(metrics, num_clients, ids) -> [problem, ...]``.
  """

  summary: Callable[[Any, int], dict]
  nonprivate: Callable[[Any], set]
  non_finite: Callable[[Any, int, list], list]


def _fedlap_non_finite(metrics, num_clients: int, ids: list) -> list[str]:
  problems = []
  loss = np.asarray(metrics.client.matching_loss).reshape(num_clients, -1)
  for k in np.flatnonzero(~np.isfinite(loss).all(axis=1)):
    problems.append(f"matching loss of client {ids[k]} is {loss[k][~np.isfinite(loss[k])][0]}")
  r = np.asarray(metrics.client_radius)
  for k in np.flatnonzero(~np.isfinite(r)):
    problems.append(f"radius of client {ids[k]} is {r[k]}")
  return problems


METRICS_VIEWS = {
  # FedLAP's summary names its client metrics without the "client." prefix.
  RoundMetrics: MetricsView(
    lambda m, _: fedlap.round_record(m),
    lambda m: set(type(m.client).NONPRIVATE),
    _fedlap_non_finite,
  )
}


def metrics_view(metrics) -> MetricsView | None:
  """The view of a round's ``metrics`` type (``None``: every leaf, generically)."""
  return METRICS_VIEWS.get(type(metrics))
