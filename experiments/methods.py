"""What ``experiments/`` knows of each method's config, in one table (:data:`ENTRIES`, by
``cfg.method``).

:mod:`experiments.library_configs` and :mod:`experiments.configs.default` are generic: they
look a method up here and use what its :class:`Entry` holds. An entry says

* how the method's library config is built (``spec``, an :class:`experiments.sections.Spec`:
  where it reads the fields every method shares, such as ``client.batch_size`` and
  ``server.weighting``, and which sections are its own);
* its privacy policy (``privacy``: DP required, refused or optional, and what the config
  needs changed with DP on: ``dp_twin``, ``dp_fields``) and what else its config must hold
  (``check``, ``one_shot``);
* what the data must allow (``synthetic``: it learns synthetic sets with one label per slot;
  ``pooled``: one pool of every client's records).

The library's registry of methods will replace this table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fedlap_jax import baselines, condensation, feddm
from fedlap_jax import config as core
from fedlap_jax.checks import ConfigError, is_int

from experiments import sections
from experiments.configs import schema
from experiments.sections import Spec

# Entries of config.dp that the experiment reads (DPConfig does not have them).
DP_EXPERIMENT_FIELDS = ("enabled", "match_epsilon_of", "target_epsilon", "epsilon_for")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One method as ``experiments/`` runs it (see the module docstring).

  Attributes:
    name: ``cfg.method``.
    spec: how its library config is built (:func:`experiments.sections.build`).
    privacy: ``privacy(dp_enabled)`` -> ``None`` if the method runs so, else what ``dp.enabled``
      must be instead (the ``allowed`` of the error).
    check: the static checks of the config that building the library config does not do
      (``None``: building it is the check).
    dp_twin: ``(method, why)``: the method ``dp.enabled=True`` needs instead of this one.
    dp_fields: ``(field, ok, value, why)``: what DP needs of the other fields.
    one_shot: every client's work is round 1 (``rounds`` must be 1).
    synthetic: it learns synthetic sets (one label per slot, ``client.ipc`` per class).
    pooled: its synthetic sets are learnt from one pool of every client's records.
  """

  name: str
  spec: Spec
  privacy: Callable[[bool], str | None]
  check: Callable[[Any], None] | None = None
  dp_twin: tuple[str, str] | None = None
  dp_fields: tuple = ()
  one_shot: bool = False
  synthetic: bool = False
  pooled: bool = False


# -- the library configs -------------------------------------------------------------------


def dp_config(cfg) -> core.DPConfig | None:
  """``config.dp`` as a :class:`fedlap_jax.config.DPConfig`, or ``None`` when disabled."""
  if not cfg.dp.enabled:
    return None
  return sections.build_section(core.DPConfig, cfg, "dp", ignore=DP_EXPERIMENT_FIELDS)


def server_config(cfg) -> core.ServerConfig:
  """``config.server`` as a :class:`fedlap_jax.config.ServerConfig`."""
  return sections.build_section(core.ServerConfig, cfg, "server")


def _fedlap_values(cfg, max_client_size):
  del max_client_size
  client = sections.build_section(
    core.ClientConfig, cfg, "client", spec=FEDLAP_SPEC, dp=dp_config(cfg)
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


def _baseline_values(cfg, max_client_size):
  dp = dp_config(cfg)
  return {
    "dp": dp,
    "max_client_size": max_client_size,
    # Under DP the per-client training loss (a non-private diagnostic that costs a forward
    # pass) is tracked only with debug_nonprivate_stats.
    "track_loss": dp is None or bool(cfg.get("debug_nonprivate_stats", False)),
  }


BASELINE_SPEC = Spec(
  make=lambda cfg, **values: baselines.baseline_config(cfg.method, **values),
  reads={
    "rounds": "rounds",
    "learning_rate": "learning_rate",
    "lr_schedule": "lr_schedule",
    "local_epochs": "baseline.local_epochs",
    "prox_mu": "baseline.prox_mu",
    "batch_size": "client.batch_size",
    "poisson_capacity": "client.poisson_capacity",
    "weighting": "server.weighting",
  },
  derive=_baseline_values,
  derived={"dp": "dp.enabled"},
  strip=("local.",),
)

FEDDM_SPEC = Spec(
  make=lambda cfg, **values: schema_build(feddm.FedDMConfig, cfg, "feddm", **values),
  reads={
    "ipc": "client.ipc",
    "batch_size": "client.batch_size",
    "synthetic_init": "synthetic_init",
    "poisson_capacity": "client.poisson_capacity",
    "learning_rate": "learning_rate",
  },
  derive=lambda cfg, _: {"server": server_config(cfg)},
  derived={"server": "server"},
  section="feddm",
  cls=feddm.FedDMConfig,
  nested=((core.ServerConfig, "server"),),
)


def schema_build(cls, cfg, section: str, **values):
  """``cls`` from the method's own section (errors are renamed by the caller's spec)."""
  return schema.build(cls, cfg[section], section, **values)


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
    "classwise": cfg.method not in core.DP_ONE_SHOT_METHODS,
    "dp": dp,
    "server": server,
  }


