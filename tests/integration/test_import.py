"""``import fedlap_jax`` must work where TensorFlow or Flower (flwr) is not installed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCK_TENSORFLOW = textwrap.dedent("""
    import importlib.abc
    import sys

    class BlockTensorFlow(importlib.abc.MetaPathFinder):
      # Behaves as if tensorflow (and tensorflow_datasets, ...) were not installed.
      def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].startswith("tensorflow"):
          raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

    sys.meta_path.insert(0, BlockTensorFlow())
    sys.modules["tensorflow"] = None
    try:
      import tensorflow  # noqa: F401
    except ImportError:
      pass
    else:
      raise SystemExit("the block does not work")
    """)


BLOCK_FLWR = textwrap.dedent("""
    import importlib.abc
    import sys

    class BlockFlwr(importlib.abc.MetaPathFinder):
      # Behaves as if flwr (Flower) were not installed.
      def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flwr", "ray"):
          raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

    sys.meta_path.insert(0, BlockFlwr())
    """)

# fedlap_flower's modules that must not need flwr (the rest are the Flower app itself).
FLWR_FREE = (
  "fedlap_flower",
  "fedlap_flower.settings",
  "fedlap_flower.task",
  "fedlap_flower.method_work",
  "fedlap_flower.server_work",
  "fedlap_flower.ledger",
)


def run_python(code: str, block: str = BLOCK_TENSORFLOW) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", block + textwrap.dedent(code)],
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_import_without_tensorflow():
  result = run_python("""
      import importlib, pkgutil
      import fedlap_jax
      names = [m.name for m in pkgutil.iter_modules(fedlap_jax.__path__, "fedlap_jax.")]
      for name in names:
        importlib.import_module(name)
      assert "tensorflow" not in [m.split(".")[0] for m in sys.modules if sys.modules[m]], (
          sorted(m for m in sys.modules if m.startswith("tensorflow")))
      missing = [n for n in fedlap_jax.__all__ if not hasattr(fedlap_jax, n)]
      assert not missing, missing
      print("OK", len(names), "modules")
      """)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("OK")


def test_block_is_effective():
  """The hook really makes TensorFlow unavailable (so the test above can fail)."""
  result = run_python("""
      import tensorflow_datasets
      """)
  assert result.returncode != 0
  assert "blocked by the test" in result.stderr or "No module named" in result.stderr


def test_import_without_flwr():
  """The library never imports Flower; neither do fedlap_flower's computation modules."""
  result = run_python(
    f"""
      import importlib, pkgutil
      import fedlap_jax
      names = [m.name for m in pkgutil.iter_modules(fedlap_jax.__path__, "fedlap_jax.")]
      for name in names + list({FLWR_FREE!r}):
        importlib.import_module(name)
      loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("flwr", "ray"))
      assert not loaded, loaded
      print("OK", len(names), "modules")
      """,
    block=BLOCK_FLWR,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("OK")


def test_flwr_block_is_effective():
  result = run_python(
    """
      import fedlap_flower.client_app
      """,
    block=BLOCK_FLWR,
  )
  assert result.returncode != 0
  assert "blocked by the test" in result.stderr


def test_import_loads_neither_flwr_nor_tensorflow_where_both_are_installed():
  """Not even an optional (try/except) import: with both installed, none is loaded."""
  result = run_python(
    """
      import importlib, pkgutil
      import fedlap_jax
      for m in pkgutil.iter_modules(fedlap_jax.__path__, "fedlap_jax."):
        importlib.import_module(m.name)
      loaded = sorted({m.split(".")[0] for m in sys.modules}
                      & {"flwr", "ray", "tensorflow", "tensorflow_datasets"})
      assert not loaded, loaded
      importlib.import_module("flwr")  # installed here (the flower extra): the test can fail
      print("OK")
      """,
    block="import sys\n",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("OK")


def test_the_main_jobs_install_brings_no_tensorflow():
  """TensorFlow and tfds are in the extra that downloads the paper's data sets only; the test
  extra brings that extra too (the tfds loaders are tested on ``tfds.testing.mock_data``)."""
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]

  def names(requirements):
    return {re.split(r"[\[<>=;\s]", r, maxsplit=1)[0].lower() for r in requirements}

  main_job = names(project["dependencies"]) | names(extras["experiments"])
  assert not {n for n in main_job if n.startswith("tensorflow")}, main_job
  assert {"tensorflow-cpu", "tensorflow-datasets"} <= names(extras["paper-data"])
  assert any(r.replace(" ", "") == "fedlap_jax[paper-data]" for r in extras["test"])


def test_the_main_job_loads_and_builds_its_runs_without_tensorflow():
  """The README's first command (``quickstart``) up to its first round, with TensorFlow not
  installed: every module of ``experiments`` imports, each run's data loads and its plan
  builds, and nothing loads TensorFlow; a tfds source then names the extra to install."""
  result = run_python("""
      import importlib, importlib.util, pkgutil
      for top in ("experiments", "fedlap_runs"):  # a wheel ships no experiments
        if importlib.util.find_spec(top) is not None:
          package = importlib.import_module(top)
          for m in pkgutil.walk_packages(package.__path__, top + "."):
            importlib.import_module(m.name)
      from fedlap_runs import build, flags
      config, _ = flags.load_config("quickstart")
      for run in config.suite.values():
        build.plan(run)
      loaded = sorted(m for m, v in sys.modules.items() if v and m.startswith("tensorflow"))
      assert not loaded, loaded
      from fedlap_runs import data
      try:
        data.load_tfds("mnist", cache_dir="none")
      except ValueError as e:
        assert "paper-data" in str(e) and "data.source" in str(e), e
      else:
        raise SystemExit("tfds loaded without tfds")
      print("OK", len(config.suite), "runs")
      """)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("OK 2 runs"), result.stdout
