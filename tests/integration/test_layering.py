"""The library's floor plan and its one validation vocabulary.

Who imports whom (the floors, no cycle, the methods beside each other) is stated as
import-linter contracts in ``pyproject.toml`` and checked by ``lint-imports`` in CI; the tests
here check what a contract cannot: what a module uses, and the one vocabulary of errors.
"""

from __future__ import annotations

import importlib
import pathlib
import pickle

import pytest

from fedlap_runs import library_configs, method_entries
from fedlap_runs.configs import quickstart
from fedlap_jax import baselines, checks
from fedlap_jax import dispatch as dispatch_lib
from fedlap_jax import dp_config
from fedlap_jax.methods.fedlap import config as core
from fedlap_jax.methods import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


@pytest.mark.parametrize(
  "build, field, value",
  [
    (lambda: core.ClientConfig(ipc=0), "ipc", 0),
    (
      lambda: dp_config.DPConfig(noise_multiplier=0.0, l2_clip_norm=1.0, delta=1e-5),
      "dp.noise_multiplier",
      0.0,
    ),
    (lambda: core.ServerConfig(weighting="n_k"), "weighting", "n_k"),
    (lambda: core.ClientConfig(dsa_strategy="blur"), "dsa_strategy", "blur"),
    (lambda: baselines.LocalTraining(prox_mu=-1.0), "prox_mu", -1.0),
    (lambda: baselines.BaselineConfig(method="fednova", rounds=1), "method", "fednova"),
  ],
)
def test_config_errors_carry_field_value_and_allowed(build, field, value):
  with pytest.raises(checks.ConfigError) as err:
    build()
  e = err.value
  assert isinstance(e, ValueError)
  assert (e.field, e.value) == (field, value) and e.allowed
  assert str(e).startswith(f"{field}={value!r} is invalid")
  again = pickle.loads(pickle.dumps(e))
  assert (type(again), again.field, again.value, again.allowed, str(again)) == (
    type(e),
    e.field,
    e.value,
    e.allowed,
    str(e),
  )


@pytest.mark.parametrize(
  "path, value",
  [
    ("client.ipc", 0),
    ("client.dsa_strategy", "blur"),  # a message not of the form field=value; allowed
    ("server.dsa_strategy", "blur"),
    ("client.calibrate_radius", False),  # a cross-field check of FedLAPConfig
  ],
)
def test_experiment_errors_name_the_config_path(path, value):
  cfg = quickstart.nondp_config()
  section, name = path.split(".")
  cfg[section][name] = value
  if path == "client.calibrate_radius":
    cfg.server.radius_strategy = "min"
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_config(cfg)
  assert err.value.field == path and err.value.value == value
  assert str(err.value).startswith(f"{path}=")


def test_baseline_errors_name_the_config_path():
  cfg = quickstart.nondp_config()
  cfg.method = "fedprox"
  cfg.baseline.prox_mu = -1.0
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.library_config(cfg)
  assert err.value.field == "baseline.prox_mu"


def test_method_lists_and_labels_come_from_the_registry():
  # The experiments' table of methods has one entry per registry method, in its order; the
  # names and display names are the methods' own (no table of names beside the registry).
  assert tuple(method_entries.ENTRIES) == tuple(REGISTRY)
  assert tuple(REGISTRY) == (
    ("fedlap",)
    + baselines.METHODS
    + ("feddm", "dsc", "dsc_centralized", "psg", "dp_scaffold", "fedadam")
  )
  assert not hasattr(core, "METHODS") and not hasattr(core, "METHOD_LABELS")
  assert library_configs.CLIENT_BACKENDS == dispatch_lib.CLIENT_BACKENDS
  labels = {name: REGISTRY[name].label(False) for name in REGISTRY}
  assert REGISTRY["fedlap"].label(True) == "FedLAP-DP"
  assert labels == {
    "fedlap": "FedLAP",
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "fedsgd": "FedSGD",
    "scaffold": "SCAFFOLD",
    "dp_fedavg": "DP-FedAvg",
    "dp_fedprox": "DP-FedProx",
    "feddm": "FedDM",
    "dsc": "DSC federated",
    "dsc_centralized": "DSC centralized",
    "psg": "PSG",
    "dp_scaffold": "DP-SCAFFOLD",
    "fedadam": "FedAdam",
  }
  # A DP method's label does not change with dp (the name says it); only FedLAP's does.
  assert [n for n in REGISTRY if REGISTRY[n].label(True) != labels[n]] == ["fedlap"]


