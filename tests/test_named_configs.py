"""Every documented ``--config=NAME[:ARG]`` gives the config it gave when the names were frozen.

``tests/data/named_configs.json`` holds ``default``'s fields (value and type of each leaf) and,
for every name, its number of leaves and the leaves that differ from ``default`` (a suite's
``suite.RUN.FIELD`` against ``FIELD``), taken from the config files before they were merged
into parametrised builders.
"""

import json
from pathlib import Path

import ml_collections
import pytest

from experiments import configs

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
  del cfg.client["calibration_eval_size"]   # a None without placeholder(int)'s type
  cfg.client.calibration_eval_size = None
  assert flatten(cfg) != FROZEN["default"]
