"""Shared tiny fixtures for the core tests.

Real data offline: scikit-learn's bundled digits (1,797 images, 8x8x1),
standardised, split 80/20 (stratified, fixed seed) and partitioned into five
clients of two classes each in the paper's class order. Models: a linear
classifier where a test checks how the library's functions compose (its programs
compile in about a second), narrow ConvNets where the model matters (learning,
per-layer clipping, instance norm, convolutions side by side).

``apply_fn`` and the parameters are session-scoped, so a jitted function built
on them is traced with the same static arguments in every module; a program
that takes over 0.1 s to compile is compiled once per session and read back
from the session's compilation cache after that (JAX's in-memory programs are
dropped after a module once the process holds many of them, see
``_release_compiled_programs``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import shutil
import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler as jax_compiler  # private: the one place JAX builds compile options

from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData, pixel_normalisation, stack_clients
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.models import ConvNet


REPO = pathlib.Path(__file__).resolve().parents[1]


CLASS_ORDER = (5, 6, 1, 2, 0, 8, 9, 3, 4, 7)
NUM_CLIENTS = 5
IMAGE_SHAPE = (8, 8, 1)


class Digits(NamedTuple):
  """Standardised digits: ``x`` ``(N, 8, 8, 1)`` float32, ``y`` ``(N,)`` int32."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


@contextlib.contextmanager
def raises_field(field: str, exc: type[BaseException] = ConfigError):
  """``pytest.raises(exc)`` that also checks the refusal names ``field`` (its ``field``
  attribute): a refusal is checked by what it refuses, not by its wording. Yields the
  ``ExceptionInfo``."""
  with pytest.raises(exc) as excinfo:
    yield excinfo
  assert getattr(excinfo.value, "field", None) == field, (field, excinfo.value)


def dp_below_floor(noise_multiplier: float, **fields) -> DPConfig:
  """A :class:`DPConfig` whose noise multiplier is below the accounting floor, which the
  constructor refuses: a mechanism test's negligible noise (no ledger is built from it)."""
  dp = DPConfig(noise_multiplier=1.0, **fields)
  object.__setattr__(dp, "noise_multiplier", noise_multiplier)
  return dp


def load_digits() -> Digits:
  # scikit-learn is in the `test` extra; a missing install fails loudly, not as skips.
  from sklearn import datasets, model_selection

  data = datasets.load_digits()
  x = data.images.astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
    x, y, test_size=0.2, random_state=0, stratify=y
  )
  mean, std = x_tr.mean(), x_tr.std()
  return Digits((x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te)


def partition(x: np.ndarray, y: np.ndarray, order=CLASS_ORDER, num_clients=NUM_CLIENTS):
  """Client ``i`` owns all records of classes ``order[2i]`` and ``order[2i+1]``."""
  per = len(order) // num_clients
  parts = []
  for i in range(num_clients):
    keep = np.isin(y, order[per * i : per * (i + 1)])
    parts.append((x[keep], y[keep]))
  return parts


@pytest.fixture(scope="session")
def digits() -> Digits:
  return load_digits()


@pytest.fixture(scope="session")
def client_parts(digits):
  """Five ``(x, y)`` numpy pairs, two classes each."""
  return partition(digits.x_train, digits.y_train)


@pytest.fixture(scope="session")
def clients(client_parts):
  """Stacked :class:`ClientData`, leaves ``(5, N_max, ...)``."""
  return stack_clients([x for x, _ in client_parts], [y for _, y in client_parts])


def apply_of(model: ConvNet):
  """``apply_fn(params, x) -> logits`` of a Flax ``model``."""

  def apply(params, x):
    return model.apply({"params": params}, x)

  return apply


def params_of(model: ConvNet):
  """``model``'s parameters for digits images, initialised under jit from ``PRNGKey(0)``."""
  return jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, *IMAGE_SHAPE)))["params"]


