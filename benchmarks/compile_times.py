r"""Time to first result: what a run's round program costs to build, cold and from the cache.

Usage, from the repository root::

  python -m benchmarks.compile_times                      # every config of CONFIGS
  python -m benchmarks.compile_times --small              # the quickstart configs, a few minutes
  python -m benchmarks.compile_times --configs quickstart:dp,cifar_dp --ref a27beca
  python -m benchmarks.compile_times --json out.json

For each named config the script prints the round program's HLO instruction count (as JAX
hands it to XLA, and after XLA's optimisation: instructions, fusions, the distinct fused
kernels XLA's back end generates code for and where they come from, while loops,
conditionals), its trace, lower and compile seconds, the set-up's programs and seconds, and
the round-1 overhead: round 1 minus the median of the later rounds, each round timed as
``experiments.run`` times it (the round and the test-set evaluation). Each config is measured
twice, each time in a fresh process: **cold** (an empty persistent compilation cache, which
the process fills) and **warm** (the same cache again: what a second run of the config on the
machine pays). Both processes use the same cache settings, the ones ``experiments.run`` uses
(:data:`fedlap_runs.compilation_cache.MIN_COMPILE_SECS`), set on JAX directly so that
another tree's code is measured under the same settings.

``--ref REF`` measures the git commit ``REF`` too, in the same run and on identical work: a
throwaway worktree of ``REF`` is checked out, and the same measuring code (this file) runs in
child processes that import ``fedlap_jax``, ``experiments`` and ``fedlap_flower`` from it
alone (an editable install's import finder, which would answer for a module the ref lacks, is
removed; a module imported from elsewhere fails the row). The worktree is removed at the end.

Data: the digits configs use the real bundled digits. cifar10 and mnist cannot be downloaded
here, so their configs read a synthetic stand-in (uniform random uint8 images of the same
shapes, and the same records per class, hence the same client sizes under the paper's
partition); compile times depend on shapes, not values, and the output says so. On a CPU the
large configs' rounds take minutes each, so by default only their program is built (traced,
lowered, compiled, not run) and their round-1 overhead is not measured
(``--large-rounds N`` runs 1 + N rounds of them as well).

``--phases`` builds each round once more in a third process, without the cache and under JAX's
profiler, and prints where XLA's compile goes: its HLO passes, the emission of the fused kernels
and LLVM's code generation (from XLA:CPU's own trace events; :func:`compile_phases`), beside
the round's trace and lower seconds. It separates what a smaller program could save (the
per-kernel phases) from what every cold build pays before the first kernel.

The XLA options are the environment's (``XLA_FLAGS`` is printed); the test suite's
fast-compile options do not apply.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = (
  "quickstart:nondp",
  "quickstart:dp",
  "quickstart:dp_loops",
  "cifar_dp",
  "cifar_nondp",
  "mnist_fedavg_dp",
)
SMALL_CONFIGS = ("quickstart:nondp", "quickstart:dp", "quickstart:dp_loops")
# Configs whose data is a synthetic stand-in and whose rounds are not run by default.
LARGE = ("cifar_dp", "cifar_nondp", "mnist_fedavg_dp")
LATER_ROUNDS = 3  # rounds after round 1 whose median is the steady round time
SMALL_LATER_ROUNDS = 2

# Records per class of the real datasets (train, test): the stand-ins keep them, so the paper's
# partition gives the same client sizes. Shapes are (H, W, C).
STAND_INS = {
  "cifar10": ((32, 32, 3), (5000,) * 10, (1000,) * 10),
  "mnist": (
    (28, 28, 1),
    (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
  ),
}

# JAX's monitoring events of the three stages of building a program.
STAGE_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
RESULT_PREFIX = "COMPILE_TIMES_RESULT "


# ----------------------------------------------------------------------------
# Where XLA's compile goes: its phases, from a profile of one compile.
# ----------------------------------------------------------------------------

# XLA:CPU's own trace events (TraceMe names of this jaxlib) that mark the phases of a compile.
# They are XLA's internals, not an API: a jaxlib that names them otherwise gives ``None``s.
PHASE_EVENTS = {
  "total": ("backend_compile_and_load",),
  "hlo_passes": ("HLO passes",),  # through / after layout assignment, after scheduling
  "emission": ("ThunkEmitter::EmitEntryComputation", "ThunkEmitter::ConsumeKernels"),
  "llvm": ("JitCompiler::Compile",),
}
# One per kernel XLA's fusion emitters generate (none with --xla_cpu_use_fusion_emitters=false).
KERNEL_EVENT = "FusionCompiler::Compile"
LLVM_TASK_EVENT = "TaskDispatcher::dispatch"  # one per LLVM compile task on XLA's threads


def compile_phases(events: list[dict]) -> dict[str, float | int | None]:
  """The phases of one XLA compile from its profiler trace events.

  Args:
    events: Chrome-trace complete events (``ph == "X"``, ``dur`` in microseconds) of a
      profile that holds exactly one backend compile.

  Returns:
    Wall seconds of ``total`` (the backend compile), ``hlo_passes`` (XLA's HLO optimisation,
    one thread), ``emission`` (the thunks and the fusion emitters' kernels) and ``llvm``
    (LLVM's optimisation and code generation of the kernels, on XLA's threads); ``other``
    (``total`` less the three); ``emitted_kernels`` (kernels XLA's fusion emitters generated;
    0 under its older emitters, which trace none), ``llvm_tasks`` and ``llvm_task_s`` (LLVM's
    compile tasks and their summed seconds over the threads). A phase whose events the trace
    lacks is ``None``.
  """
  complete = [e for e in events if e.get("ph") == "X"]
  out: dict[str, float | int | None] = {}
  for phase, prefixes in PHASE_EVENTS.items():
    durs = [e["dur"] for e in complete if e["name"].startswith(prefixes)]
    out[f"{phase}_s"] = sum(durs) / 1e6 if durs else None
  parts = [out[f"{p}_s"] for p in ("hlo_passes", "emission", "llvm")]
  total = out["total_s"]
  out["other_s"] = None if total is None or None in parts else total - sum(parts)  # type: ignore[operator]
  tasks = [e["dur"] for e in complete if e["name"] == LLVM_TASK_EVENT]
  out["emitted_kernels"] = sum(1 for e in complete if e["name"] == KERNEL_EVENT)
  out["llvm_tasks"] = len(tasks)
  out["llvm_task_s"] = sum(tasks) / 1e6
  return out


def profiled(fn):
  """``(fn(), compile_phases of the profile of that call)``: ``fn`` builds one program."""
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import trace_summary  # pylint: disable=g-import-not-at-top

  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # XLA's events only: no event per Python call
  with tempfile.TemporaryDirectory(prefix="compile-profile-") as d:
    with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=options):
      value = fn()
    traces = list(Path(d).rglob("*.trace.json.gz"))
    if len(traces) != 1:
      raise RuntimeError(f"expected one perfetto trace under {d}, found {len(traces)}")
    events = trace_summary.load(traces[0])
  return value, compile_phases(events)


# ----------------------------------------------------------------------------
# HLO text.
# ----------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _opcode(rest: str) -> str | None:
  """The opcode of an HLO instruction's text after ``name = `` (its shape comes first)."""
  if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        rest = rest[i + 1 :]
        break
  else:
    rest = rest.partition(" ")[2]
  match = re.match(r"\s*([a-z][\w\-]*)\(", rest)
  return match.group(1) if match else None


def _computation_name(line: str) -> str | None:
  """The name of the computation an HLO text line opens (``%name (...) -> ... {``), else None."""
  head = _COMPUTATION.match(line)
  if head and "=" not in line.partition("{")[0].split("(")[0]:
    return head.group(2)
  return None


def hlo_counts(text: str) -> dict[str, int]:
  """Counts of an HLO module's text: ``instructions`` (all, fused computations included),
  ``computations``, ``fusions`` (fusion instructions), ``while``, ``conditional``, ``call``,
  ``custom-call``, ``dot`` and ``convolution`` instructions."""
  counts = dict.fromkeys(
    (
      "instructions",
      "computations",
      "fusions",
      "while",
      "conditional",
      "call",
      "custom-call",
      "dot",
      "convolution",
    ),
    0,
  )
  for line in text.splitlines():
    if _computation_name(line) is not None:
      counts["computations"] += 1
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    op = _opcode(match.group(1))
    if op is None:
      continue
    counts["instructions"] += 1
    key = "fusions" if op == "fusion" else op
    if key in counts:
      counts[key] += 1
  return counts


# jax.random's own jitted pieces, as they name a fused instruction's op_name.
_PRNG_SCOPE = re.compile(
  r"jit\((?:_?threefry\w*|_randint|_uniform|_normal\w*|_shuffle|_bernoulli|_gamma\w*|"
  r"_truncated_normal|_permutation|_random_bits|_split|_fold_in)\)"
)
# A model's layers: Flax (and Equinox) name scopes are the modules' names, capitalised
# (``ConvNet/Conv_0``, ``jvp(ConvNet)/GroupNorm_1``); JAX's own scopes are lower case.
_MODEL_SCOPE = re.compile(r"(?:^|/|\()[A-Z]\w*")
_NAME = re.compile(r"%[\w.\-]+")
_METADATA = re.compile(r",\s*metadata=\{[^}]*\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")


def kernel_table(text: str) -> list[tuple[str, str]]:
  """``(origin, output shape)`` of each distinct fused kernel of an optimised HLO module's text.

  XLA:CPU generates code once per distinct fused computation, so the distinct fusion bodies
  (their instructions with names and metadata removed) are what its back end compiles, not
  the fusion instructions. Each distinct body is attributed by the ``op_name`` of its first
  fusion instruction: ``prng`` (``jax.random``'s pieces: threefry, randint, uniform,
  normal, shuffle), ``model`` (a capitalised module scope: the model's layers, forward or
  differentiated) or ``other``; its shape is that instruction's result shape without layout
  (``f32[20,4,4,32]``).
  """
  bodies: dict[str, list[str]] = {}
  calls: list[tuple[str, str, str]] = []  # (called computation, op_name, result shape)
  current = None
  for line in text.splitlines():
    name = _computation_name(line)
    if name is not None:
      current = name
      bodies[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    bodies[current].append(_METADATA.sub("", _NAME.sub("%", line.strip())))
    match = _INSTRUCTION.match(line)
    called = _CALLS.search(line)
    if match and called and _opcode(match.group(1)) == "fusion":
      op_name = _OP_NAME.search(line)
      shape = _LAYOUT.sub("", match.group(1).partition(" fusion(")[0])
      calls.append((called.group(1), op_name.group(1) if op_name else "", shape))
  kernels: dict[str, tuple[str, str]] = {}
  for called, op_name, shape in calls:
    body = "\n".join(bodies.get(called, ()))
    if body in kernels:
      continue
    if _PRNG_SCOPE.search(op_name):
      kernels[body] = ("prng", shape)
    elif _MODEL_SCOPE.search(op_name):
      kernels[body] = ("model", shape)
    else:
      kernels[body] = ("other", shape)
  return list(kernels.values())


def kernel_counts(table: list[tuple[str, str]]) -> dict[str, int]:
  """``distinct`` kernels of a :func:`kernel_table` and its ``prng``, ``model`` and ``other``
  parts, which add up to it."""
  counts = {"distinct": len(table), "prng": 0, "model": 0, "other": 0}
  for origin, _ in table:
    counts[origin] += 1
  return counts


def kernel_shapes(table: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
  """Per origin, how many distinct kernels of a :func:`kernel_table` have each result shape."""
  shapes: dict[str, collections.Counter] = {}
  for origin, shape in table:
    shapes.setdefault(origin, collections.Counter())[shape] += 1
  return {origin: dict(c.most_common()) for origin, c in shapes.items()}


# ----------------------------------------------------------------------------
# Stand-in data.
# ----------------------------------------------------------------------------


def stand_in_npz(name: str, directory: Path) -> Path:
  """A synthetic ``name`` npz (uniform uint8 images, the real per-class counts) in ``directory``."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  path = directory / f"stand_in_{name}.npz"
  if path.exists():
    return path
  shape, train, test = STAND_INS[name]
  rng = np.random.default_rng(0)

  def split(counts):
    y = np.repeat(np.arange(10, dtype=np.int32), counts)
    y = y[rng.permutation(len(y))]
    return rng.integers(0, 256, (len(y), *shape), dtype=np.uint8), y

  x_train, y_train = split(train)
  x_test, y_test = split(test)
  tmp = directory / f".{path.name}.tmp.npz"
  np.savez(tmp, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  tmp.replace(path)
  return path


# ----------------------------------------------------------------------------
# The child: one config, one cache state, in a fresh process.
# ----------------------------------------------------------------------------


class _Events:
  """JAX's stage events and cache hits, per phase of the child's work."""

  def __init__(self) -> None:
    self.phase = "import"
    self.rows: dict[str, dict[str, float]] = {}

  def _row(self) -> dict[str, float]:
    # A program built on another thread (fedlap_runs.export_cache.prefetch) is the
    # background's, whatever the main thread does meanwhile.
    main = threading.current_thread() is threading.main_thread()
    return self.rows.setdefault(
      self.phase if main else "background",
      {f"{s}_{k}": 0.0 for s in STAGE_EVENTS.values() for k in ("n", "s")} | {"cache_hits": 0.0},
    )

  def on_duration(self, event: str, seconds: float, **kwargs: Any) -> None:
    del kwargs
    stage = STAGE_EVENTS.get(event)
    if stage is not None:
      row = self._row()
      row[f"{stage}_n"] += 1
      row[f"{stage}_s"] += seconds

  def on_event(self, event: str, **kwargs: Any) -> None:
    del kwargs
    if event == CACHE_HIT_EVENT:
      self._row()["cache_hits"] += 1

  @contextlib.contextmanager
  def during(self, phase: str):
    previous, self.phase = self.phase, phase
    try:
      yield
    finally:
      self.phase = previous


def _jitted_call(fn, *args):
  """``fn(*args)`` as a traced-but-not-lowered JAX stage (``jax.stages.Traced``).

  A method's ``round`` is ``functools.partial(jit, **static arguments)``; its jit is traced
  with the same static arguments as a call would use, so the call and this share one trace,
  one lowering and one compiled program.
  """
  import jax  # pylint: disable=g-import-not-at-top

  if isinstance(fn, functools.partial) and hasattr(fn.func, "trace"):
    return fn.func.trace(*fn.args, *args, **fn.keywords)
  return jax.jit(fn).trace(*args)


# The project's top-level packages: a child imports each from its tree alone.
PACKAGES = ("fedlap_jax", "experiments", "fedlap_runs", "fedlap_flower", "benchmarks")


def _only_from(tree: Path) -> None:
  """Makes this process import the project's packages from ``tree`` alone.

  An editable install of the project (``pip install -e``) adds an import finder that maps
  the packages to the installed tree; it comes after ``PYTHONPATH`` for a package, but it
  answers for a module ``tree`` lacks (``fedlap_runs.export_cache`` in a tree from before
  it), so a ref's run would import that module from the installed tree. Removed here.
  """
  sys.meta_path[:] = [
    f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
  ]
  sys.path_hooks[:] = [
    h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")
  ]
  sys.path_importer_cache.clear()
  if str(tree) not in sys.path:
    sys.path.insert(0, str(tree))


def _foreign_modules(tree: Path) -> list[str]:
  """The project's modules this process imported from outside ``tree``."""
  root = tree.resolve()
  out = []
  for name, module in list(sys.modules.items()):
    if name.split(".")[0] not in PACKAGES or getattr(module, "__file__", None) is None:
      continue
    if root not in Path(module.__file__).resolve().parents:
      out.append(f"{name} ({module.__file__})")
  return out


def _child(spec: dict) -> dict:
  """Measures one config in this (fresh) process; see the module docstring."""
  t_process = time.perf_counter()
  tree = Path(spec["tree"])
  _only_from(tree)
  import jax  # pylint: disable=g-import-not-at-top

  events = _Events()
  jax.monitoring.register_event_duration_secs_listener(events.on_duration)
  jax.monitoring.register_event_listener(events.on_event)
  if spec["cache_dir"]:
    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", spec["min_compile_secs"])
    jax.config.update("jax_compilation_cache_max_size", spec["max_size"])
  else:
    jax.config.update("jax_enable_compilation_cache", False)

  import fedlap_jax  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top

  try:  # the command line's config and its DP calibration, in their own modules
    from fedlap_runs.calibration import calibrate_noise  # pylint: disable=g-import-not-at-top
    from fedlap_runs.flags import load_config  # pylint: disable=g-import-not-at-top
  except ImportError:  # a --ref from before they left experiments.run
    from experiments.run import calibrate_noise, load_config  # pylint: disable=g-import-not-at-top

  # A --ref from before fedlap_runs.build builds its run in experiments.train.
  build_run = getattr(train, "build_run", None)
  if build_run is None:
    from fedlap_runs.build import build_run  # pylint: disable=g-import-not-at-top
  from fedlap_jax.client_data import normalise_pixels  # pylint: disable=g-import-not-at-top
  from fedlap_jax.training import evaluate  # pylint: disable=g-import-not-at-top

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  out: dict[str, Any] = {
    "load_before": os.getloadavg()[0],
    "fedlap_jax": str(Path(fedlap_jax.__file__).resolve().parents[1]),
    "jax": jax.__version__,
    "device": str(jax.devices()[0].device_kind),
    "import_s": time.perf_counter() - t_process,
  }
  t_setup = time.perf_counter()
  with events.during("setup"):
    cfg, _ = load_config(spec["config"], spec["overrides"])
    calibrate_noise(cfg)
    try:  # the round as experiments.train runs it: from the export cache (trees that have it)
      from fedlap_runs import export_cache  # pylint: disable=g-import-not-at-top
    except ImportError:
      export_cache = None
    hint = None
    if hasattr(export_cache, "prefetch"):  # loaded while the set-up runs, as train does
      hint = export_cache.hint_of("benchmarks.compile_times", spec["config"], spec["overrides"])
      out["prefetch"] = export_cache.prefetch(hint)
    setup = build_run(cfg)
    alg, state, clients = setup.algorithm, setup.state, setup.clients
    out["export_cache"] = False
    if export_cache is not None:
      alg = export_cache.wrap(alg, **({} if hint is None else {"hint": hint}))
      out["export_cache"] = isinstance(alg.round, export_cache.ExportedRound)
    dataset = setup.dataset
    x_test, y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
    to_inputs = functools.partial(
      normalise_pixels,
      pixel_scale=jnp.asarray(dataset.pixel_scale),
      pixel_offset=jnp.asarray(dataset.pixel_offset),
    )
    apply_fn, chunk_size = setup.apply_fn, cfg.eval_chunk_size

    def evaluate_test_split(p, x, y):
      return evaluate(apply_fn, p, x, y, chunk_size=chunk_size, preprocess=to_inputs)

    eval_fn = jax.jit(evaluate_test_split)
    if hasattr(export_cache, "wrap_program"):  # as experiments.train evaluates
      eval_fn = export_cache.wrap_program(eval_fn)
    jax.block_until_ready((state, clients, x_test, y_test))
  out["setup_s"] = time.perf_counter() - t_setup
  out["client_sizes"] = [len(i) for i in setup.client_indices]

  def one_round(state):
    t0 = time.perf_counter()
    with events.during("round" if rounds_run == 0 else "later"):
      state, metrics = alg.round(state, clients)
    with events.during("eval" if rounds_run == 0 else "later"):
      ev = eval_fn(alg.params_of(state), x_test, y_test)
      float(ev.accuracy)
    jax.block_until_ready((state, metrics))
    return state, time.perf_counter() - t0

  def lower():
    """The round's lowered program, as a run builds it."""
    if out["export_cache"]:  # read back (or exported), then compiled
      return alg.round.program(state, clients).lower(state, clients)
    return _jitted_call(alg.round, state, clients).lower()

  def build():
    """The round's lowered and compiled program, as a run builds it."""
    lowered = lower()
    return lowered, lowered.compile()

  rounds = []
  rounds_run = 0
  if spec["rounds"] > 0:
    for _ in range(spec["rounds"]):
      state, seconds = one_round(state)
      rounds.append(seconds)
      if rounds_run == 0:  # the time to first result: from the process's start
        out["first_round_done_s"] = time.perf_counter() - t_process
      rounds_run += 1
    with events.during("hlo"):  # the same program: read from JAX's caches
      lowered, compiled = build()
  else:  # built, not run
    with events.during("round"):
      t0 = time.perf_counter()
      if spec.get("phases"):  # only the compile is profiled (a profile keeps so many events)
        lowered = lower()
        compiled, out["phases"] = profiled(lowered.compile)
      else:
        lowered, compiled = build()
      out["build_s"] = time.perf_counter() - t0
  out["rounds_s"] = rounds
  if len(rounds) >= 2:
    steady = statistics.median(rounds[1:])
    out["steady_round_s"] = steady
    out["round1_overhead_s"] = rounds[0] - steady
  out["hlo_input"] = hlo_counts(lowered.as_text(dialect="hlo"))
  optimised = compiled.as_text()
  out["hlo_optimised"] = hlo_counts(optimised)
  kernels = kernel_table(optimised)
  out["kernels"] = kernel_counts(kernels)
  out["kernel_shapes"] = kernel_shapes(kernels)
  out["events"] = events.rows
  out["process_s"] = time.perf_counter() - t_process
  foreign = _foreign_modules(tree)
  if foreign:
    raise RuntimeError(f"modules imported from outside {tree}: {', '.join(foreign)}")
  out["load_after"] = os.getloadavg()[0]
  return out


# ----------------------------------------------------------------------------
# The parent.
# ----------------------------------------------------------------------------


def _overrides(name: str, data_dir: Path, given: list[str]) -> tuple[list[str], str | None]:
  """``(overrides, stand-in dataset name or None)`` of config ``name`` with ``given`` ones."""
  from fedlap_runs import flags  # pylint: disable=g-import-not-at-top

  cfg, _ = flags.load_config(name, given)
  dataset = cfg.data.name
  overrides = list(given)
  if dataset in STAND_INS:
    overrides.append(f"data.source=npz:{stand_in_npz(dataset, data_dir)}")
    return overrides, dataset
  return overrides, None


def _child_env(tree: Path) -> dict[str, str]:
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "FEDLAP_COMPILATION"))
  }
  env["PYTHONPATH"] = str(tree)
  return env


