r"""Runs one experiment from a named config.

  python -m experiments.run --config=NAME [--config.FIELD=VALUE ...] [--workdir=DIR]

``NAME`` is a file of ``experiments/configs/`` without ``.py`` (``quickstart``,
``cifar_dp``, ...), optionally with an argument (``cifar_ablation_ipc:20``), or
a path to any config file (this command runs what its user names, on the
user's own machine: a config file is Python and is executed; the Flower app
takes only the names, :func:`load_config` with ``named_only=True``). A *suite* config (one with a ``suite`` section, e.g.
``quickstart``) runs each of its configs in ``WORKDIR/<run>`` and compares them
in ``WORKDIR/report``. Fields are overridden with ``--config.FIELD=VALUE``
(e.g. ``--config.seed=1``, ``--config.data.source=npz:/data/cifar10.npz``). The
work dir defaults to ``runs/<NAME>`` (``:`` replaced by ``_``); re-running the
same command resumes from its last checkpoint. ``--config.dp.target_epsilon=E`` sets a DP
run's noise multiplier, when it starts, so that its epsilon after its last round is ``E``
(:func:`calibrate_noise`; ``compare_dp:DATASET`` runs every DP method so). Without
``--config.seed`` a DP run draws its seed from the operating system's entropy and keeps it
in its work dir (:mod:`experiments.seeds`); a run without DP uses 0.

Compiled programs are kept between runs (:mod:`experiments.compilation_cache`): a second run
of a config on the same machine reads them back instead of compiling. They go to
``--config.compilation_cache_dir``, else ``$FEDLAP_COMPILATION_CACHE``, else
``~/.cache/fedlap_jax/jax_compilation_cache`` (``none``: off).

Exit status: 0 on success; 2 for bad input or damaged state (an invalid
config, data or work dir, a resume that is refused; a one-line message); 1
when a round produced NaN or Inf; 130 when interrupted (Ctrl-C: a round in
progress is abandoned); 143 after SIGTERM: the round in progress is finished
and checkpointed if it ends within ``--config.termination_grace_seconds``
(default 20) of the signal, else abandoned (charged to the privacy ledger as
spent, the last completed round's checkpoint kept), and the process exits at
once (:mod:`experiments.train`). Re-running the same command resumes after 1,
130 and 143, redoing an abandoned round.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:  # the annotation only; the module imports JAX lazily
  from fedlap_jax import accounting

from experiments import configs

CONFIG_DIR = configs.CONFIG_DIR


class ConfigArgError(ValueError):
  """``--config`` names no config file."""


def resolve_config_arg(value: str, *, named_only: bool = False) -> tuple[str, str]:
  """``'NAME[:ARG]'`` -> ``(path[:ARG], run name)``; paths are kept as they are.

  ``NAME`` is a module of ``experiments/configs/`` or an alias of
  :data:`experiments.configs.ALIASES` (its module and argument are substituted).
  With ``named_only`` a path (``NAME`` ending in ``.py`` or holding a path
  separator) is refused before anything on the disk is looked at, so the
  message is the same whether such a file exists or not.
  """
  name, sep, arg = value.partition(":")
  is_path = name.endswith(".py") or os.sep in name or bool(os.altsep and os.altsep in name)
  if named_only and is_path:
    raise ConfigArgError(
      f"--config={value!r} is invalid: a path; allowed: NAME[:ARG] with NAME one of "
      f"{list(configs.names())} (the configs of experiments/configs/)"
    )
  if is_path:
    path = name
    label = Path(name).stem
    target = path + sep + arg
  else:
    try:
      module, module_arg = configs.resolve(value)
    except KeyError:
      raise ConfigArgError(
        f"--config={value!r} is invalid: no experiments/configs/{name}.py; "
        f"allowed: one of {list(configs.names())} (optionally NAME:ARG), or "
        "a path to a config .py file"
      ) from None
    path = str(CONFIG_DIR / f"{module}.py")
    label = name
    target = path + ("" if module_arg is None else f":{module_arg}")
  safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", arg)  # npz:/a/b.npz must not nest the work dir
  return target, label + (f"_{safe}" if sep and arg else "")


def rewrite_argv(argv: list[str], *, named_only: bool = False) -> tuple[list[str], str | None]:
  """Replaces the value of ``--config`` by its file path; returns the run name too.

  ``named_only``: refuse a path (:func:`resolve_config_arg`).
  """
  out, name, i = [], None, 0
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config="):
      path, name = resolve_config_arg(a[len("--config=") :], named_only=named_only)
      out.append(f"--config={path}")
    elif a == "--config" and i + 1 < len(argv):
      path, name = resolve_config_arg(argv[i + 1], named_only=named_only)
      out += ["--config", path]
      i += 1
    else:
      out.append(a)
    i += 1
  return out, name


# What a --config.FIELD override may name (the ``allowed`` of an unknown field's ConfigError).
CONFIG_FIELDS = "the fields of experiments/configs/default.py"
# An override value that sets a None-able field (a ``config_dict.placeholder``) to None.
NONE_TEXTS = ("None", "none")


def _none_able(config, field: str) -> bool:
  """Whether ``field`` (dotted) of ``config`` is a placeholder, i.e. may be None."""
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top

  *parents, leaf = field.split(".")
  node = config
  for part in parents:
    node = node._fields.get(part) if isinstance(node, config_dict.ConfigDict) else None  # pylint: disable=protected-access
  return isinstance(node, config_dict.ConfigDict) and isinstance(
    node._fields.get(leaf), config_dict.FieldReference
  )  # pylint: disable=protected-access


# How ml_collections' config_flags begins the error of a config file whose get_config raised.
_CONFIG_FILE_ERROR = "Error whilst parsing config file"


def _config_error(e: Exception, name_arg: str, overrides: list[tuple[str, str]]):
  """The :class:`ConfigError` of a failed flag parse; its text is the command line's message.

  ``field`` is the override's field for an unknown field (``allowed``: :data:`CONFIG_FIELDS`)
  or a value its type does not parse, else ``"config"`` (the file did not load).
  """
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  inner = e.args[0] if e.args and isinstance(e.args[0], KeyError) else e
  if isinstance(inner, KeyError):  # an override of a field the config does not have
    detail = (inner.args[0] if inner.args else str(inner)).replace("\n", "; ")
    key = re.match(r"'([^']*)'", detail)  # the unknown key first, then any suggestions
    field, text = next(
      ((f, t) for f, t in overrides if key and key.group(1) in f.split(".")),
      overrides[0] if overrides else ("", ""),
    )
    return library_configs.ConfigError(
      field,
      text,
      CONFIG_FIELDS,
      message=f"unknown config field in --config.{field}={text}: {detail} "
      f"(allowed: {CONFIG_FIELDS})",
    )
  message = str(e)
  for field, text in reversed(overrides):  # absl: "flag --config.FIELD=VALUE: why"
    prefix = f"flag --config.{field}={text}: "
    if message.startswith(prefix):
      return library_configs.ConfigError(
        field, text, f"a value of the field's type ({message[len(prefix) :]})", message=message
      )
  # The config's own get_config refused: ml_collections re-raises its error with the traceback
  # as text (the original is the context of that re-raise); the original's message is the reason.
  wrapped = e.__context__
  if wrapped is not None and str(wrapped).startswith(_CONFIG_FILE_ERROR) and wrapped.__context__:
    message = f"--config={name_arg!r} is invalid: {wrapped.__context__}"
  return library_configs.ConfigError(
    "config", name_arg, "a config file that loads", message=message
  )


def _suite_error(error, name_arg: str, runs: Sequence[str]):
  """``error`` (an unknown field) restated for a suite: a run's field is ``suite.RUN.FIELD``."""
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  field, text = error.field, error.value
  return library_configs.ConfigError(
    field,
    text,
    f"a field of a run, --config.suite.RUN.{field} with RUN one of {list(runs)}",
    message=f"--config.{field}={text}: {name_arg} is a suite of the runs {list(runs)}; a "
    f"run's field is set as --config.suite.RUN.FIELD=VALUE "
    f"(e.g. --config.suite.{runs[0]}.{field}={text})",
  )