@pytest.fixture(scope="session")
def model() -> ConvNet:
  return ConvNet(num_classes=10, width=32, depth=2)


@pytest.fixture(scope="session")
def apply_fn(model):
  return apply_of(model)


@pytest.fixture(scope="session")
def params(model):
  return params_of(model)


@pytest.fixture(scope="session")
def tiny_model() -> ConvNet:
  """An even smaller ConvNet (width 8, depth 1) for loop-structure tests."""
  return ConvNet(num_classes=10, width=8, depth=1)


@pytest.fixture(scope="session")
def tiny_apply_fn(tiny_model):
  return apply_of(tiny_model)


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
  return params_of(tiny_model)


def linear_apply(params, x):
  """A linear classifier in Flax's Dense layout: ``(N, H, W, C) -> (N, 10)`` logits.

  For the tests of model-agnostic functions, eager and jitted: a handful of ops, so its
  programs compile in a fraction of a ConvNet's time.
  """
  return x.reshape(x.shape[0], -1) @ params["kernel"] + params["bias"]


@pytest.fixture(scope="session")
def linear_apply_fn():
  return linear_apply


@pytest.fixture(scope="session")
def class_order():
  return CLASS_ORDER


def linear_init(key: jax.Array) -> dict:
  """Fresh parameters of :func:`linear_apply` (``init(key) -> params``, jit-compatible)."""
  k1, k2 = jax.random.split(key)
  d = int(np.prod(IMAGE_SHAPE))
  return {
    "kernel": 0.1 * jax.random.normal(k1, (d, 10)),
    "bias": 0.1 * jax.random.normal(k2, (10,)),
  }


@pytest.fixture(scope="session")
def linear_params():
  return linear_init(jax.random.PRNGKey(0))


PIXEL_MAX = 16.0  # digits' pixels are integers 0..16


@pytest.fixture(scope="session")
def pixel_parts():
  """Five clients of raw digits pixels, ``uint8`` in 0..16, and their mean / std."""
  from sklearn import datasets

  data = datasets.load_digits()
  x = data.images.astype(np.uint8)[..., None]
  y = data.target.astype(np.int32)
  unit = x / PIXEL_MAX
  mean, std = unit.mean(axis=(0, 1, 2)), unit.std(axis=(0, 1, 2))
  return partition(x, y), mean, std


@pytest.fixture(scope="session")
def pixel_and_float_clients(pixel_parts):
  """The same clients twice: uint8 pixels + normalisation, and float32 model inputs.

  The float copy is normalised up front with the same XLA arithmetic. (NumPy's
  ``x * scale + offset`` differs by one float32 ulp where XLA fuses a
  multiply-add, and a FedLAP-DP round, image step 100 on a cosine matching
  loss, amplifies that to visible differences in the synthetic images.)
  """
  parts, mean, std = pixel_parts
  scale, offset = pixel_normalisation(mean, std, pixel_max=PIXEL_MAX)
  xs, ys = [x for x, _ in parts], [y for _, y in parts]
  pixels = stack_clients(xs, ys, pixel_scale=scale, pixel_offset=offset)
  floats = ClientData(jax.jit(jax.vmap(lambda c: c.normalise(c.x)))(pixels), pixels.y, pixels.mask)
  np.testing.assert_allclose(  # the up-front copy is the formula, to float32 rounding
    np.asarray(floats.x[0, : len(xs[0])]),
    np.asarray(xs[0], np.float32) * np.asarray(scale) + np.asarray(offset),
    atol=1e-6,
  )
  return pixels, floats


