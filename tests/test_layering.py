"""The library's floor plan and its one validation vocabulary.

The import graph is read from the source with ``ast`` (benchmarks/import_graph.py),
so these tests import no JAX and take milliseconds.
"""

from __future__ import annotations

import pickle

import pytest

from benchmarks import import_graph
from experiments import library_configs
from experiments.configs import quickstart
from fedlap_jax import baselines, checks
from fedlap_jax import config as core

MAX_FLOORS = 7


def test_the_import_graph_has_no_cycle_and_at_most_seven_floors():
  graph = import_graph.graph()
  assert import_graph.find_cycle(graph) is None, import_graph.find_cycle(graph)
  floors = import_graph.floors(graph)
  assert max(floors.values()) <= MAX_FLOORS, import_graph.longest_chain(graph)


def test_baselines_sit_beside_fedlap_not_on_top_of_it():
  graph = import_graph.graph()
  assert not {"client", "federated", "server", "radius"} & graph["baselines"]
  # What both use lives below both: client data types, client dispatch, the interface.
  shared = {"client_data", "dispatch", "algorithm"}
  assert shared <= graph["baselines"] and shared <= graph["federated"]


def test_the_graph_reader_sees_deferred_imports_and_cycles(tmp_path):
  (tmp_path / "a.py").write_text("from pkgname import b\n")
  (tmp_path / "b.py").write_text("def f():\n  from pkgname.a import x\n")
  package = import_graph.PACKAGE
  for p in tmp_path.glob("*.py"):
    p.write_text(p.read_text().replace("pkgname", package))
  graph = import_graph.graph(tmp_path)
  assert graph == {"a": {"b"}, "b": {"a"}}
  assert import_graph.find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
  with pytest.raises(ValueError, match="import cycle"):
    import_graph.floors(graph)


@pytest.mark.parametrize("build, field, value", [
    (lambda: core.ClientConfig(ipc=0), "ipc", 0),
    (lambda: core.DPConfig(noise_multiplier=0.0, l2_clip_norm=1.0, delta=1e-5),
     "dp.noise_multiplier", 0.0),
    (lambda: core.ServerConfig(weighting="n_k"), "weighting", "n_k"),
    (lambda: core.ClientConfig(dsa_strategy="blur"), "dsa_strategy", "blur"),
    (lambda: baselines.LocalTraining(prox_mu=-1.0), "prox_mu", -1.0),
    (lambda: baselines.BaselineConfig(method="fednova", rounds=1), "method", "fednova"),
])
def test_config_errors_carry_field_value_and_allowed(build, field, value):
  with pytest.raises(checks.ConfigError) as err:
    build()
  e = err.value
  assert isinstance(e, ValueError)
  assert (e.field, e.value) == (field, value) and e.allowed
  assert str(e).startswith(f"{field}={value!r} is invalid")
  again = pickle.loads(pickle.dumps(e))
  assert (type(again), again.field, again.value, again.allowed, str(again)) == (
      type(e), e.field, e.value, e.allowed, str(e))


@pytest.mark.parametrize("path, value", [
    ("client.ipc", 0),
    ("client.dsa_strategy", "blur"),          # a message not of the form field=value; allowed
    ("server.dsa_strategy", "blur"),
    ("client.calibrate_radius", False),       # a cross-field check of FedLAPConfig
])
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
    library_configs.to_baseline_config(cfg)
  assert err.value.field == "baseline.prox_mu"


def test_method_lists_and_labels_come_from_the_library():
  assert library_configs.METHODS == core.METHODS == (
      ("fedlap",) + baselines.METHODS + ("feddm", "dsc", "dsc_centralized", "psg"))
  assert library_configs.CLIENT_BACKENDS == core.CLIENT_BACKENDS
  assert core.method_label("fedlap", True) == "FedLAP-DP"
  assert [core.method_label(m, m.startswith("dp_")) for m in baselines.METHODS] == [
      "FedAvg", "FedProx", "FedSGD", "SCAFFOLD", "DP-FedAvg", "DP-FedProx"]
  assert [core.method_label(m, m == "psg") for m in core.SYNTHETIC_METHODS] == [
      "FedDM", "DSC federated", "DSC centralized", "PSG"]


# The methods: each builds its round from the shared floors below, none from another's.
METHODS = ("federated", "client", "baselines", "feddm", "condensation")
# FedLAP's own modules: its local approximation, its round, its radii.
FEDLAP_ONLY = {"client", "federated", "radius"}
# What the other synthetic-set methods may take from fedlap_jax.server: Algorithm 2's training
# on the union of synthetic sets (FedDM's server, DSC's and PSG's training of a fresh model,
# with r_g = inf). FedLAP's server step (radius, weights, FedAvg-delta start) is not shared.
SHARED_SERVER_NAMES = {"global_update", "example_weights", "ServerMetrics"}


def _names_imported_from(module: str, source: str) -> set[str]:
  import ast
  path = import_graph.modules()[module]
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == f"{import_graph.PACKAGE}.{source}":
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module == import_graph.PACKAGE:
      # The whole module imported: every name of it is within reach.
      names.update(f"{source}.*" for a in node.names if a.name == source)
  return names


def test_synthetic_systems_are_built_from_the_shared_primitives():
  """FedDM, DSC and PSG reuse the synthetic-set construction, the matching step, the server's
  training, the privacy primitives and the client dispatch; they stand beside FedLAP, not on it."""
  graph = import_graph.graph()
  for module in ("feddm", "condensation"):
    assert {"synthetic", "matching", "server", "dispatch", "algorithm", "privacy"} \
        <= graph[module], (module, graph[module])
    assert not FEDLAP_ONLY & graph[module], (module, graph[module])
    assert _names_imported_from(module, "server") <= SHARED_SERVER_NAMES, module
  assert not {"feddm", "condensation"} & (graph["federated"] | graph["baselines"])


def test_synthetic_sets_and_class_batches_live_below_every_method():
  graph = import_graph.graph()
  floors = import_graph.floors(graph)
  for shared in ("synthetic", "matching"):
    assert not set(METHODS) & graph[shared], (shared, graph[shared])
    for method in ("client", "feddm", "condensation"):
      assert floors[shared] < floors[method], (shared, method, floors)
  for name in ("synthetic_labels", "initial_synthetic", "noise_images", "real_images",
               "class_blocks", "class_batch"):
    owners = [m for m, p in import_graph.modules().items()
              if f"\ndef {name}(" in p.read_text()]
    assert owners == ["synthetic"], (name, owners)
  import fedlap_jax
  from fedlap_jax import synthetic
  assert fedlap_jax.synthetic_labels is synthetic.synthetic_labels
  assert fedlap_jax.noise_images is synthetic.noise_images
