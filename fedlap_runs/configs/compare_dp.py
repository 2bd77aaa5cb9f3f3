r"""FedLAP-DP against DP-FedAvg and DP-FedProx at equal epsilon, on any data (a suite).

  python -m experiments.run --config=compare_dp:DATASET[,OPTION=VALUE...] [--workdir=DIR]

``DATASET`` is ``digits`` (scikit-learn, offline), ``mnist``, ``fashion_mnist``
(or ``fmnist``), ``cifar10`` (or ``cifar``; tfds), ``NAME=npz:PATH`` (that
dataset's recipes on the arrays of ``PATH``) or ``npz:PATH`` (``data.name =
custom``, the MNIST recipes). Options, ``+`` between values:

* ``eps=2.79+10.18``: the epsilon checkpoints (nats at each run's ``dp.delta``; the
  paper's levels), in the notion ``epsilon_for=`` names;
* ``epsilon_for=replace_one``: the figure every run is calibrated on and the report
  compares: ``replace_one`` (the guarantee with public client sizes, which every run
  reports as ``epsilon``) or ``add_remove`` (the paper's notion, for reproducing its
  tables; every method alike, each still reports its replace-one ``epsilon``);
* ``lrs=0.1+0.3+1+3+10``: the baselines' learning-rate grid (half decades from the
  paper's 0.1: with C = 0.1 a clipped step is small);
* ``variants=paper+tuned``: FedLAP-DP recipes, names of :data:`FEDLAP_VARIANTS`
  (default: those whose configs exist; ``none``: the baselines alone, on the data and
  model of the ``paper`` recipe);
* ``seeds=S+S+...``: given seeds, each run once per seed (the report pools them; a given
  seed is guessable, so those runs say their outputs are not private); default: each run
  once, with a seed drawn from the operating system's entropy for its work dir
  (:mod:`fedlap_runs.seeds`);
* ``rounds=N``: every run's number of rounds (default: each recipe's own).

For every checkpoint ``E`` the suite holds one run per FedLAP-DP variant and
per (DP baseline, learning rate), each with ``dp.target_epsilon = E``:
:mod:`experiments.run` calibrates each run's noise multiplier, from its own
client sizes, batch size, noisy steps per round and rounds, so that its
epsilon after its last round is ``E`` (to 1e-4), and logs the sigma. The
report (:func:`experiments.report.make_report` with ``best_of_grid``) shows,
per checkpoint, the accuracy after each run's last round, the best learning
rate of each baseline (best mean over seeds) and the whole grid.

Recipes: FedLAP-DP as :data:`FEDLAP_VARIANTS` says (``paper``: the published
loops, ``{mnist,fmnist,cifar}_dp``, on digits :func:`digits_paper`; ``tuned``:
the recipe of ``{digits,mnist,fmnist,cifar}_dp_tuned``). Baselines: the paper's DP-FedAvg / DP-FedProx (C = 0.1, B = 256, 5
local epochs, 30 rounds, ``fedlap_runs/configs/baselines.py``; on digits those
of ``quickstart_compare``: B = 64, 2 local epochs, 10 rounds); the data and
model sections are FedLAP-DP's, so every run sees the same clients.

Caveat: picking the best of a grid looks at the test accuracy of every grid
point, and that choice is not covered by the per-run epsilon (a tuned
baseline is slightly optimistic; Papernot & Steinke, "Hyperparameter tuning
with Renyi differential privacy", 2022). The same holds for any recipe tuned
on the data.
"""

from __future__ import annotations

import copy

import ml_collections

from fedlap_jax.baselines import DP_METHODS

from fedlap_runs import catalog, configs
from fedlap_runs.configs import baselines, quickstart, quickstart_compare

EPSILONS = (2.79, 10.18)
LR_GRID = (0.1, 0.3, 1.0, 3.0, 10.0)
BASELINES = DP_METHODS