def run_child(tree: Path, spec: dict, timeout: float) -> dict:
  """Runs :func:`_child` on ``spec`` in a fresh process that imports the code of ``tree``."""
  proc = subprocess.run(
    [sys.executable, "-P", str(Path(__file__).resolve()), "--child", json.dumps(spec)],
    cwd=tree,
    env=_child_env(tree),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
  if proc.returncode != 0 or line is None:
    tail = (proc.stderr or proc.stdout)[-3000:]
    return {"error": f"exit {proc.returncode}: {tail}"}
  result = json.loads(line[len(RESULT_PREFIX) :])
  if Path(result["fedlap_jax"]) != tree.resolve():
    raise RuntimeError(f"the child imported {result['fedlap_jax']}, not {tree}")
  return result


def _dir_size(path: Path) -> tuple[int, int]:
  files = [p for p in (*path.rglob("*-cache"), *path.rglob("*.jaxexport")) if p.is_file()]
  return len(files), sum(p.stat().st_size for p in files)


def measure(tree: Path, name: str, args, work: Path) -> dict:
  """Cold then warm measurement of config ``name`` on the code of ``tree``."""
  from fedlap_runs import compilation_cache  # pylint: disable=g-import-not-at-top

  overrides, stand_in = _overrides(name, work, args.set)
  large = name in LARGE
  rounds = (1 + args.large_rounds if args.large_rounds else 0) if large else 1 + args.later_rounds
  cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
  spec = {
    "config": name,
    "overrides": overrides,
    "rounds": rounds,
    "cache_dir": str(cache),
    "tree": str(tree),
    "min_compile_secs": compilation_cache.MIN_COMPILE_SECS,
    "max_size": compilation_cache.MAX_BYTES,
  }
  result = {"config": name, "stand_in": stand_in}
  for state in ("cold", "warm"):
    result[state] = run_child(tree, spec, args.timeout)
    if state == "cold":
      result["cache_entries"], result["cache_bytes"] = _dir_size(cache)
  shutil.rmtree(cache, ignore_errors=True)
  if args.phases:  # a third process: the program built once more, no cache, under the profiler
    result["phases"] = run_child(
      tree, {**spec, "cache_dir": None, "rounds": 0, "phases": True}, args.timeout
    )
  return result


@contextlib.contextmanager
def ref_tree(ref: str, work: Path):
  """A throwaway worktree of git commit ``ref`` (removed on exit)."""
  path = work / f"ref-{re.sub(r'[^A-Za-z0-9_.-]', '_', ref)}"
  subprocess.run(
    ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), ref],
    check=True,
    capture_output=True,
    text=True,
  )
  try:
    yield path
  finally:
    subprocess.run(
      ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
      capture_output=True,
      check=False,
    )


