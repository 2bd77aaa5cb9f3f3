"""How often a run builds its library config and loads its data before round 1.

  python -m benchmarks.build_count [--config=NAME] [--config.FIELD=VALUE ...]

Runs ``experiments.run`` (default: ``quickstart:dp_loops`` with ``dp.target_epsilon=5``, one
round, in a temporary work dir) and the Flower app's server and one client set-up for the same
config, counting

* library-config builds: constructions of the frozen configs of :mod:`fedlap_jax`
  (``FedLAPConfig``, ``BaselineConfig``, ``FedDMConfig``, ``OneShotConfig``), by whoever makes
  them (the experiment's checks, the calibration, the algorithm);
* data loads: calls of :func:`fedlap_runs.data.load_dataset`.

The Flower figures are of the whole app in process (``tests/flower_harness.py``): the server
and each of its clients build and load for themselves.

The figures are printed; nothing is timed.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import tempfile

from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax import baselines
from fedlap_jax.methods.fedlap import config as core

from fedlap_runs import data as data_lib

LIBRARY_CONFIGS = (core.FedLAPConfig, baselines.BaselineConfig, feddm.FedDMConfig)
DEFAULT_ARGS = ("--config=quickstart:dp_loops", "--config.dp.target_epsilon=5")


@contextlib.contextmanager
def counting():
  """Counts library-config constructions and data loads inside the block."""
  counts: collections.Counter = collections.Counter()
  saved = []
  for cls in LIBRARY_CONFIGS + (condensation.OneShotConfig,):
    init = cls.__init__

    def counted(self, *args, _init=init, _name=cls.__name__, **kwargs):
      counts[f"build {_name}"] += 1
      _init(self, *args, **kwargs)

    saved.append((cls, init))
    cls.__init__ = counted
  load = data_lib.load_dataset

  def counted_load(*args, **kwargs):
    counts["data loads"] += 1
    return load(*args, **kwargs)

  data_lib.load_dataset = counted_load
  try:
    yield counts
  finally:
    data_lib.load_dataset = load
    for cls, init in saved:
      cls.__init__ = init


def _line(what: str, counts) -> str:
  builds = sum(v for k, v in counts.items() if k.startswith("build "))
  detail = ", ".join(f"{k[6:]} {v}" for k, v in sorted(counts.items()) if k.startswith("build "))
  return f"{what}: {builds} library-config builds ({detail}), {counts['data loads']} data loads"


def main(argv: list[str]) -> None:
  from experiments import run  # pylint: disable=g-import-not-at-top

  args = list(argv[1:]) or list(DEFAULT_ARGS)
  with tempfile.TemporaryDirectory() as tmp:
    command = [
      "prog",
      *args,
      "--config.rounds=1",
      "--config.plots=False",
      "--config.progress_bar=False",
      f"--workdir={tmp}/run",
    ]
    # One round: the counts are what happens before round 1 (a round builds nothing).
    with counting() as counts:
      assert run.main(command) == 0
    print(_line("experiments.run " + " ".join(args), counts))
  # The Flower app on the same config, in process (tests/flower_harness.py): the server and
  # its 5 clients, one round.
  from tests import flower_harness  # pylint: disable=g-import-not-at-top

  name = next(a for a in args if a.startswith("--config="))[len("--config=") :]
  overrides = " ".join(a[len("--config.") :] for a in args if a.startswith("--config."))
  with tempfile.TemporaryDirectory() as tmp:
    run_config = {
      "config": name,
      "overrides": f"{overrides} rounds=1 plots=false progress_bar=false",
      "run-dir": f"{tmp}/run",
    }
    nodes = flower_harness.node_configs(state_root=f"{tmp}/state", **{"max-epsilon": 1e6})
    with counting() as counts:
      flower_harness.run_inprocess(run_config, nodes)
    print(_line(f"Flower app (server + {len(nodes)} clients) {name} {overrides}", counts))


if __name__ == "__main__":
  main(sys.argv)
