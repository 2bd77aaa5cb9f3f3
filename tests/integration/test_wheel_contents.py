"""What the wheel ships: the project's own packages only, none with a generic name.

A top-level ``experiments`` (or ``tests``) in site-packages shadows a user's own folder of that
name (``python -m experiments.run`` then fails in their project). The Flower app runs from the
wheel, so what it imports of the runs' machinery is in ``fedlap_runs``, below both front ends;
``experiments`` is the command line of a checkout.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
SHIPPED = {"fedlap_jax", "fedlap_runs", "fedlap_flower"}


def _imports(package: str) -> set[tuple[str, str]]:
  """``(file, imported top-level package)`` of every import under ``package/``, also inside
  functions."""
  found = set()
  for path in sorted((ROOT / package).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      found |= {(str(path.relative_to(ROOT)), n.split(".")[0]) for n in names}
  return found


def test_the_wheel_ships_the_projects_packages_and_no_generic_name():
  tomllib = pytest.importorskip("tomllib")
  setuptools = pytest.importorskip("setuptools")
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  find = pyproject["tool"]["setuptools"]["packages"]["find"]
  packages = setuptools.find_packages(
    where=str(ROOT), include=find["include"], exclude=find.get("exclude", ())
  )
  top = {p.split(".")[0] for p in packages}
  assert top == SHIPPED, top
  assert not {"experiments", "tests", "benchmarks"} & top


def test_what_ships_imports_nothing_that_does_not_ship():
  """The Flower app and the shared package import neither ``experiments`` nor ``tests`` nor
  ``benchmarks``; the shared package imports no front end."""
  wrong = [
    (f, pkg)
    for package in SHIPPED
    for f, pkg in _imports(package)
    if pkg in ("experiments", "tests", "benchmarks", "conftest")
    or (package == "fedlap_runs" and pkg == "fedlap_flower")
  ]
  assert wrong == []
