"""The API reference (docs/api, Sphinx autodoc) has a page for every module of the library.

CI builds it with warnings as errors (``.ci/run``: ``python -m sphinx -W -b html docs/api``);
here, without Sphinx, that no module is left out and the build command the README gives is
the one CI runs.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_library_module_has_a_page():
  modules = {p.stem for p in (ROOT / "fedlap_jax").glob("*.py") if not p.stem.startswith("_")}
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
  assert "python -m sphinx -W -q -b html docs/api" in (ROOT / ".ci" / "run").read_text()
