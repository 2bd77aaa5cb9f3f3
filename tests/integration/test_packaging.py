"""What an installed ``fedlap_flower`` carries besides Python files, wherever it is installed from.

``.ci/run`` also runs this file against a built wheel installed in a second
environment (``FEDLAP_TESTS_FROM_WHEEL=1``, from a directory outside the
repository), where an editable install cannot stand in for the package data.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import fedlap_flower

WHEEL_ENV = "FEDLAP_TESTS_FROM_WHEEL"
DATA_FILES = ("app/pyproject.toml", "deploy/superlink_front.nginx.conf")


def test_the_package_carries_its_flower_app_and_front_config():
  root = importlib.resources.files("fedlap_flower")
  for name in DATA_FILES:
    assert root.joinpath(name).is_file(), name
  assert "[tool.flwr.app.components]" in root.joinpath("app/pyproject.toml").read_text()
  assert "@SUPERLINK_PORT@" in root.joinpath("deploy/superlink_front.nginx.conf").read_text()


def test_a_run_is_signed_against_the_installed_app(tmp_path):
  """The signing CLI's default ``--app`` is the installed app project, and Flower builds the
  bundle from it."""
  from fedlap_flower.runtime import run_signature
  from flower_federation import ssh_key_pair

  key = ssh_key_pair(tmp_path / "operator", "ed25519")
  out = tmp_path / "run.toml"
  assert run_signature.main(["--key", str(key), "--out", str(out)]) == 0
  assert '"run-nonce" = "' in out.read_text()


@pytest.mark.skipif(os.environ.get(WHEEL_ENV) != "1", reason=f"{WHEEL_ENV}=1: .ci/run's wheel")
def test_the_tests_run_against_an_installed_wheel():
  """Not the source tree, not an editable install: the wheel's files in site-packages."""
  here = Path(fedlap_flower.__file__).resolve()
  assert "site-packages" in here.parts, here
  assert not (here.parents[1] / "pyproject.toml").exists(), here  # no source checkout around it
  dist = importlib.metadata.distribution("fedlap_jax")
  direct = dist.read_text("direct_url.json")
  assert direct is None or not json.loads(direct).get("dir_info", {}).get("editable"), direct
  assert Path(sys.executable).parent == Path(sys.prefix) / "bin"


# Flower's modules that are not its public API (``flwr.app``, ``flwr.serverapp``,
# ``flwr.clientapp``, ``flwr.common`` are): only ``fedlap_flower.runtime`` may import them,
# checked against the Flower versions it was tested with at start-up.
FLOWER_PRIVATE = ("flwr.supercore", "flwr.proto", "flwr.supernode", "flwr.superlink")


def _imported_modules(path: Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
  return names


def test_only_the_runtime_subpackage_imports_flowers_private_modules():
  root = Path(fedlap_flower.__file__).resolve().parent
  outside = {
    str(path.relative_to(root)): sorted(
      m for m in _imported_modules(path) if m.startswith(FLOWER_PRIVATE)
    )
    for path in root.rglob("*.py")
    if "runtime" not in path.relative_to(root).parts
  }
  assert {f: m for f, m in outside.items() if m} == {}
  inside = set().union(*(_imported_modules(p) for p in (root / "runtime").rglob("*.py")))
  assert any(m.startswith(FLOWER_PRIVATE) for m in inside)  # the checker sees them


def test_the_test_federation_harness_is_not_part_of_the_package():
  """The harness that starts SuperLinks and SuperNodes for tests and benchmarks lives in
  tests/, not in what users install."""
  assert importlib.util.find_spec("fedlap_flower.federation") is None
  root = Path(fedlap_flower.__file__).resolve().parent
  assert not list(root.rglob("federation.py"))
