r"""Runs one experiment from a named config.

  python -m experiments.run --config=NAME [--config.FIELD=VALUE ...] [--workdir=DIR]

``NAME`` is a file of ``fedlap_runs/configs/`` without ``.py`` (``quickstart``,
``cifar_dp``, ...), optionally with an argument (``cifar_ablation_ipc:20``), or
a path to any config file (this command runs what its user names, on the
user's own machine: a config file is Python and is executed; the Flower app
takes only the names, :func:`fedlap_runs.flags.load_config` with ``named_only=True``).
A *suite* config (one with a ``suite`` section, e.g. ``quickstart``) runs each of its
configs in ``WORKDIR/<run>`` and compares them in ``WORKDIR/report``
(:mod:`experiments.suite`). Fields are overridden with ``--config.FIELD=VALUE``
(e.g. ``--config.seed=1``, ``--config.data.source=npz:/data/cifar10.npz``;
:mod:`fedlap_runs.flags`). The work dir defaults to ``runs/<NAME>`` (``:`` replaced by
``_``); re-running the same command resumes from its last checkpoint.
``--config.dp.target_epsilon=E`` sets a DP run's noise multiplier, when it starts, so that
its epsilon after its last round is ``E`` (:mod:`fedlap_runs.calibration`;
``compare_dp:DATASET`` runs every DP method so). Without ``--config.seed`` a DP run draws
its seed from the operating system's entropy and keeps it in its work dir
(:mod:`fedlap_runs.seeds`); a run without DP uses 0. The run itself is
:func:`experiments.train.train_and_evaluate`.

Compiled programs are kept between runs (:mod:`fedlap_runs.compilation_cache`): a second run
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
import sys

from fedlap_runs import flags


def main(argv: list[str] | None = None) -> int:
  """Entry point; ``argv`` defaults to ``sys.argv``."""
  argv = sys.argv if argv is None else argv
  if any(a in flags.HELP_ARGS for a in argv[1:]):
    print(flags.usage(__doc__))
    return 0
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top  (JAX)
  from experiments import suite  # pylint: disable=g-import-not-at-top
  from fedlap_runs import export_cache  # pylint: disable=g-import-not-at-top

  try:
    flag_values, name = flags.parse_argv(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if name is None:
    print(flags.usage(__doc__), file=sys.stderr)
    print("error: --config=NAME is required (--help: this text)", file=sys.stderr)
    return 2
  workdir = flag_values.workdir or os.path.join("runs", name)
  try:
    return suite.run_config(flag_values.config, workdir, name)
  finally:  # no load left on a background thread when the process exits
    export_cache.settle()


if __name__ == "__main__":
  from fedlap_runs import termination  # pylint: disable=g-import-not-at-top

  termination.exit_process(main())