def parse_argv(argv: list[str], *, named_only: bool = False):
  """Parses ``experiments.run``'s command line (``argv[0]`` is the program).

  ``named_only``: ``--config`` must name a config of ``experiments/configs/``
  (:func:`resolve_config_arg`; a path is refused).

  ``--config=NAME[:ARG]`` is resolved (:func:`rewrite_argv`) and loaded by
  ``ml_collections.config_flags`` (locked); each ``--config.FIELD=VALUE`` is parsed by the
  field's type (``true``/``false`` for bools, ``'(0.5,)'`` for tuples), and ``None`` (or
  ``none``) sets a None-able field (one ``default.py`` declares a placeholder) to None.

  Returns:
    ``(flags, name)``: the parsed ``absl.flags.FlagValues`` (``.config``, ``.workdir``) and the
    run's name; ``(None, None)`` without ``--config``.

  Raises:
    ConfigError: naming ``"config"`` (an unknown name, a file that does not load), an
      override's field (unknown, or a value its type does not parse; ``value`` is the text),
      or ``"overrides"`` (an override without a value); ``str(e)`` is the command line's
      message.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  argv = list(argv)
  name_arg = next((a[len("--config=") :] for a in argv if a.startswith("--config=")), None)
  try:
    argv, name = rewrite_argv(argv, named_only=named_only)
  except ConfigArgError as e:
    raise library_configs.ConfigError(
      "config",
      name_arg,
      "NAME[:ARG] of experiments/configs/"
      + ("" if named_only else ", or a path to a config .py file"),
      message=str(e),
    ) from None
  if name is None:
    return None, None
  overrides = [
    tuple(a[len("--config.") :].partition("=")[::2])
    for a in argv
    if a.startswith("--config.") and "=" in a
  ]
  last = dict(overrides)  # absl: the last value of a flag wins
  none_fields = [f for f, t in last.items() if t in NONE_TEXTS]

  def parse(argv):
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
      "config",
      None,
      "Experiment config file.",
      lock_config=True,
      flag_values=flag_values,
      sys_argv=argv,
    )
    flags.DEFINE_string(
      "workdir", None, "Output directory (default runs/<config name>).", flag_values=flag_values
    )
    try:
      flag_values(argv)
      getattr(flag_values.config, "keys")  # a file that did not load raises on first use
    except (flags.Error, ValueError, TypeError, AttributeError, KeyError, OSError) as e:
      error = _config_error(e, name_arg, overrides)
      if error.allowed == CONFIG_FIELDS and not error.field.startswith("suite."):
        base = parse([a for a in argv if not a.startswith("--config.")]).config
        if "suite" in base:
          raise _suite_error(error, name_arg, list(base.suite.keys())) from None
      raise error from None
    return flag_values

  if none_fields:  # None is no value of the field's type: set it after
    base = parse([a for a in argv if not a.startswith("--config.")]).config
    none_fields = [f for f in none_fields if _none_able(base, f)]
    argv = [a for a in argv if a[len("--config.") :].partition("=")[0] not in none_fields]
  flag_values = parse(argv)
  for field in none_fields:
    *parents, leaf = field.split(".")
    node = flag_values.config
    for part in parents:
      node = node[part]
    node[leaf] = None
  return flag_values, name


def load_config(name_arg: str, overrides: Sequence[str] = (), *, named_only: bool = False):
  """The config of ``--config=NAME_ARG --config.FIELD=VALUE ...``, as :func:`main` builds it.

  ``overrides`` are ``"FIELD=VALUE"`` items, each parsed as the command line's
  ``--config.FIELD=VALUE`` (:func:`parse_argv`). The config is locked, not validated.
  ``named_only``: ``NAME_ARG`` must name a config of ``experiments/configs/`` (a path,
  which would be executed, is refused).

  A ``seed`` the config and the overrides leave None becomes 0 here: this serves a caller with
  no work dir to keep a drawn seed in (the Flower app, whose DP clients draw their round keys
  from the operating system's entropy, and tests). :func:`main` leaves it None, so that a DP
  run's seed is drawn for its work dir (:mod:`experiments.seeds`).

  Returns:
    ``(config, name)``: the ml_collections config and the run's name (``cifar_ablation_ipc:20``
    -> ``cifar_ablation_ipc_20``).

  Raises:
    ConfigError: as :func:`parse_argv`; ``"overrides"`` for an item that is not
      ``FIELD=VALUE``.
  """
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  for item in overrides:
    if not isinstance(item, str) or not item.partition("=")[0] or "=" not in item:
      raise library_configs.ConfigError(
        "overrides", item, "FIELD=VALUE, e.g. seed=1 or client.batch_loop=2"
      )
  flag_values, name = parse_argv(
    ["prog", f"--config={name_arg}", *(f"--config.{item}" for item in overrides)],
    named_only=named_only,
  )
  config = flag_values.config
  for cfg in config.suite.values() if "suite" in config else [config]:
    if cfg.get("seed", 0) is None:
      cfg.seed = 0
  return config, name


# Arguments that ask for the usage text instead of a run (absl's and argparse's spellings).
HELP_ARGS = ("-h", "--help", "-help", "--helpshort", "--helpfull")


def usage() -> str:
  """The command's usage text: this module's guide and every ``NAME`` ``--config`` takes."""
  import textwrap  # pylint: disable=g-import-not-at-top

  names = textwrap.fill(
    ", ".join(configs.names()), width=88, initial_indent="  ", subsequent_indent="  "
  )
  return f"{__doc__.strip()}\n\nNAME is one of (experiments/configs/ and its aliases):\n{names}\n"


def main(argv: list[str] | None = None) -> int:
  """Entry point; ``argv`` defaults to ``sys.argv``."""
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  argv = sys.argv if argv is None else argv
  if any(a in HELP_ARGS for a in argv[1:]):
    print(usage())
    return 0
  try:
    flag_values, name = parse_argv(argv)
  except library_configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if name is None:
    print(usage(), file=sys.stderr)
    print("error: --config=NAME is required (--help: this text)", file=sys.stderr)
    return 2
  config = flag_values.config
  workdir = flag_values.workdir or os.path.join("runs", name)
  return run_config(config, workdir, name)


def client_sizes(cfg) -> list[int]:
  """Records per client of ``cfg``'s data and partition (loads the data).

  Raises:
    ConfigError: the data does not load or does not split as configured.
  """
  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  try:
    dataset = data_lib.load_dataset(cfg.data)
    return [len(i) for i in data_lib.client_split(dataset, cfg.data)]
  except ValueError as e:
    raise library_configs.ConfigError(
      "data.source", cfg.data.source, "data the config can use", message=str(e)
    ) from None


# The largest noise multiplier dp.target_epsilon may calibrate to: beyond it the released
# statistics are noise (sigma * C / B per coordinate) and the target is refused as unreachable.
MAX_TARGET_NOISE_MULTIPLIER = 100.0
# Relative accuracy of the calibrated sigma (epsilon then lands within ~1e-4 of the target).
CALIBRATION_TOL = 1e-4


class DpBudget(NamedTuple):
  """What a DP config spends: its method's mechanism for ``rounds`` rounds at the smallest
  client's rate, and the epsilon its calibration targets.

  ``mechanism`` is the :class:`~fedlap_jax.accounting.DpMechanism` the method declares
  (:func:`experiments.library_configs.dp_mechanism`: ``B``, ``T`` per round, ``delta``; the same
  value the run's :class:`~fedlap_jax.algorithm.FederatedAlgorithm` carries and its ledgers
  compose); ``epsilon_for`` is ``dp.epsilon_for``, the figure (``"replace_one"`` or
  ``"add_remove"``) that :meth:`epsilon` returns and :meth:`calibrate` targets.
  """

  mechanism: "accounting.DpMechanism"
  min_client_size: int
  rounds: int
  epsilon_for: str

  @property
  def batch_size(self) -> int:
    return self.mechanism.batch_size

  @property
  def steps_per_round(self) -> int:
    return self.mechanism.steps_per_round

  @property
  def delta(self) -> float:
    return self.mechanism.delta

  @property
  def sampling_rate(self) -> float:
    return self.mechanism.sampling_rate(self.min_client_size)

  def epsilon(self, noise_multiplier: float) -> float:
    """Epsilon (nats, of ``epsilon_for``) after the last round with this ``noise_multiplier``."""
    return self.mechanism.with_noise_multiplier(noise_multiplier).epsilon_after(
      self.rounds, self.min_client_size, adjacency=self.epsilon_for
    )

  def calibrate(self, target_epsilon: float, *, field: str) -> float:
    """The smallest sigma (to ``CALIBRATION_TOL``) whose epsilon is <= ``target_epsilon``.

    Raises:
      ConfigError: naming ``field`` when the target is not a positive number or needs
        ``sigma > MAX_TARGET_NOISE_MULTIPLIER``.
    """
    from experiments import library_configs  # pylint: disable=g-import-not-at-top

    allowed = (
      f"a finite number > 0 that some noise_multiplier <= "
      f"{MAX_TARGET_NOISE_MULTIPLIER:g} meets (here q = {self.batch_size}/"
      f"{self.min_client_size}, T = {self.steps_per_round} per round, {self.rounds} "
      f"rounds, delta = {self.delta:g}, {self.epsilon_for} epsilon)"
    )
    try:
      return self.mechanism.calibrated(
        target_epsilon,
        rounds=self.rounds,
        client_size=self.min_client_size,
        adjacency=self.epsilon_for,
        tol=CALIBRATION_TOL,
        max_noise_multiplier=MAX_TARGET_NOISE_MULTIPLIER,
      ).noise_multiplier
    except ValueError:
      if isinstance(target_epsilon, (int, float)) and target_epsilon > 0:
        floor = self.epsilon(MAX_TARGET_NOISE_MULTIPLIER)
        allowed = (
          f"a target >= {floor:.4g}, the epsilon of noise_multiplier="
          f"{MAX_TARGET_NOISE_MULTIPLIER:g}" + allowed[allowed.index(" (here") :]
        )
      raise library_configs.ConfigError(
        field,
        target_epsilon,
        allowed,
        message=f"{field}={target_epsilon!r} is unreachable; allowed: {allowed}",
      ) from None


def dp_budget(cfg, sizes: list[int] | None = None) -> DpBudget:
  """The :class:`DpBudget` of a DP config (``sizes``: records per client; loaded if None)."""
  from experiments import library_configs  # pylint: disable=g-import-not-at-top
  from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top

  sizes = client_sizes(cfg) if sizes is None else sizes
  return DpBudget(
    library_configs.dp_mechanism(cfg, sizes),
    int(min(sizes)),
    int(cfg.rounds),
    cfg.dp.get("epsilon_for", accounting.REPLACE_ONE),
  )


def calibrate_noise(config, sizes_of=None) -> list[str]:
  """Sets ``dp.noise_multiplier`` of every (suite) run with ``dp.target_epsilon`` or
  ``dp.match_epsilon_of`` (in place); returns one log line per calibrated run.

  ``sizes_of(cfg)`` gives a run's records per client (default :func:`client_sizes`, which
  loads the data; :mod:`experiments.epsilons` passes the published sizes of data it does not
  load).

  * ``dp.target_epsilon = E``: the smallest sigma whose epsilon (of ``dp.epsilon_for``:
    replace-one by default, the reported guarantee) after the run's last round is at most
    ``E`` (:meth:`DpBudget.calibrate`, with the run's own client sizes and its method's
    mechanism, for every DP method).
  * ``dp.match_epsilon_of = "other"`` (suites only): ``E`` is the epsilon of the suite's run
    ``other`` after its last round (after ``other``'s own calibration, if it has a target).

  This needs the data's client sizes, so it runs when the run or suite starts, not in the config
  file. The calibrated sigma lands in the run's ``config.json``, ``run_info.json`` and ledger.

  Raises:
    ConfigError: an unreachable target; ``match_epsilon_of`` outside a suite, naming no other DP
      run of it, naming a run that matches another itself, or set on a run without DP.
  """
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  lines = []
  loaded = {}  # the runs of a suite mostly share data and partition: load them once

  def budget_of(cfg):
    key = repr(sorted(cfg.data.to_dict().items()))
    if key not in loaded:
      loaded[key] = (sizes_of or client_sizes)(cfg)
    return dp_budget(cfg, loaded[key])

  def log(label, field, target, cfg, budget):
    eps = budget.epsilon(cfg.dp.noise_multiplier)
    lines.append(
      f"calibrated: {label}{field}={target:.6g} -> dp.noise_multiplier="
      f"{cfg.dp.noise_multiplier:.6g} (q = {budget.batch_size}/"
      f"{budget.min_client_size} = {budget.sampling_rate:.4g}, T = "
      f"{budget.steps_per_round} per round, {budget.rounds} rounds, delta = "
      f"{budget.delta:g}: {budget.epsilon_for} epsilon {eps:.4f})"
    )

  if "suite" not in config:
    other = config.dp.get("match_epsilon_of", "")
    if other:
      raise library_configs.ConfigError(
        "dp.match_epsilon_of", other, "'' outside a suite (it names another run of the suite)"
      )
    runs = [("", config)]
  else:
    runs = [(f"suite.{k}.", config.suite[k]) for k in config.suite.keys()]
  budgets = {}
  for prefix, cfg in runs:
    target = cfg.dp.get("target_epsilon")
    if target is None:
      continue
    field = f"{prefix}dp.target_epsilon"
    if not cfg.dp.enabled:
      raise library_configs.ConfigError(field, target, "None when dp.enabled is False")
    budgets[prefix] = budget = budget_of(cfg)
    cfg.dp.noise_multiplier = budget.calibrate(target, field=field)
    log(prefix, "dp.target_epsilon", target, cfg, budget)
  if "suite" in config:
    match_epsilons(config, budgets, log, budget_of)
  return lines


def match_epsilons(config, budgets=None, log=None, budget_of=dp_budget):
  """Sets the noise of every suite run with ``dp.match_epsilon_of`` (in place; returns ``config``).

  A run ``r`` with ``dp.match_epsilon_of = "other"`` gets the noise multiplier
  (:meth:`DpBudget.calibrate`, tolerance ``CALIBRATION_TOL``) that makes its epsilon after its
  last round equal ``other``'s, each from its own client sizes and mechanism; both epsilons
  are of ``r``'s ``dp.epsilon_for``.
  Used by :func:`calibrate_noise` (after the ``dp.target_epsilon`` runs are calibrated).

  Raises:
    ConfigError: ``match_epsilon_of`` outside a suite, naming no other DP run
      of it, naming a run that matches another itself, or set on a run
      without DP.
  """
  from experiments import library_configs  # pylint: disable=g-import-not-at-top

  budgets = {} if budgets is None else budgets
  if "suite" not in config:
    other = config.dp.get("match_epsilon_of", "")
    if other:
      raise library_configs.ConfigError(
        "dp.match_epsilon_of", other, "'' outside a suite (it names another run of the suite)"
      )
    return config
  suite = config.suite
  for name in suite.keys():
    cfg = suite[name]
    other = cfg.dp.get("match_epsilon_of", "")
    if not other:
      continue
    field = f"suite.{name}.dp.match_epsilon_of"
    candidates = [
      k
      for k in suite.keys()
      if k != name and suite[k].dp.enabled and not suite[k].dp.get("match_epsilon_of", "")
    ]
    if other not in candidates:
      raise library_configs.ConfigError(
        field,
        other,
        f"one of {candidates}, the suite's other DP runs that match no other run themselves",
      )
    if not cfg.dp.enabled:
      raise library_configs.ConfigError(
        f"suite.{name}.dp.enabled", cfg.dp.enabled, f"True with {field}={other!r}"
      )
    if cfg.dp.get("target_epsilon") is not None:
      raise library_configs.ConfigError(
        f"suite.{name}.dp.target_epsilon",
        cfg.dp.target_epsilon,
        f"None with {field}={other!r} (set one of the two)",
      )
    ref = suite[other]
    budget = budget_of(cfg)
    ref_budget = budgets.get(f"suite.{other}.") or budget_of(ref)
    target = ref_budget._replace(epsilon_for=budget.epsilon_for).epsilon(ref.dp.noise_multiplier)
    cfg.dp.noise_multiplier = budget.calibrate(target, field=field)
    if log is not None:
      log(f"suite.{name}.", f"dp.match_epsilon_of={other!r}: epsilon", target, cfg, budget)
  return config


def run_config(config, workdir: str, name: str) -> int:
  """Runs one config, or each run of a suite config (``config.suite.<run>``) in turn.

  A suite's runs go to ``workdir/<run>``, and a comparison of them (see
  :mod:`experiments.report`) to ``workdir/report``. Every config of a suite is
  validated before the first one starts.
  """
  from experiments import compilation_cache  # pylint: disable=g-import-not-at-top
  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import library_configs, train  # pylint: disable=g-import-not-at-top

  if "suite" in config:
    targets = [
      (config.suite[k], os.path.join(workdir, k), f"{name}/{k}") for k in config.suite.keys()
    ]
  else:
    targets = [(config, workdir, name)]
  try:
    for cfg, _, label in targets:
      try:
        library_configs.validate_config(cfg)
        compilation_cache.prepare(cfg.get(compilation_cache.FIELD, ""))
      except library_configs.ConfigError as e:
        raise library_configs.ConfigError(
          e.field, e.value, e.allowed, message=f"{label}: {e}"
        ) from None
    for line in calibrate_noise(config):
      print(line)
    results = []
    for cfg, wd, label in targets:
      # Compile once per machine: a later run of the config reads its programs back.
      compilation_cache.enable(cfg.get(compilation_cache.FIELD, ""))
      result = train.train_and_evaluate(cfg, wd, config_name=label)
      results.append(result)
      last = result["records"][-1] if result["records"] else None
      if last is not None:
        eps = f", epsilon {last['epsilon']:.3f}" if last.get("epsilon") is not None else ""
        print(
          f"done: {label} round {last['round']}: test accuracy "
          f"{100 * last['test_accuracy']:.2f} %{eps}; outputs in {wd} "
          f"({result['seconds']:.0f} s)"
        )
  except (
    library_configs.ConfigError,
    train.ResumeError,
    train.WorkdirError,
    data_lib.DataUnavailableError,
  ) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # the work dir became unwritable, or the disk is full
    print(
      f"error: cannot write the run's files: {e}; the last complete checkpoint in "
      f"{workdir} is kept; fix the work dir and run the same command again",
      file=sys.stderr,
    )
    return 2
  except train.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except train.Terminated as e:
    print(f"stopped: {e}", file=sys.stderr)
    return 143
  except KeyboardInterrupt:
    print(
      f"\ninterrupted; run the same command again to resume from the last checkpoint in {workdir}",
      file=sys.stderr,
    )
    return 130
  if len(targets) > 1:
    from experiments import report  # pylint: disable=g-import-not-at-top

    out = os.path.join(workdir, "report")
    options = config.report.to_dict() if "report" in config else {}
    report.make_report([wd for _, wd, _ in targets], out, **options)
    print(f"comparison: {os.path.join(out, 'report.md')}")
  return 0


if __name__ == "__main__":
  from experiments import termination  # pylint: disable=g-import-not-at-top

  termination.exit_process(main())
