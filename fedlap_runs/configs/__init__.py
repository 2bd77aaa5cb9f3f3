"""Named experiment configs: ``--config=NAME[:ARG]``.

``NAME`` is a module of this folder that defines ``get_config()`` (some take
one string argument, ``ARG``), starting from :mod:`fedlap_runs.configs.default`,
or a name of :data:`ALIASES`, which stands for ``MODULE:ARG0`` (an ``ARG`` given
with an alias is appended: ``cifar_dsc:federated10`` is
``synthetic_baselines:cifar_dsc:federated10``).

Modules: :mod:`~fedlap_runs.configs.fedlap` (FedLAP / FedLAP-DP: the paper's
settings, ablations, DP recipes), :mod:`~fedlap_runs.configs.baselines`
(gradient-sharing baselines), :mod:`~fedlap_runs.configs.synthetic_baselines` (FedDM, DSC,
PSG), :mod:`~fedlap_runs.configs.quickstart` (digits), :mod:`~fedlap_runs.configs.dp_best`
(each arm's best DP recipe on the research sets), and the suites
:mod:`~fedlap_runs.configs.quickstart_compare` and
:mod:`~fedlap_runs.configs.compare_dp`.
"""

import importlib
from pathlib import Path

from fedlap_runs import catalog

CONFIG_DIR = Path(__file__).resolve().parent
# Modules of this folder that are not configs.
HELPERS = ("schema",)

_DATASETS = tuple(catalog.PAPER)  # the short prefixes of fedlap_runs.catalog
ALIASES = {
  **{f"{d}_{v}": f"fedlap:{d}_{v}" for d in _DATASETS for v in ("nondp", "dp", "dp_tuned")},
  **{f"{d}_dp_hybrid": f"fedlap:{d}_dp_hybrid" for d in ("mnist", "fmnist")},
  "cifar_iid": "fedlap:cifar_iid",
  **{f"cifar_ablation_{k}": f"fedlap:cifar_ablation_{k}" for k in ("ipc", "radius", "fraction")},
  **{
    f"{d}_{m}": f"baselines:{d}_{m}"
    for d in _DATASETS
    for m in ("fedsgd", "fedavg", "fedprox", "scaffold", "fedavg_dp", "fedprox_dp")
  },
  **{
    f"{d}_{s}": f"synthetic_baselines:{d}_{s}" for d in _DATASETS for s in ("feddm", "dsc", "psg")
  },
  **{f"{d}_dp_best": f"dp_best:{d}_fedlap" for d in ("mnist", "fmnist")},
  **{f"{d}_fedavg_dp_best": f"dp_best:{d}_fedavg" for d in ("mnist", "fmnist")},
  "digits_dp_hybrid": "quickstart:dp",
  "digits_dp_tuned": "quickstart:dp_tuned",
  "quickstart_nondp": "quickstart:nondp",
}


def modules() -> tuple[str, ...]:
  """The config modules of this folder (``NAME`` of ``--config=NAME[:ARG]``)."""
  return tuple(
    sorted(
      p.stem
      for p in CONFIG_DIR.glob("*.py")
      if not p.stem.startswith("_") and p.stem not in HELPERS
    )
  )


def names() -> tuple[str, ...]:
  """Every ``NAME`` ``--config=NAME`` takes: the modules and the aliases."""
  return tuple(sorted(set(modules()) | set(ALIASES)))


def resolve(name: str) -> tuple[str, str | None]:
  """``'NAME[:ARG]'`` -> ``(module, argument of its get_config or None)``.

  Raises:
    KeyError: ``NAME`` is neither a module of this folder nor an alias.
  """
  head, sep, arg = name.partition(":")
  if head in ALIASES:
    module, _, base = ALIASES[head].partition(":")
    return module, base + (f":{arg}" if sep and arg else "")
  if head not in modules():
    raise KeyError(head)
  return head, arg if sep else None


def load(name: str):
  """The config ``--config=NAME[:ARG]`` names."""
  module, arg = resolve(name)
  get_config = importlib.import_module(f"{__name__}.{module}").get_config
  return get_config() if arg is None else get_config(arg)
