"""The library's structure, checked as structure: who imports whom, who reads a method's name.

The import graph and the method-name sites are read from the source with ``ast`` by the
scripts ``python -m benchmarks.import_graph`` and ``python -m benchmarks.method_branches``
(run as processes: the tests import nothing from ``benchmarks``). Each check here fails when
the structure it states is broken, whatever the names of the functions involved.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np

from fedlap_jax import baselines, client, condensation, per_example, privacy, rounds
from fedlap_jax.config import ClientConfig, DPConfig, FedLAPConfig, ServerConfig
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import count_params
from conftest import linear_init, run_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
FRONT_ENDS = ("experiments", "fedlap_flower")


@functools.lru_cache(maxsize=None)
def graph_and_importers() -> dict:
  status, out = run_benchmark("import_graph", "--importers", *FRONT_ENDS)
  assert status == 0 and out["cycle"] is None, out["cycle"]
  return out


def method_names() -> tuple[str, ...]:
  """Every name a method is known by: the registry's and FedLAP's run name under DP
  (``Method.name_of``)."""
  return tuple(sorted(set(REGISTRY) | {"fedlap_dp"}))


# -- the readers read structure ------------------------------------------------------------------


def test_the_graph_reader_reads_subpackages_and_relative_imports(tmp_path):
  pkg = tmp_path / "methods"
  pkg.mkdir()
  (tmp_path / "core.py").write_text("X = 1\n")
  (tmp_path / "method.py").write_text("from fedlap_jax import core\n")
  (pkg / "__init__.py").write_text("from fedlap_jax.methods import a, b\n")
  (pkg / "a.py").write_text("from fedlap_jax.method import Method\n")
  (pkg / "b.py").write_text("from . import a\nfrom ..core import X\n")
  status, out = run_benchmark("import_graph", str(tmp_path))
  assert status == 0, out
  assert out["graph"] == {
    "core": [],
    "method": ["core"],
    "methods": ["methods.a", "methods.b"],
    "methods.a": ["method"],
    "methods.b": ["core", "methods.a"],
  }
  assert out["floors"]["methods"] == 5 and out["core_floors"] == 2


def test_the_graph_reader_lists_what_the_front_ends_import(tmp_path):
  front = tmp_path / "front"
  front.mkdir()
  (front / "app.py").write_text(
    "import fedlap_jax.privacy\nfrom fedlap_jax import client, config as c\n"
    "def f():\n  from fedlap_jax.server import server_step\n"
  )
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.import_graph", "--json", "--importers", str(front)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  out = json.loads(proc.stdout)
  assert out["importers"] == {
    (front / "app.py").as_posix(): ["client", "config", "privacy", "server"]
  }


def test_the_branch_counter_finds_every_kind_of_method_branch(tmp_path):
  (tmp_path / "fedlap_jax" / "methods").mkdir(parents=True)
  (tmp_path / "experiments").mkdir()
  (tmp_path / "fedlap_flower").mkdir()
  (tmp_path / "experiments" / "x.py").write_text(
    "if cfg.method == 'fedavg': pass\n"
    "if m in ('fedprox', 'other'): pass\n"
    "if m in DP_BASELINE_METHODS: pass\n"
    "if isinstance(c, FedLAPConfig): pass\n"
    "if isinstance(s, RoundMetrics): pass\n"  # tstate: listed, not counted
    "LABELS = {'fedavg': 'FedAvg'}\n"  # key: listed, not counted
  )
  (tmp_path / "fedlap_jax" / "methods" / "fedavg.py").write_text("ok = name == 'fedavg'\n")
  status, out = run_benchmark(
    "method_branches", "--repo", str(tmp_path), "--names", "fedavg,fedprox"
  )
  assert status == 0
  kinds = sorted(kind for _, _, kind, _ in out["sites"])
  assert kinds == ["cmp", "cmp", "cmp", "key", "list", "tstate", "type"]
  assert out["registry_rule"] == 4 and out["issue_rule"] == 5
  assert out["by_folder"] == {"fedlap_jax": 0, "experiments": 4, "fedlap_flower": 0}


# -- test 1: only the registry reads method names (a ratchet until the front ends are generic) ---

# Method-name branches (cmp + list + type) outside fedlap_jax/methods/, per folder: today's
# figures. They may only fall; the registry's goal is 0 in every folder.
BRANCH_CEILINGS = {"fedlap_jax": 0, "experiments": 1, "fedlap_flower": 1}


def test_method_name_branches_do_not_grow():
  status, out = run_benchmark("method_branches", "--names", ",".join(method_names()))
  assert status == 0
  over = {f: n for f, n in out["by_folder"].items() if n > BRANCH_CEILINGS[f]}
  sites = [s for s in out["sites"] if s[2] in ("cmp", "list", "type")]
  assert not over, (over, [s for s in sites if s[0].split("/")[0] in over])


def test_the_counter_reads_the_method_names_off_the_methods_modules():
  """Without ``--names`` the counter finds every name a method is known by in
  ``fedlap_jax/methods/`` (no table of names elsewhere to read)."""
  status, out = run_benchmark("method_branches", "--json")
  assert status == 0
  assert out["names"] == sorted(method_names())


# -- test 2 (weak form): the front ends never reach the library's internals ---------------------

# What no front end needs: the DP primitives (a method's steps use them), the matching loss,
# the radius, the augmentations, the losses. A front end importing them builds a method of
# its own outside the library.
INTERNALS = {"privacy", "per_example", "matching", "radius", "dsa", "losses"}


def test_front_ends_never_reach_the_librarys_internals():
  out = graph_and_importers()
  wrong = {p: sorted(set(used) & INTERNALS) for p, used in out["importers"].items()}
  assert not {p: w for p, w in wrong.items() if w}
  # The reader sees the front ends' imports (the check above is not vacuous).
  used = set().union(*map(set, out["importers"].values()))
  assert {"accounting", "config", "client_data"} <= used


# -- test 7: one DP gradient ---------------------------------------------------------------------


def _calls_by_function(package: pathlib.Path) -> dict[str, set[str]]:
  """``{"module.function": {"module.callee", ...}}`` over the package's modules (read with ast).

  A call counts for the top-level function (or method, ``module.Class.method``) it sits in,
  nested functions included; callees are the library's functions, resolved through the
  module's own definitions and its ``from fedlap_jax[.m] import ...`` / module aliases.
  """
  import ast

  calls: dict[str, set[str]] = {}
  for path in sorted(package.glob("*.py")):
    module = path.stem
    tree = ast.parse(path.read_text())
    names: dict[str, str] = {}  # local name -> "module.function"
    modules: dict[str, str] = {}  # local name -> module
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedlap_jax"):
        parts = node.module.split(".")
        for a in node.names:
          if len(parts) == 1:
            modules[a.asname or a.name] = a.name
          else:
            names[a.asname or a.name] = f"{parts[1]}.{a.name}"
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.setdefault(node.name, f"{module}.{node.name}")

    def callees(fn) -> set[str]:
      found = set()
      for sub in ast.walk(fn):
        if not isinstance(sub, ast.Call):
          continue
        f = sub.func
        if isinstance(f, ast.Name) and f.id in names:
          found.add(names[f.id])
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
          if f.value.id in modules:
            found.add(f"{modules[f.value.id]}.{f.attr}")
      return found

    for node in tree.body:
      if isinstance(node, ast.FunctionDef):
        calls[f"{module}.{node.name}"] = callees(node)
      elif isinstance(node, ast.ClassDef):
        for item in node.body:
          if isinstance(item, ast.FunctionDef):
            calls[f"{module}.{node.name}.{item.name}"] = callees(item)
  return calls


def callers(calls: dict[str, set[str]], callee: str) -> set[str]:
  return {fn for fn, called in calls.items() if callee in called}


def test_one_dp_gradient():
  """Only :func:`fedlap_jax.privacy.poisson_gradient` clips, noises and draws a Poisson batch
  of real records (plus the non-private class batches of the class-wise methods)."""
  calls = _calls_by_function(ROOT / "fedlap_jax")
  assert callers(calls, "privacy.privatise") == {"privacy.poisson_gradient"}
  assert callers(calls, "privacy.add_gaussian_noise") == {"privacy.privatise"}
  assert callers(calls, "privacy.clipped_gradient_sum") == {"privacy.poisson_gradient"}
  assert callers(calls, "privacy.poisson_sample") == {
    "privacy.poisson_gradient",
    "synthetic.class_batch",
  }
  # Every method's real gradient goes through it.
  users = {fn.split(".")[0] for fn in callers(calls, "privacy.poisson_gradient")}
  assert {"client", "baselines", "condensation"} <= users


def test_the_call_reader_sees_aliases_and_nested_functions(tmp_path):
  (tmp_path / "privacy.py").write_text("def privatise():\n  pass\n")
  (tmp_path / "a.py").write_text(
    "from fedlap_jax import privacy as p\nfrom fedlap_jax.privacy import privatise as noise\n"
    "def outer():\n  def inner():\n    return p.privatise()\n  return inner\n"
    "class K:\n  def m(self):\n    return noise()\n"
  )
  calls = _calls_by_function(tmp_path)
  assert callers(calls, "privacy.privatise") == {"a.outer", "a.K.m"}


# -- tests 8 and 9: the compiled DP programs, and the mechanism they declare ---------------------

DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=0.5, delta=1e-5)
TOY_CLIENT = ClientConfig(
  ipc=1,
  iterations=2,
  max_outer=2,
  batch_loop=2,
  boost_loop=1,
  inner_loop=1,
  batch_size=16,
  model_batch_size=16,
  radius=100.0,
  calibrate_radius=False,
  dsa_strategy="",
)
TOY_FEDLAP = FedLAPConfig(
  client=TOY_CLIENT,
  server=ServerConfig(radius_strategy="constant", max_epochs=1, batch_size=16, dsa_strategy=""),
  rounds=2,
).with_dp(DP)
TOY_HYBRID = dataclasses.replace(
  TOY_FEDLAP,
  client=dataclasses.replace(TOY_FEDLAP.client, average_targets=True, model_steps="noisy_real"),
  server=dataclasses.replace(TOY_FEDLAP.server, start="fedavg_delta"),
)


def _toy_dp_algorithms(apply_fn, params, clients):
  """``{name: (algorithm, T declared by its library config, the gradient query)}``."""
  sizes = np.sum(np.asarray(clients.mask), axis=1)
  bc = baselines.baseline_config(
    "dp_fedavg",
    rounds=2,
    learning_rate=0.1,
    batch_size=16,
    dp=DP,
    local_epochs=1,
    max_client_size=int(sizes.max()),
  )
  cc = condensation.CondensationConfig(
    ipc=1, networks=1, outer_loop=2, inner_loop=1, batch_loop=2, classwise=False, dp=DP
  )
  oc = condensation.OneShotConfig(
    method="psg", condensation=cc, server=condensation.fixed_epochs_server(1)
  )
  shape, classes = clients.x.shape[2:], 2
  facts = RunFacts(
    tuple(shape), clients.mask.shape[0], count_params(params), classes, int(sizes.max())
  )
  model = ModelFns(apply_fn)
  out = {}
  for name, cfg in (("fedlap_dp", TOY_FEDLAP), ("fedlap_dp_hybrid", TOY_HYBRID)):
    alg = rounds.algorithm(REGISTRY["fedlap"], cfg, model, facts, client_backend="map")
    out[name] = (alg, cfg.client.real_accesses_per_round, client.real_gradient_query(cfg.client))
  alg = rounds.algorithm(REGISTRY["dp_fedavg"], bc, model, facts, client_backend="map")
  out["dp_fedavg"] = (alg, bc.local.scheduled_steps(), bc.local.gradient)
  alg = rounds.algorithm(
    REGISTRY.method("psg"), oc, ModelFns(apply_fn, None, linear_init), facts, client_backend="map"
  )
  out["psg"] = (alg, cc.real_accesses_per_round, cc.gradient)
  return out


def test_each_dp_program_holds_one_per_example_gradient(
  linear_apply_fn, linear_params, clients, monkeypatch
):
  """Lowering one round of every DP method, counting traces (each trace outside
  ``jax.eval_shape`` is one copy in the program): one DP gradient per call site, one
  per-example gradient, one noise; none traced again only for its shapes."""
  counts: dict[str, list[int]] = {}
  in_shape = [0]

  def count(module, name):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
      counts.setdefault(name, [0, 0])[1 if in_shape[0] else 0] += 1
      return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)

  for module, name in (
    (privacy, "poisson_gradient"),
    (privacy, "privatise"),
    (per_example, "per_example_gradients"),
    (per_example, "_clipped_sum_chunk"),
  ):
    count(module, name)
  original_shape = jax.eval_shape

  def eval_shape(*a, **k):
    in_shape[0] += 1
    try:
      return original_shape(*a, **k)
    finally:
      in_shape[0] -= 1

  monkeypatch.setattr(jax, "eval_shape", eval_shape)
  for name, (alg, _, _) in _toy_dp_algorithms(linear_apply_fn, linear_params, clients).items():
    state = alg.init(jax.random.PRNGKey(0), linear_params, clients)
    jax.clear_caches()  # trace afresh: an earlier test may have traced the same round
    counts.clear()
    alg.round.func.lower(state, clients, **alg.round.keywords)
    per_ex = [
      a + b
      for a, b in zip(
        counts.get("per_example_gradients", [0, 0]), counts.get("_clipped_sum_chunk", [0, 0])
      )
    ]
    assert counts["poisson_gradient"] == [1, 0], (name, counts)
    assert counts["privatise"] == [1, 0], (name, counts)
    assert per_ex == [1, 0], (name, counts)


def test_the_mechanism_is_the_gradients(linear_apply_fn, linear_params, clients):
  """Every DP method's mechanism is its gradient query's for its ``T`` (the noise drawn and the
  noise accounted are one value), and a round spends at most ``T`` accesses."""
  for name, (alg, steps, query) in _toy_dp_algorithms(
    linear_apply_fn, linear_params, clients
  ).items():
    assert query.private and query.noise_multiplier == DP.noise_multiplier, name
    assert alg.mechanism == query.mechanism(steps_per_round=steps, delta=DP.delta), name
    state = alg.init(jax.random.PRNGKey(0), linear_params, clients)
    _, metrics = alg.round(state, clients)
    spent = metrics.client.steps if name == "dp_fedavg" else metrics.client.real_accesses
    assert np.all(np.asarray(spent) <= alg.mechanism.steps_per_round), (name, spent)
    assert np.any(np.asarray(spent) == alg.mechanism.steps_per_round), (name, spent)