# What the other synthetic-set methods may take from fedlap_jax.methods.fedlap.server: Algorithm 2's
# training on the union of synthetic sets (FedDM's server, DSC's and PSG's training of a fresh
# model, with r_g = inf). FedLAP's server step (radius, weights, FedAvg-delta start) is not shared.
SHARED_SERVER_NAMES = {"global_update", "example_weights", "ServerMetrics"}


def library_modules() -> dict[str, pathlib.Path]:
  """``{module: path}`` of ``fedlap_jax``'s modules."""
  package = ROOT / "fedlap_jax"
  return {
    ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): p
    for p in sorted(package.rglob("*.py"))
    if p != package / "__init__.py"
  }


def _names_imported_from(module: str, source: str) -> set[str]:
  import ast

  path = library_modules()[module]
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == f"fedlap_jax.{source}":
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and f"{node.module}.".startswith("fedlap_jax."):
      # The whole module imported: every name of it is within reach.
      names.update(
        f"{source}.*" for a in node.names if f"{node.module}.{a.name}" == f"fedlap_jax.{source}"
      )
  return names


def _library_imports(path: str) -> set[str]:
  """The ``fedlap_jax`` modules that ``fedlap_jax/<path>`` imports."""
  import ast

  tree = ast.parse((ROOT / "fedlap_jax" / path).read_text())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "fedlap_jax":
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedlap_jax."):
      module = node.module.removeprefix("fedlap_jax.")
      out.add(module)
      out.update(f"{module}.{a.name}" for a in node.names)  # a module among them
  return out


def test_synthetic_systems_are_built_from_the_shared_primitives():
  """FedDM, DSC and PSG reuse the synthetic-set construction, the matching step, the server's
  training and the privacy primitives (their modules), and the client dispatch and the method
  interface (their registry methods, whose round is the generic one). That they stand beside
  FedLAP, not on it, is an import-linter contract (pyproject.toml)."""
  server = "methods.fedlap.server"
  for family, module in (
    ("feddm", "methods.feddm.distribution_matching"),
    ("condensation", "methods.condensation.one_shot"),
  ):
    own = _library_imports(module.replace(".", "/") + ".py")
    registry = _library_imports(f"methods/{family}/__init__.py")
    assert {"synthetic", "matching", "privacy"} <= own, (module, own)
    assert {"dispatch", "method", "synthetic", module} <= registry, (module, registry)
    assert server in own | registry, module
    assert _names_imported_from(module, server) <= SHARED_SERVER_NAMES, module


def test_every_method_builds_its_sets_with_the_shared_functions():
  """(That the sets and class batches live below every method is the layers contract.)"""
  import fedlap_jax
  from fedlap_jax import synthetic

  # Each method builds its sets with synthetic's own functions (the objects, not names alike).
  uses = {
    "fedlap_jax.methods.fedlap.client": ("real_images",),
    "fedlap_jax.methods.feddm.distribution_matching": (
      "class_batch",
      "class_blocks",
      "initial_synthetic",
    ),
    "fedlap_jax.methods.condensation.one_shot": (
      "class_batch",
      "class_blocks",
      "initial_synthetic",
    ),
    "fedlap_jax.methods.fedlap": ("synthetic_slot",),
    "fedlap_jax.methods.feddm": ("noise_images", "real_images", "synthetic_slot"),
    "fedlap_jax.methods.condensation": ("real_images", "synthetic_slot"),
  }
  for module, names in uses.items():
    mod = importlib.import_module(module)
    for name in names:
      fn = getattr(mod, name)
      assert fn is getattr(synthetic, name), (module, name, fn.__module__)
      assert fn.__module__ == "fedlap_jax.synthetic", (module, name, fn.__module__)

  assert fedlap_jax.synthetic_labels is synthetic.synthetic_labels
  assert fedlap_jax.noise_images is synthetic.noise_images


def _imported_packages(path: pathlib.Path) -> set[str]:
  """Top-level packages a file imports anywhere (also inside functions)."""
  import ast  # pylint: disable=g-import-not-at-top

  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module.split(".")[0])
  return found


def test_the_test_layers_import_only_what_they_test():
  """No test imports ``benchmarks`` (its scripts run as processes); ``tests/unit`` imports the
  library only, none of ``experiments``, ``fedlap_flower``."""
  tests = ROOT / "tests"
  files = sorted(tests.rglob("*.py"))
  assert len(files) > 20 and list((tests / "unit").glob("test_*.py"))
  wrong = [
    f"{p.relative_to(ROOT)}: {pkg}"
    for p in files
    for pkg in _imported_packages(p)
    if pkg == "benchmarks"
    or (pkg in ("experiments", "fedlap_runs", "fedlap_flower") and p.parent == tests / "unit")
  ]
  assert wrong == []