def _f(x, fmt="{:.1f}") -> str:
  return "n/a" if x is None else fmt.format(x)


def _stage(run: dict, stage: str) -> float | None:
  row = run.get("events", {}).get("round")
  return None if row is None else row[f"{stage}_s"]


def _compile(run: dict) -> str:
  """The round's compile (or read) seconds; ``bg`` where it was built on the background thread
  during the set-up (a prefetch), not in round 1."""
  events = run.get("events", {})
  if events.get("round", {}).get("compile_n") or "background" not in events:
    return _f(_stage(run, "compile"), "{:.2f}")
  return f"{events['background']['compile_s']:.2f} bg"


def _kernels(run: dict) -> str:
  """``distinct: prng / model / other`` of :func:`kernel_counts`."""
  k = run["kernels"]
  return f"{k['distinct']:,}: {k['prng']} / {k['model']} / {k['other']}"


HEADER = (
  "| tree | config | cache | HLO in / optimised | fusions | kernels: PRNG / model / other | "
  "while | cond | trace s | lower s | compile s | set-up: programs (by XLA) / s | round 1 s | "
  "later s | round-1 overhead s | to round 1 s | cache MB | load |",
  "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
)


def table(results: list[dict]) -> list[str]:
  """The printed table: one row per (tree, config, cache state)."""
  return [*HEADER, *(row for r in results for row in rows(r))]