# Scheduling under ``python -m pytest -n 2``. Each test file goes to one worker whole
# (xdist's ``--dist loadfile``), so module fixtures are built once per run: xdist's default
# ("load") splits files at chunk boundaries, and ``--dist loadgroup`` does not group under
# pytest 9 with xdist 3.8 (each test becomes its own unit and module fixtures are rebuilt).
# Files are handed out in the order below (``--no-loadscope-reorder`` keeps it), the
# costliest first by summed ``--durations=0`` test times, so that the run ends on cheap
# files instead of one worker finishing a long file alone. Files not listed follow in their
# usual order. The order changes no test, only when it runs. Set here, not in pyproject's
# addopts, so that ``-p no:xdist`` runs still parse; an explicit ``--dist`` wins.
COSTLY_FIRST = (
  "test_flower.py",
  "test_generic_round.py",
  "test_kill_resume.py",
  "test_flower_hardened.py",
  "test_sharding.py",
  "test_experiments_synthetic.py",
  "test_client.py",
  "test_optim.py",
  "test_flower_replies.py",
  "test_round_steps.py",
  "test_learning.py",
  "test_round_pixels.py",
  "test_federated.py",
  "test_experiments_run.py",
  "test_baselines.py",
  "test_per_example.py",
  "test_round_side_by_side.py",
  "test_audit_trained_models.py",
  "test_privacy.py",
  "test_condensation.py",
  "test_dsa.py",
  "test_server_radius.py",
  "test_models.py",
  "test_auditing.py",
  "test_participation_runs.py",
  "test_compilation.py",
  "test_experiments_data.py",
  "test_equal_epsilon.py",
  "test_accounting.py",
  "test_matching.py",
  "test_readme.py",
)


# One persistent XLA compilation cache for the whole test session: the xdist workers and
# the processes tests start (experiments.run, Flower apps) inherit it through the
# environment, so a program that several tests build (the same round on the same shapes)
# is compiled once. A compiled round of the digits ConvNet takes 20-40 s of XLA on two
# cores, most of the suite's time. A cache hit loads the same executable that a compile
# would build, so no number changes. With a size limit JAX locks the entries (filelock),
# so that one process never reads what another is still writing. The directory is the
# session's own (removed at its end) unless JAX_COMPILATION_CACHE_DIR is set.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_CACHE_OWNER = "FEDLAP_TESTS_OWN_JAX_CACHE"
# The cache keeps every program that took over 0.1 s to compile (JAX's default: 1 s). Each
# entry costs a locked write; the thousands of single-operation programs of eager code (about
# 20 ms each) cost more to write than to compile again, so they stay out. tests/unit,
# ``-n 2``, a new cache / the same cache again: 121.6 / 109.4 s at JAX's 1 s, 113.0 / 83.1 s at
# 0.1 s, and 228.9 / 76.1 s with every program kept (0 s).
_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_MIN_COMPILE_SECS = "0.1"


# The tests' compiler setting: XLA:CPU with LLVM's optimisation level 0, XLA's older elementwise
# code generator (``--xla_cpu_use_fusion_emitters=false``) and XLA:CPU's fast-compile preset
# (``--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE``). A test round of the digits ConvNet is
# mostly compile time, and these settings compile it faster and run it slower, a net gain.
# test_federated's non-DP round (ConvNet 16 x 1, DSA), compile s / run s: XLA's defaults
# 13.1 / 0.6, level 0 9.5 / 2.1, level 0 with the older emitters 6.8-8.2 / 2.6-3.0, and with the
# preset too 5.1-5.7 / 2.7-3.0 (level 1 instead of 0 made the suite slower). The settings can
# change the last bits of a result (no fast-math in any of them, but the machine code of two
# settings may round differently), so a long run can end at a slightly different accuracy than
# with XLA's defaults (the shortened PSG run of tests/integration/test_experiments_synthetic.py:
# 0.5970 at level 0, 0.5995 at level 0 with the older emitters, 0.6020 with the defaults); a
# test that pins a number measured with XLA's defaults must allow for that. Two programs that
# compute the same thing but are fused differently (a round and its client_step/server_step, the
# Flower app and experiments.run) agree bit for bit under XLA's default emitters but not under
# the older ones, so the tests marked ``bitwise`` compile with the default emitters; the tests
# marked ``run_bound`` (long runs of few programs: the learning tests, the shortened
# FedDM/DSC/PSG runs) compile at LLVM level 1, where they run about three times faster (the
# non-DP round above: 0.8 s; the ``pytest_runtest_setup`` hook below).
# FEDLAP_TESTS_XLA_FLAGS overrides the setting (empty: XLA's defaults); flags already in
# XLA_FLAGS come after it and win. Set before JAX starts its backend, inherited by the workers
# and by every process a test starts.
_LEVEL_0 = "--xla_backend_optimization_level=0"
_OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_FAST_COMPILE = "--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE"
_TEST_XLA_FLAGS = f"{_LEVEL_0} {_OLDER_EMITTERS} {_FAST_COMPILE}"


