r"""Runs one experiment from a named config.

  python -m experiments.run --config=NAME [--config.FIELD=VALUE ...] [--workdir=DIR]

``NAME`` is a file of ``experiments/configs/`` without ``.py`` (``quickstart``,
``cifar_dp``, ...), optionally with an argument (``cifar_ablation_ipc:20``), or
a path to any config file. A *suite* config (one with a ``suite`` section, e.g.
``quickstart``) runs each of its configs in ``WORKDIR/<run>`` and compares them
in ``WORKDIR/report``. Fields are overridden with ``--config.FIELD=VALUE``
(e.g. ``--config.seed=1``, ``--config.data.source=npz:/data/cifar10.npz``). The
work dir defaults to ``runs/<NAME>`` (``:`` replaced by ``_``); re-running the
same command resumes from its last checkpoint.

Exit status: 0 on success; 2 for bad input or damaged state (an invalid
config, data or work dir, a resume that is refused; a one-line message); 1
when a round produced NaN or Inf; 130 when interrupted (Ctrl-C); 143 after
SIGTERM (the round in progress finishes and is checkpointed first). Re-running
the same command resumes after 1, 130 and 143.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigArgError(ValueError):
  """``--config`` names no config file."""


def resolve_config_arg(value: str) -> tuple[str, str]:
  """``'NAME[:ARG]'`` -> ``(path[:ARG], run name)``; paths are kept as they are."""
  name, sep, arg = value.partition(":")
  if name.endswith(".py") or os.sep in name:
    path = name
    label = Path(name).stem
  else:
    path = str(CONFIG_DIR / f"{name}.py")
    label = name
    if not os.path.isfile(path):
      available = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))
      raise ConfigArgError(f"--config={value!r} is invalid: no experiments/configs/{name}.py; "
                           f"allowed: one of {available} (optionally NAME:ARG), or a path to "
                           "a config .py file")
  return path + sep + arg, label + (f"_{arg}" if sep and arg else "")


def rewrite_argv(argv: list[str]) -> tuple[list[str], str | None]:
  """Replaces the value of ``--config`` by its file path; returns the run name too."""
  out, name, i = [], None, 0
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config="):
      path, name = resolve_config_arg(a[len("--config="):])
      out.append(f"--config={path}")
    elif a == "--config" and i + 1 < len(argv):
      path, name = resolve_config_arg(argv[i + 1])
      out += ["--config", path]
      i += 1
    else:
      out.append(a)
    i += 1
  return out, name


def main(argv: list[str] | None = None) -> int:
  """Entry point; ``argv`` defaults to ``sys.argv``."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  argv = list(sys.argv if argv is None else argv)
  try:
    argv, name = rewrite_argv(argv)
  except ConfigArgError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if name is None:
    print(__doc__, file=sys.stderr)
    print("error: --config=NAME is required", file=sys.stderr)
    return 2
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                  lock_config=True, flag_values=flag_values, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "Output directory (default runs/<config name>).",
                      flag_values=flag_values)
  try:
    flag_values(argv)
  except (flags.Error, ValueError, TypeError, AttributeError, KeyError) as e:
    inner = e.args[0] if e.args and isinstance(e.args[0], KeyError) else e
    if isinstance(inner, KeyError):  # an override of a field the config does not have
      detail = (inner.args[0] if inner.args else str(inner)).replace("\n", "; ")
      print(f"error: unknown config field in a --config.FIELD override: {detail} (allowed: the "
            "fields of experiments/configs/default.py)", file=sys.stderr)
    else:
      print(f"error: {e}", file=sys.stderr)
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
  from experiments import validation  # pylint: disable=g-import-not-at-top
  try:
    dataset = data_lib.load_dataset(cfg.data)
    return [len(i) for i in data_lib.client_split(dataset, cfg.data, cfg.seed)]
  except ValueError as e:
    raise validation.ConfigError("data.source", cfg.data.source, "data the config can use",
                                 message=str(e)) from None


def _dp_steps_per_round(cfg, sizes: list[int]) -> int:
  """``T``, the real-data accesses per round the accountant charges ``cfg`` with."""
  from experiments import validation  # pylint: disable=g-import-not-at-top
  if cfg.method == "fedlap":
    return validation.to_fedlap_config(cfg).client.real_accesses_per_round
  if cfg.method == "psg":
    return validation.to_oneshot_config(cfg).condensation.real_accesses_per_round
  local = validation.to_baseline_config(cfg, max_client_size=max(sizes)).local
  return local.scheduled_steps()