def rows(r: dict) -> list[str]:
  """The table rows of one measured config, cold and warm.

  ``compile s`` is XLA's compile when cold and the cache's read when warm; ``cache MB`` is
  what the cold process wrote (every program of the config that took at least the threshold);
  ``load`` the machine's 1-minute load average when the process started and ended (above the
  core count, the figures are provisional). A tree with :mod:`fedlap_runs.export_cache` runs
  the round from it, as ``experiments.train`` does (its JSON's ``export_cache``): its warm
  ``trace`` is the call's alone; a tree that prefetches it loads it on a background thread
  during the set-up (``compile s`` then reads ``bg``). ``to round 1 s`` is the time from the
  process's start to the end of round 1 (imports, set-up, round 1): an overlap moves seconds
  out of the round-1 overhead but not out of this.
  """
  lines = []
  name = r["config"] + (" (stand-in data)" if r["stand_in"] else "")
  for state in ("cold", "warm"):
    run = r[state]
    if "error" in run:
      lines.append(f"| {r['tree']} | {name} | {state} | error: see below |")
      continue
    hin, hopt = run["hlo_input"], run["hlo_optimised"]
    setup = run["events"].get("setup", {})
    programs = setup.get("compile_n", 0)
    by_xla = programs - setup.get("cache_hits", 0)
    rounds = run["rounds_s"]
    size = f"{r['cache_bytes'] / 1e6:.1f}" if state == "cold" else ""
    lines.append(
      f"| {r['tree']} | {name} | {state} | "
      f"{hin['instructions']:,} / {hopt['instructions']:,} | "
      f"{hopt['fusions']:,} | {_kernels(run)} | {hopt['while']} | {hopt['conditional']} | "
      f"{_f(_stage(run, 'trace'), '{:.2f}')} | {_f(_stage(run, 'lower'), '{:.2f}')} | "
      f"{_compile(run)} | {programs:.0f} ({by_xla:.0f}) / "
      f"{run['setup_s']:.1f} | {_f(rounds[0] if rounds else None)} | "
      f"{_f(run.get('steady_round_s'))} | {_f(run.get('round1_overhead_s'))} | "
      f"{_f(run.get('first_round_done_s'))} | {size} | "
      f"{run['load_before']:.1f}-{run['load_after']:.1f} |"
    )
  return lines