def _set_test_xla_flags() -> None:
  ours = os.environ.get("FEDLAP_TESTS_XLA_FLAGS", _TEST_XLA_FLAGS)
  given = os.environ.get("XLA_FLAGS", "")
  if ours and not given.startswith(ours):  # a worker inherits them from the controller
    os.environ["XLA_FLAGS"] = f"{ours} {given}".strip()
  _Setting.session_flags = os.environ.get("XLA_FLAGS", "")


def pytest_configure(config):
  del config
  _set_test_xla_flags()
  # The processes the tests start buffer their output as Python does by default, whatever this
  # machine sets: a test that reads a killed process's output then checks that the program
  # flushed it, not that PYTHONUNBUFFERED did.
  os.environ.pop("PYTHONUNBUFFERED", None)
  if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="fedlap-tests-jax-cache-")
    os.environ[_CACHE_OWNER] = os.environ[_CACHE_ENV]
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  os.environ.setdefault(_MIN_COMPILE_ENV, _MIN_COMPILE_SECS)
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update(
    "jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"])
  )
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ[_MIN_COMPILE_ENV])
  )


def pytest_unconfigure(config):
  owned = os.environ.get(_CACHE_OWNER)
  if owned and not hasattr(config, "workerinput"):  # the controller, after its workers
    shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
  """Drops JAX's in-memory compiled programs after each test module.

  Every loaded XLA CPU executable holds a few memory mappings; an xdist worker that
  runs hundreds of test modules would otherwise collect them until the kernel's
  ``vm.max_map_count`` (65,530 by default) is reached, and the next compile or cache
  write segfaults (a worker at 41,980 mappings was seen near the end of a run). A
  later module that needs a program again reads it from the session's compilation
  cache, and gets the same executable.

  Between ``tests/unit`` modules they are kept until this process holds more than
  ``_MAX_KEPT_MAPPINGS`` mappings (a third of the kernel's default limit), so that those
  modules share their programs in memory: the many small ones (eager operations, the tests'
  jitted checks, under the persistent cache's 0.1 s) are compiled once, not once per module
  (``tests/unit`` in one process, cold: 1,442 -> 1,296 programs). Any other module starts
  with none kept and drops its own (some count the programs a run compiles), and where the
  mappings cannot be counted (no ``/proc``) every module drops them, as before.
  """
  unit = request.path.parent == UNIT_TESTS
  if not unit and _Kept.programs:
    _clear_compiled_programs()
  yield
  mappings = _mappings() if unit else None
  if mappings is None or mappings > _MAX_KEPT_MAPPINGS:
    _clear_compiled_programs()
  else:
    _Kept.programs = True


UNIT_TESTS = REPO / "tests" / "unit"


class _Kept:
  programs = False  # whether a module left its compiled programs in memory


def _clear_compiled_programs() -> None:
  jax.clear_caches()
  gc.collect()
  _Kept.programs = False


_MAX_KEPT_MAPPINGS = 20_000


def _mappings() -> int | None:
  """The number of memory mappings of this process (Linux), or None."""
  try:
    with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return None


# A test marker -> the XLA options its programs compile with (see above).
_SETTINGS = {
  "bitwise": {"xla_cpu_use_fusion_emitters": True},
  "run_bound": {"xla_backend_optimization_level": 1},
}