def match_epsilons(config):
  """Sets the noise of every suite run with ``dp.match_epsilon_of`` (in place; returns ``config``).

  A run ``r`` with ``dp.match_epsilon_of = "other"`` gets the noise multiplier
  (:func:`fedlap_jax.accounting.calibrate_noise_multiplier`, tolerance 1e-4)
  that makes its epsilon after its last round equal ``other``'s, each from its
  own client sizes, steps per round and batch size. This needs the data, so it
  runs when the suite starts, not in the config file.

  Raises:
    ConfigError: ``match_epsilon_of`` outside a suite, naming no other DP run
      of it, naming a run that matches another itself, or set on a run
      without DP.
  """
  from experiments import validation  # pylint: disable=g-import-not-at-top
  from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top
  if "suite" not in config:
    other = config.dp.get("match_epsilon_of", "")
    if other:
      raise validation.ConfigError("dp.match_epsilon_of", other,
                                   "'' outside a suite (it names another run of the suite)")
    return config
  suite = config.suite
  for name in suite.keys():
    cfg = suite[name]
    other = cfg.dp.get("match_epsilon_of", "")
    if not other:
      continue
    field = f"suite.{name}.dp.match_epsilon_of"
    candidates = [k for k in suite.keys() if k != name and suite[k].dp.enabled
                  and not suite[k].dp.get("match_epsilon_of", "")]
    if other not in candidates:
      raise validation.ConfigError(field, other, f"one of {candidates}, the suite's other DP "
                                   "runs that match no other run themselves")
    if not cfg.dp.enabled:
      raise validation.ConfigError(f"suite.{name}.dp.enabled", cfg.dp.enabled,
                                   f"True with {field}={other!r}")
    ref = suite[other]
    ref_sizes, sizes = client_sizes(ref), client_sizes(cfg)
    target = accounting.epsilon_after_rounds(
        rounds=ref.rounds, noise_multiplier=ref.dp.noise_multiplier,
        batch_size=ref.client.batch_size, min_client_size=min(ref_sizes),
        steps_per_round=_dp_steps_per_round(ref, ref_sizes), delta=ref.dp.delta)
    cfg.dp.noise_multiplier = accounting.calibrate_noise_multiplier(
        target, delta=cfg.dp.delta, rounds=cfg.rounds, batch_size=cfg.client.batch_size,
        min_client_size=min(sizes), steps_per_round=_dp_steps_per_round(cfg, sizes), tol=1e-4)
  return config


def run_config(config, workdir: str, name: str) -> int:
  """Runs one config, or each run of a suite config (``config.suite.<run>``) in turn.

  A suite's runs go to ``workdir/<run>``, and a comparison of them (see
  :mod:`experiments.report`) to ``workdir/report``. Every config of a suite is
  validated before the first one starts.
  """
  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import train, validation  # pylint: disable=g-import-not-at-top
  if "suite" in config:
    targets = [(config.suite[k], os.path.join(workdir, k), f"{name}/{k}")
               for k in config.suite.keys()]
  else:
    targets = [(config, workdir, name)]
  try:
    match_epsilons(config)
    for cfg, _, label in targets:
      try:
        validation.validate_config(cfg)
      except validation.ConfigError as e:
        raise validation.ConfigError(e.field, e.value, e.allowed,
                                     message=f"{label}: {e}") from None
    results = []
    for cfg, wd, label in targets:
      result = train.train_and_evaluate(cfg, wd, config_name=label)
      results.append(result)
      last = result["records"][-1] if result["records"] else None
      if last is not None:
        eps = f", epsilon {last['epsilon']:.3f}" if last.get("epsilon") is not None else ""
        print(f"done: {label} round {last['round']}: test accuracy "
              f"{100 * last['test_accuracy']:.2f} %{eps}; outputs in {wd} "
              f"({result['seconds']:.0f} s)")
  except (validation.ConfigError, train.ResumeError, train.WorkdirError,
          data_lib.DataUnavailableError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # the work dir became unwritable, or the disk is full
    print(f"error: cannot write the run's files: {e}; the last complete checkpoint in "
          f"{workdir} is kept; fix the work dir and run the same command again", file=sys.stderr)
    return 2
  except train.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except train.Terminated as e:
    print(f"stopped: {e}", file=sys.stderr)
    return 143
  except KeyboardInterrupt:
    print(f"\ninterrupted; run the same command again to resume from the last checkpoint in "
          f"{workdir}", file=sys.stderr)
    return 130
  if len(targets) > 1:
    from experiments import report  # pylint: disable=g-import-not-at-top
    out = os.path.join(workdir, "report")
    report.make_report([wd for _, wd, _ in targets], out)
    print(f"comparison: {os.path.join(out, 'report.md')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
