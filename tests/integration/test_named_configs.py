"""Every documented ``--config=NAME[:ARG]`` gives the config it gave when the names were frozen.

``tests/integration/data/named_configs.json`` holds ``default``'s fields (value and type of
each leaf) and, for every name, its number of leaves and the leaves that differ from
``default`` (a suite's ``suite.RUN.FIELD`` against ``FIELD``), taken from the config files
before they were merged into parametrised builders.
"""

import json
from pathlib import Path

import ml_collections
import pytest

from fedlap_runs import configs

FROZEN = json.loads((Path(__file__).parent / "data" / "named_configs.json").read_text())


def flatten(cd, prefix=""):
  """``{path: [value as JSON gives it, type name]}`` of every leaf of ``cd``."""
  out = {}
  for k in cd.keys():
    v = cd[k]
    if isinstance(v, ml_collections.ConfigDict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = [json.loads(json.dumps(v)), cd.get_type(k).__name__]
  return out


def against_default(flat):
  base = FROZEN["default"]
  differs = {}
  for k, v in flat.items():
    parts = k.split(".")
    field = ".".join(parts[2:]) if parts[0] == "suite" else k
    if base.get(field) != v:
      differs[k] = v
  return {"leaves": len(flat), "differs": differs}


def test_default_is_unchanged():
  assert flatten(configs.load("default")) == FROZEN["default"]


@pytest.mark.parametrize("name", sorted(FROZEN["named"]))
def test_named_config_is_unchanged(name):
  assert against_default(flatten(configs.load(name))) == FROZEN["named"][name]


def test_a_changed_default_is_caught():
  cfg = configs.load("default")
  cfg.client.ipc = 51
  assert flatten(cfg) != FROZEN["default"]
  cfg = configs.load("default")
  del cfg.client["calibration_eval_size"]  # a None without placeholder(int)'s type
  cfg.client.calibration_eval_size = None
  assert flatten(cfg) != FROZEN["default"]


@pytest.mark.parametrize("name", sorted(FROZEN["named"]))
def test_the_cli_loads_the_same_config(name):
  """``experiments.run`` resolves ``--config=NAME[:ARG]`` (aliases too) to the same config."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  from fedlap_runs import flags as run_flags  # pylint: disable=g-import-not-at-top

  argv, label = run_flags.rewrite_argv(["prog", f"--config={name}"])
  assert label.startswith(name.partition(":")[0])
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  values(argv)
  assert values.config.to_dict() == configs.load(name).to_dict()


def test_every_alias_names_a_module_and_every_name_loads():
  for alias, target in configs.ALIASES.items():
    assert target.partition(":")[0] in configs.modules(), alias
  frozen = {n.partition(":")[0] for n in FROZEN["named"]} | {"default"}
  assert frozen <= set(configs.names())
  # new modules whose get_config needs an argument (every alias of them is frozen)
  assert set(configs.names()) - frozen == {"fedlap", "baselines", "synthetic_baselines", "dp_best"}


def _imports(path: Path) -> set[str]:
  import ast  # pylint: disable=g-import-not-at-top

  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "fedlap_runs.configs":
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "fedlap_runs.configs."
    ):
      out.add(node.module.split(".")[2])
  return out


def test_config_modules_import_each_other_without_a_cycle():
  folder = Path(configs.__file__).parent
  graph = {p.stem: _imports(p) for p in folder.glob("*.py") if p.stem != "__init__"}
  assert graph["quickstart"] == {"default", "fedlap"}
  done, active = set(), []

  def visit(node):
    assert node not in active, f"import cycle: {' -> '.join(active + [node])}"
    if node in done:
      return
    active.append(node)
    for nxt in graph.get(node, ()):
      visit(nxt)
    active.pop()
    done.add(node)

  for node in graph:
    visit(node)


if __name__ == "__main__":
  # Re-freeze after a DELIBERATE change of a config (e.g. a new field in default.py):
  #   PYTHONPATH=. python tests/integration/test_named_configs.py
  #   git diff tests/integration/data/named_configs.json
  base = flatten(configs.load("default"))
  FROZEN["default"] = base
  named = {n: against_default(flatten(configs.load(n))) for n in sorted(FROZEN["named"])}
  items = ",\n".join(f"{json.dumps(n)}: {json.dumps(v, sort_keys=True)}" for n, v in named.items())
  (Path(__file__).parent / "data" / "named_configs.json").write_text(
    "{\n\"default\": " + json.dumps(base, sort_keys=True) + ",\n\"named\": {\n" + items + "\n}\n}\n"
  )
