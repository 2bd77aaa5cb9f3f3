"""One config or a suite of them: validate, calibrate, train each, compare; exit codes.

:func:`run_config` is what ``python -m experiments.run`` runs once the command line is parsed
(:mod:`fedlap_runs.flags`): a config, or each run of a suite config (``config.suite.<run>``) in
its own work dir and a comparison of them (:mod:`experiments.report`). It returns the command's
exit status (:mod:`experiments.run` lists them) and prints one line per error.
"""

from __future__ import annotations

import os
import sys

from fedlap_runs import build, calibration


def run_config(config, workdir: str, name: str) -> int:
  """Runs one config, or each run of a suite config (``config.suite.<run>``) in turn.

  A suite's runs go to ``workdir/<run>``, and a comparison of them (see
  :mod:`experiments.report`) to ``workdir/report``. Every config of a suite is
  validated before the first one starts.
  """
  from fedlap_runs import compilation_cache  # pylint: disable=g-import-not-at-top
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import resume, train  # pylint: disable=g-import-not-at-top
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  if "suite" in config:
    targets = [
      (config.suite[k], os.path.join(workdir, k), f"{name}/{k}") for k in config.suite.keys()
    ]
  else:
    targets = [(config, workdir, name)]
  try:
    validated = {}  # each run's library config, built once (None: it needs the data)
    for cfg, _, label in targets:
      try:
        validated[id(cfg)] = library_configs.validate_config(cfg)
        compilation_cache.prepare(cfg.get(compilation_cache.FIELD, ""))
      except library_configs.ConfigError as e:
        raise library_configs.ConfigError(
          e.field, e.value, e.allowed, message=f"{label}: {e}"
        ) from None
    loaded, planned = {}, {}  # the runs of a suite mostly share data: loaded once

    def plan_of(cfg) -> build.Plan:
      """``cfg``'s plan as configured now (with its calibrated ``dp.noise_multiplier``): built
      again only when the calibration changed it."""
      sigma = cfg.dp.get("noise_multiplier")
      if id(cfg) not in planned:
        key = repr(sorted(cfg.data.to_dict().items()))
        if key not in loaded:
          loaded[key] = build.load_data(cfg)
        planned[id(cfg)] = (build.plan(cfg, data=loaded[key], config=validated[id(cfg)]), sigma)
      p, built_at = planned[id(cfg)]
      if built_at != sigma:
        p = build.with_config(p, cfg)
        planned[id(cfg)] = (p, sigma)
      return p

    def budget_of(cfg) -> calibration.DpBudget:
      return plan_of(cfg).budget()

    for line in calibration.calibrate_noise(config, budget_of=budget_of):
      print(line)
    results = []
    for i, (cfg, wd, label) in enumerate(targets, 1):
      if len(targets) > 1:  # the suite's progress; each run shows its own bar of rounds
        print(f"run {i}/{len(targets)} of the suite: {label}", flush=True)
      # Compile once per machine: a later run of the config reads its programs back.
      compilation_cache.enable(cfg.get(compilation_cache.FIELD, ""))
      result = train.train_and_evaluate(cfg, wd, config_name=label, built=plan_of(cfg))
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
    resume.ResumeError,
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
