"""The API reference (docs/api, Sphinx autodoc) has a page for every module of the library.

CI builds it with warnings as errors (``.ci/run``: ``python -m sphinx -W -b html docs/api``);
here, without Sphinx, that no module is left out and the build command the README gives is
the one CI runs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_library_module_has_a_page():
  package = ROOT / "fedlap_jax"
  modules = {
    ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
    for p in package.rglob("*.py")
    if p.parent != package or not p.stem.startswith("_")
  }
  pages = {p.stem for p in (ROOT / "docs" / "api" / "modules").glob("*.rst")}
  assert pages == modules
  index = (ROOT / "docs" / "api" / "index.rst").read_text()
  for m in modules:
    assert f"   modules/{m}\n" in index
    assert (
      (ROOT / "docs" / "api" / "modules" / f"{m}.rst")
      .read_text()
      .endswith(f".. automodule:: fedlap_jax.{m}\n")
    )


def test_readme_and_ci_build_it_the_same_way():
  readme = (ROOT / "README.md").read_text()
  assert "python -m sphinx -W -b html docs/api docs/_build/api" in readme
  assert "(docs/api/index.rst)" in readme
  ci = (ROOT / ".ci" / "run").read_text()
  assert "python -m sphinx -W -q -b html docs/api" in ci
  # from the wheel, installed apart from the checkout
  assert 'FEDLAP_JAX_DOCS_PATH="$VENV_DIR/wheel_install" python -m sphinx' in ci


def test_the_reference_has_no_field_stubs_and_public_type_names(tmp_path):
  """NamedTuple fields are described in their class's Attributes:, not once more as "Alias for
  field number N" stubs; jax.Array is named as users write it, not by jaxlib's private module."""
  pytest.importorskip("sphinx")
  env = {**os.environ, "FEDLAP_JAX_DOCS_PATH": str(ROOT)}
  out = tmp_path / "text"
  subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "-q",
      "-b",
      "text",
      str(ROOT / "docs" / "api"),
      str(out),
    ],
    check=True,
    env=env,
  )
  text = "\n".join(p.read_text() for p in out.rglob("*.txt"))
  assert "Alias for field number" not in text
  assert "jaxlib" not in text
  # The fields stay documented, with their public type.
  assert "**epochs** (*jax.Array*)" in text
