"""The library's structure, checked as structure: who reads a method's name, who calls the DP
gradient, what the compiled DP programs hold.

Who imports whom is stated as import-linter contracts in ``pyproject.toml`` (``lint-imports``,
run by CI); what those cannot state is here, read from the source with ``ast``. Each check
fails when the structure it states is broken, whatever the names of the functions involved.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import numpy as np

from fedlap_jax import baselines, per_example, privacy, rounds
from fedlap_jax.methods.fedlap import client
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import count_params
from conftest import linear_init

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


# -- only the registry reads method names (import-linter sees imports, not string literals) ------

# Every name a method is known by: the registry's and FedLAP's run name under DP.
METHOD_NAMES = set(REGISTRY) | {"fedlap_dp"}
# Constants that list methods: a comparison with one is a branch on the method too.
METHOD_LISTS = {
  "METHODS",
  "BASELINE_METHODS",
  "DP_BASELINE_METHODS",
  "ONE_SHOT_METHODS",
  "DP_ONE_SHOT_METHODS",
  "SYNTHETIC_METHODS",
  "DP_METHODS",
  "PROX_METHODS",
}
# Branches on a method's name outside fedlap_jax/methods/, per folder: today's figures. They
# may only fall; the goal is 0 in every folder (the jitted round, fedlap_jax/rounds.py, has 0).
BRANCH_CEILINGS = {"fedlap_jax": 0, "experiments": 1, "fedlap_runs": 1, "fedlap_flower": 1}


def method_branches(source: str) -> list[int]:
  """Lines of the comparisons (==, !=, in, not in) with a method-name literal (or a tuple of
  them) or a method-list constant on either side."""

  def names_method(node) -> bool:
    if isinstance(node, ast.Constant):
      return node.value in METHOD_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return any(names_method(e) for e in node.elts)
    return getattr(node, "id", getattr(node, "attr", None)) in METHOD_LISTS

  return [
    node.lineno
    for node in ast.walk(ast.parse(source))
    if isinstance(node, ast.Compare)
    and all(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops)
    and any(names_method(side) for side in (node.left, *node.comparators))
  ]


def test_method_name_branches_do_not_grow():
  assert method_branches("if m in ('fedprox', 'x'): pass\nif m in DP_METHODS: pass\n") == [1, 2]
  assert method_branches("ok = cfg.method == 'fedavg'\nok = name == 'other'\n") == [1]
  found = {}
  for folder in BRANCH_CEILINGS:
    for path in sorted((ROOT / folder).rglob("*.py")):
      rel = path.relative_to(ROOT).as_posix()
      if not rel.startswith("fedlap_jax/methods/"):
        found.update({f"{rel}:{n}": folder for n in method_branches(path.read_text())})
  over = {f: c for f, c in BRANCH_CEILINGS.items() if list(found.values()).count(f) > c}
  assert not over, (over, found)


# -- test 7: one DP gradient ---------------------------------------------------------------------


def _calls_by_function(package: pathlib.Path) -> dict[str, set[str]]:
  """``{"module.function": {"module.callee", ...}}`` over the package's modules (read with ast).

  A call counts for the top-level function (or method, ``module.Class.method``) it sits in,
  nested functions included; callees are the library's functions, resolved through the
  module's own definitions and its ``from fedlap_jax[.m] import ...`` / module aliases.
  """
  import ast

  calls: dict[str, set[str]] = {}
  for path in sorted(package.rglob("*.py")):
    module = ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    names: dict[str, str] = {}  # local name -> "module.function"
    modules: dict[str, str] = {}  # local name -> module
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedlap_jax"):
        parts = node.module.split(".")
        for a in node.names:
          full = ".".join([*parts[1:], a.name])
          if len(parts) == 1 or package.joinpath(*full.split(".")).with_suffix(".py").exists():
            modules[a.asname or a.name] = full
          else:
            names[a.asname or a.name] = full
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
  users = {fn.rsplit(".", 1)[0] for fn in callers(calls, "privacy.poisson_gradient")}
  assert {"methods.fedlap.client", "baselines", "methods.condensation.one_shot"} <= users


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
  client=dataclasses.replace(
    TOY_FEDLAP.client, average_targets=True, model_steps="noisy_real", inner_loop=0
  ),
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