class _Setting:
  """This process's compiler setting."""

  active: str | None = None  # the marker whose setting is in force (None: the default)
  session_flags = ""  # XLA_FLAGS under the tests' default setting


_jax_compile_options = jax_compiler.get_compile_options  # JAX's own, before any replacement


def _with_options(flags: str, options: dict) -> str:
  """``XLA_FLAGS`` text ``flags`` with ``options`` in place of the flags of the same names."""
  kept = [f for f in flags.split() if f.lstrip("-").split("=")[0] not in options]
  return " ".join([*kept, *(f"--{k}={str(v).lower()}" for k, v in options.items())])


def _setting_of(item) -> str | None:
  marked = [m for m in _SETTINGS if item.get_closest_marker(m) is not None]
  if len(marked) > 1:
    raise pytest.UsageError(f"{item.nodeid}: at most one of {sorted(_SETTINGS)}")
  return marked[0] if marked else None


def _use_setting(name: str | None) -> None:
  """Compiles what follows with the setting of marker ``name`` (None: the tests' default).

  In this process through the compile options JAX gives XLA with every program (JAX passes
  them on as overrides of XLA_FLAGS), in processes a test starts through XLA_FLAGS. JAX's
  in-memory programs are dropped at each change (its jit caches do not key by these options);
  the persistent compilation cache keys its entries by them and by XLA_FLAGS, so no program
  compiled under one setting is reused under another.
  """
  if name == _Setting.active:
    return
  jax.clear_caches()
  if name is None:
    jax_compiler.get_compile_options = _jax_compile_options
    os.environ["XLA_FLAGS"] = _Setting.session_flags
  else:
    options = _SETTINGS[name]

    def with_options(*args, env_options_overrides=None, **kwargs):
      overrides = {**options, **(env_options_overrides or {})}
      return _jax_compile_options(*args, env_options_overrides=overrides, **kwargs)

    jax_compiler.get_compile_options = with_options
    os.environ["XLA_FLAGS"] = _with_options(_Setting.session_flags, options)
  _Setting.active = name


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  """A test marked ``bitwise`` or ``run_bound`` (or in a module so marked) compiles with its
  setting (see above), its fixtures included: the setting is in force from the setup of the
  test's fixtures on and stays until a test needs another. Nothing changes where the tests'
  default setting is not in use (FEDLAP_TESTS_XLA_FLAGS)."""
  if _OLDER_EMITTERS in _Setting.session_flags.split():
    _use_setting(_setting_of(item))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns -n's "no" into "load"
def pytest_cmdline_main(config):
  if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
    config.option.dist = "loadfile"
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(COSTLY_FIRST)}
  first_seen = {}
  for i, item in enumerate(items):
    first_seen.setdefault(item.path, i)
  # Within a file, tests of one setting run together, the marked ones first, so that a module
  # fixture a marked test uses is built under that test's setting.
  order = {name: i for i, name in enumerate(_SETTINGS)}
  items.sort(
    key=lambda item: (
      rank.get(item.path.name, len(rank)),
      first_seen[item.path],
      order.get(_setting_of(item), len(order)),
    )
  )


TINY_FEDLAP_FLAGS = {
  # FedLAP at its smallest for tests that run experiments.run (kill, resume, release, seed):
  # a 1-layer, 8-wide ConvNet, one matching step per round, no DSA, no progress bar.
  "model.width": 8,
  "model.depth": 1,
  "client.ipc": 2,
  "client.iterations": 1,
  "client.max_outer": 1,
  "client.batch_loop": 2,
  "client.boost_loop": 1,
  "client.inner_loop": 0,
  "client.batch_size": 16,
  "client.dsa_strategy": "",
  "server.dsa_strategy": "",
  "server.max_epochs": 2,
  "eval_chunk_size": 400,
  "progress_bar": False,
}