def digits_paper():
  """FedLAP-DP on digits with the paper's recipe scaled down to 274-record clients.

  The quickstart's older FedLAP-DP loops, ``quickstart:dp_loops`` (the ``paper`` column's
  config on digits; ``quickstart:dp`` is now the hybrid): ConvNet 32 x 2, ipc 10, R_i 1,
  max_outer 2, batch_loop 5 (T = 10), R_b 5, R_l 1, B 64, constant radius 5, eta_0 0.05,
  uniform weights, 10 rounds.
  """
  return quickstart.dp_config()  # a copy would duplicate its 17 settings


# The FedLAP-DP recipes the suite runs: name -> (report label, {dataset: config}), a config
# being "NAME[:ARG]" of fedlap_runs/configs or a function returning one. Adding a recipe is
# one entry; a recipe whose config files are not (yet) there is left out of the default.
# The data sets with named configs (data.name -> their short prefix); custom data runs
# MNIST's recipes.
BASELINE_DATASETS = {**{row.name: short for short, row in catalog.PAPER.items()}, "custom": "mnist"}
FEDLAP_VARIANTS = {
  "paper": (
    "FedLAP-DP (paper)",
    {"digits": digits_paper, **{d: f"{s}_dp" for d, s in BASELINE_DATASETS.items()}},
  ),
  "tuned": (
    "FedLAP-DP (tuned)",
    {"digits": "digits_dp_tuned", **{d: f"{s}_dp_tuned" for d, s in BASELINE_DATASETS.items()}},
  ),
}
OPTIONS = ("eps", "lrs", "variants", "seeds", "rounds", "epsilon_for")
# The notions epsilon_for= takes (fedlap_jax.accounting.ADJACENCIES).
EPSILON_FOR = ("replace_one", "add_remove")


def _available(variant: str) -> bool:
  return all(
    callable(c) or c.partition(":")[0] in configs.names()
    for c in FEDLAP_VARIANTS[variant][1].values()
  )


def default_variants() -> tuple[str, ...]:
  """The FedLAP-DP recipes run by default: every entry whose configs exist."""
  return tuple(v for v in FEDLAP_VARIANTS if _available(v))


def _fail(arg: str, why: str):
  raise ValueError(f"compare_dp:{arg} is invalid: {why}")


def parse_arg(arg: str) -> dict:
  """``'DATASET[,OPTION=VALUE...]'`` -> the suite's settings (see the module docstring)."""
  dataset, *opts = arg.split(",")
  out = dict(
    source=None,
    epsilons=EPSILONS,
    lrs=LR_GRID,
    variants=default_variants(),
    seeds=(None,),
    rounds=None,
    epsilon_for="replace_one",
  )
  if dataset.startswith("npz:"):
    name, source = "custom", dataset
  elif "=" in dataset:
    name, source = dataset.split("=", 1)
  else:
    name, source = dataset, None
  name = catalog.PAPER[name].name if name in catalog.PAPER else name
  if name not in BASELINE_DATASETS and name != "digits":
    _fail(
      arg,
      f"dataset {name!r} unknown; allowed: digits, "
      f"{', '.join(r.name for r in catalog.PAPER.values())}, NAME=npz:PATH or npz:PATH",
    )
  if source is not None and not source.startswith("npz:"):
    _fail(arg, f"source {source!r}; allowed: npz:PATH")
  out.update(name=name, source=source)
  for opt in opts:
    key, sep, value = opt.partition("=")
    if not sep or key not in OPTIONS or not value:
      _fail(arg, f"option {opt!r}; allowed: OPTION=VALUE with OPTION one of {OPTIONS}")
    values = value.split("+")
    try:
      if key in ("eps", "lrs"):
        nums = tuple(float(v) for v in values)
        if any(not v > 0 or v == float("inf") for v in nums):
          raise ValueError
        out["epsilons" if key == "eps" else "lrs"] = nums
      elif key in ("seeds", "rounds"):
        nums = tuple(int(v) for v in values)
        if any(v < (0 if key == "seeds" else 1) for v in nums) or (
          key == "rounds" and len(nums) > 1
        ):
          raise ValueError
        out[key] = nums if key == "seeds" else nums[0]
      elif key == "epsilon_for":
        if value not in EPSILON_FOR:
          _fail(arg, f"epsilon_for={value!r}; allowed: one of {EPSILON_FOR}")
        out["epsilon_for"] = value
      elif value == "none":  # baselines only (e.g. to widen their grid in another work dir)
        out["variants"] = ()
      else:
        if any(v not in default_variants() for v in values):
          _fail(
            arg,
            f"variants={value!r}; allowed: 'none' or names of "
            f"{default_variants()} ('+' between them)",
          )
        out["variants"] = tuple(values)
    except ValueError as e:
      if str(e).startswith("compare_dp:"):
        raise
      _fail(
        arg,
        f"option {opt!r}; allowed: eps and lrs numbers > 0, seeds integers >= 0, "
        "rounds one integer >= 1, '+' between values",
      )
  return out