PHASES_HEADER = (
  "| tree | config | kernels | trace s | lower s | XLA compile s | HLO passes s | "
  "kernel emission s | LLVM s (tasks, task-seconds) | other s | trace + lower + HLO passes s | "
  "per kernel ms | load |",
  "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
)


def phase_rows(r: dict) -> list[str]:
  """The phases table's row of one measured config (``--phases``).

  A cold build without the cache, profiled: the seconds of tracing and lowering the round
  (JAX), then of XLA's compile by phase (:func:`compile_phases`). ``trace + lower + HLO
  passes`` is what the build costs before a single kernel is generated; ``per kernel`` is the
  emission and LLVM seconds divided by the program's distinct kernels (``kernels``, as in the
  main table).
  """
  run = r.get("phases")
  if run is None:
    return []
  name = r["config"] + (" (stand-in data)" if r["stand_in"] else "")
  if "error" in run:
    return [f"| {r['tree']} | {name} | error: see below |"]
  ph = run["phases"]
  trace, lower = _stage(run, "trace"), _stage(run, "lower")
  fixed = None
  if None not in (trace, lower, ph["hlo_passes_s"]):
    fixed = trace + lower + ph["hlo_passes_s"]  # type: ignore[operator]
  per_kernel = None
  kernels = run["kernels"]["distinct"]
  if kernels and None not in (ph["emission_s"], ph["llvm_s"]):
    per_kernel = 1e3 * (ph["emission_s"] + ph["llvm_s"]) / kernels
  return [
    f"| {r['tree']} | {name} | {kernels:,} | {_f(trace, '{:.2f}')} | "
    f"{_f(lower, '{:.2f}')} | {_f(ph['total_s'], '{:.2f}')} | {_f(ph['hlo_passes_s'], '{:.2f}')} | "
    f"{_f(ph['emission_s'], '{:.2f}')} | {_f(ph['llvm_s'], '{:.2f}')} ({ph['llvm_tasks']}, "
    f"{ph['llvm_task_s']:.1f}) | {_f(ph['other_s'], '{:.2f}')} | {_f(fixed, '{:.2f}')} | "
    f"{_f(per_kernel, '{:.1f}')} | {run['load_before']:.1f}-{run['load_after']:.1f} |"
  ]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.compile_times",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names")
  parser.add_argument("--small", action="store_true", help=f"only {', '.join(SMALL_CONFIGS)}")
  parser.add_argument("--ref", action="append", default=[], help="a git commit to measure too")
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="override a config field (as --config.FIELD=VALUE) in every measured config",
  )
  parser.add_argument("--later-rounds", type=int, default=None)
  parser.add_argument("--large-rounds", type=int, default=0)
  parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
  parser.add_argument(
    "--phases",
    action="store_true",
    help="also build each round once more without the cache, under JAX's profiler, and print "
    "where XLA's compile goes (HLO passes, kernel emission, LLVM)",
  )
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child is not None:
    print(RESULT_PREFIX + json.dumps(_child(json.loads(args.child))), flush=True)
    return 0
  names = list(SMALL_CONFIGS) if args.small else [n for n in args.configs.split(",") if n]
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    parser.error(f"--configs {','.join(unknown)} is invalid; allowed: names of {list(CONFIGS)}")
  if args.later_rounds is None:
    args.later_rounds = SMALL_LATER_ROUNDS if args.small else LATER_ROUNDS
  if args.later_rounds < 1 or args.large_rounds < 0:
    parser.error("--later-rounds must be >= 1 and --large-rounds >= 0")
  print(
    f"python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  # SIGTERM ends the run as Ctrl-C does: the child in progress is killed, the ref worktrees
  # and the scratch directory are removed.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  work = Path(tempfile.mkdtemp(prefix="compile-times-"))
  results = []
  try:
    trees = [("this tree", ROOT, None)]
    with contextlib.ExitStack() as stack:
      for ref in args.ref:
        trees.append((ref, stack.enter_context(ref_tree(ref, work)), ref))
      for name in names:
        for label, tree, _ in trees:
          r = measure(tree, name, args, work)
          r["tree"] = label
          results.append(r)
          print("\n".join([*rows(r), *phase_rows(r)]), flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print()
  print("\n".join(table(results)))
  if args.phases:
    print()
    print("\n".join([*PHASES_HEADER, *(row for r in results for row in phase_rows(r))]))
  for r in results:
    for state in ("cold", "warm", "phases"):
      if "error" in r.get(state, {}):
        print(f"\n{r['tree']} {r['config']} {state}: {r[state]['error']}")
  if any(r["stand_in"] for r in results):
    print(
      "\nstand-in data: cifar10 / mnist are synthetic (uniform uint8 images, the real shapes and "
      "records per class); compile times depend on shapes, not values"
    )
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