def _oneshot(cfg, *, server, learning_rate, **values):
  cond = schema_build(
    condensation.CondensationConfig,
    cfg,
    "condense",
    ignore=("lr_decay", "outer_loop", "inner_loop"),
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
  },
  section="condense",
  cls=condensation.CondensationConfig,
  nested=((core.ServerConfig, "server"),),
)

# The fields of the one-shot methods' two dataclasses that the config writes elsewhere
# (experiments/configs/default.py leaves them out of config.condense).
FEDDM_SHARED = FEDDM_SPEC.shared()
CONDENSE_SHARED = tuple(
  f
  for f in ONESHOT_SPEC.shared()
  if f in schema.fields(condensation.CondensationConfig) and f not in ("outer_loop", "inner_loop")
)
# OneShotConfig's fields that _oneshot fills from elsewhere (config.condense holds lr_decay).
ONESHOT_SHARED = ("method", "condensation", "server", "learning_rate")


# -- the privacy policies and checks -------------------------------------------------------


def _dp_required(method):
  return lambda enabled: None if enabled else f"True for method={method!r}"


def _dp_refused(allowed: str):
  return lambda enabled: allowed if enabled else None


def _one_shot_privacy(method):
  dp = method in core.DP_ONE_SHOT_METHODS
  return lambda enabled: (
    None
    if enabled == dp
    else f"{not enabled} for method={method!r} (PSG is the DP one-shot method: "
    f"{core.DP_ONE_SHOT_METHODS})"
  )


def _check_baseline(cfg) -> None:
  """A baseline's config needs the data's largest client to be built (its step count):
  before the data, its sections are checked one by one."""
  dp_config(cfg)
  if not is_int(cfg.client.batch_size) or cfg.client.batch_size < 1:
    raise ConfigError("client.batch_size", cfg.client.batch_size, "an integer >= 1")
  core.check_poisson_capacity(
    cfg.client.poisson_capacity, cfg.client.batch_size, "client.poisson_capacity"
  )
  weighting = cfg.server.weighting
  if weighting is not None and weighting not in core.WEIGHTINGS:
    raise ConfigError("server.weighting", weighting, f"None or one of {core.WEIGHTINGS}")
  if cfg.method in core.DP_BASELINE_METHODS and weighting == "size":
    raise ConfigError(
      "server.weighting",
      weighting,
      f"'uniform' or None for method={cfg.method!r} (Algorithm 3 averages the client "
      "updates with 1/K, the setting the privacy analysis covers)",
    )


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
# FedDM's DP variant protects class-wise statistics: not record-level DP.
FEDDM_NO_DP = (
  "False for method='feddm' (FedDM's DP variant protects class-wise statistics, a privacy "
  "notion not comparable with record-level DP; it is not implemented)"
)


def _entries() -> dict[str, Entry]:
  out = {
    "fedlap": Entry(
      "fedlap",
      FEDLAP_SPEC,
      privacy=lambda enabled: None,
      dp_fields=FEDLAP_DP_FIELDS,
      synthetic=True,
    )
  }
  for m in core.BASELINE_METHODS:
    twin = f"dp_{m}"
    if m in core.DP_BASELINE_METHODS:
      privacy = _dp_required(m)
    else:
      privacy = _dp_refused(
        f"False for method={m!r} (use method='dp_{m}' where a DP variant exists: "
        f"{core.DP_BASELINE_METHODS})"
      )
    out[m] = Entry(
      m,
      BASELINE_SPEC,
      privacy=privacy,
      check=_check_baseline,
      dp_twin=(twin, "its DP variant") if twin in core.DP_BASELINE_METHODS else None,
    )
  out["feddm"] = Entry("feddm", FEDDM_SPEC, privacy=_dp_refused(FEDDM_NO_DP), synthetic=True)
  for m in core.ONE_SHOT_METHODS:
    out[m] = Entry(
      m,
      ONESHOT_SPEC,
      privacy=_one_shot_privacy(m),
      dp_twin=None if m in core.DP_ONE_SHOT_METHODS else ("psg", "PSG is the DP one-shot method"),
      one_shot=True,
      synthetic=True,
      pooled=m == "dsc_centralized",
    )
  return out


ENTRIES: dict[str, Entry] = _entries()


def entry(method: str) -> Entry:
  """The entry of ``method``.

  Raises:
    ConfigError: ``method`` is none of :data:`fedlap_jax.config.METHODS`.
  """
  if method not in ENTRIES:
    raise ConfigError("method", method, f"one of {core.METHODS}")
  return ENTRIES[method]