def _named(name):
  if callable(name):
    return name()
  return configs.load(name)


def _tag(value: float) -> str:
  return f"{value:g}".replace(".", "p").replace("-", "m").replace("+", "")


def fedlap_config(variant: str, dataset: str) -> ml_collections.ConfigDict:
  """FedLAP-DP recipe ``variant`` on ``dataset`` (a key of its entry of FEDLAP_VARIANTS)."""
  label, configs = FEDLAP_VARIANTS[variant]
  config = _named(configs[dataset])
  config.label = label
  return config


def baseline_config(method: str, dataset: str, fedlap) -> ml_collections.ConfigDict:
  """``method`` (DP-FedAvg / DP-FedProx) with ``fedlap``'s data and model sections."""
  if dataset == "digits":
    config = quickstart_compare.matched_dp_baseline(method, fedlap)
    config.dp.match_epsilon_of = ""
  else:
    config = baselines.get_baseline_config(BASELINE_DATASETS[dataset], method)
  config.data = copy.deepcopy(fedlap.data)
  config.model = copy.deepcopy(fedlap.model)
  config.dp.delta = fedlap.dp.delta
  return config


def get_config(arg: str = "digits"):
  s = parse_arg(arg)
  dataset = s["name"]
  config = ml_collections.ConfigDict()
  config.suite = ml_collections.ConfigDict()
  # How experiments.run reports the suite (experiments.report.make_report's keywords).
  config.report = ml_collections.ConfigDict(dict(epsilons=s["epsilons"], best_of_grid=True))
  reference = None
  runs = []
  for variant in s["variants"]:
    cfg = fedlap_config(variant, dataset)
    reference = reference or cfg
    runs.append((f"fedlap_dp_{variant}", cfg))
  if reference is None:  # baselines only: the data and model of the paper recipe
    reference = fedlap_config("paper", dataset)
  for method in BASELINES:
    for lr in s["lrs"]:
      cfg = baseline_config(method, dataset, reference)
      cfg.learning_rate = lr
      runs.append((f"{method}_lr{_tag(lr)}", cfg))
  for name, cfg in runs:
    if s["source"] is not None:
      cfg.data.source = s["source"]
      cfg.data.name = dataset
    if dataset in ("custom", "digits"):
      cfg.data.normalisation = "test_split"  # no published constants; the train split leaks
    if s["rounds"] is not None:
      cfg.rounds = s["rounds"]
    cfg.dp.match_epsilon_of = ""
  for eps in s["epsilons"]:
    for seed in s["seeds"]:
      for name, cfg in runs:
        run = copy.deepcopy(cfg)
        run.dp.target_epsilon = eps
        run.dp.epsilon_for = s["epsilon_for"]
        run.seed = seed  # None: drawn for the run's work dir when it starts
        key = f"{name}__eps{_tag(eps)}" + (f"__s{seed}" if len(s["seeds"]) > 1 else "")
        config.suite[key] = run
  return config
