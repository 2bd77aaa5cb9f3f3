"""Where a test run's time goes: JAX tracing, lowering and XLA compilation, per test file.

A pytest plugin, loaded by name from the repository root::

  python -m pytest -q -n 2 tests/unit -p benchmarks.compile_census [--census-json FILE]

It listens to JAX's public monitoring events (``jax.monitoring``): each time a
program is traced to a jaxpr, lowered to an MLIR module, or compiled by XLA,
JAX reports the seconds it took. Eager code counts as well: every ``jnp``
operation run outside ``jit`` on a new shape is a program of its own. The
summary at the end of the run lists, per test file, the tests' seconds (setup,
call and teardown, as ``--durations`` counts them), how many programs were
traced, lowered and compiled and the seconds each stage took, and how many
compiles were read back from the persistent compilation cache (their seconds
are the reads). A second table lists the programs by name (the jitted function's,
as JAX reports it with each compile: ``jit(local_approx)``, ``jit(<lambda>)``, one
name for every shape and setting it is compiled for), the costliest first: how
many were compiled and the seconds. Under ``pytest-xdist`` each worker counts its
own tests and the controller adds them up. ``--census-json FILE`` writes the same
figures per test, and the programs by name (``"programs"``).

``cpu s`` is the CPU time (every thread: XLA compiles on several) of the process that ran a
test, from the start of its setup to the end of its teardown. On a shared machine a test's wall
seconds grow with the load several times over; its CPU seconds grow too, but far less
(contended cores and caches), so compare runs by them, made at a similar load.

Seconds of JAX work are wall-clock seconds of the process that did it; the
rest of a test's seconds is running the programs and the tests' own Python
(accounting, NumPy, fixtures). The plugin changes no compiled program.
"""

from __future__ import annotations

import collections
import json
import pathlib
import time
from typing import Any

import jax
import pytest

from benchmarks.compile_times import CACHE_HIT_EVENT
from benchmarks.compile_times import STAGE_EVENTS as STAGES  # event -> the stage it times

OUTSIDE = "(outside tests)"  # collection, session start and end
_WORKER_KEY = "compile_census"

# "<stage>_n", "<stage>_s", "cache_hits", "cpu_s"; per file also "tests", "test_s"
Counts = dict[str, float]
COMPILE_EVENT = next(event for event, stage in STAGES.items() if stage == "compile")
PROGRAMS_SHOWN = 15  # rows of the programs-by-name table


def _empty() -> Counts:
  counts = {f"{stage}_{k}": 0.0 for stage in STAGES.values() for k in ("n", "s")}
  return {**counts, "cache_hits": 0.0, "cpu_s": 0.0}


class Census:
  """One process's counts.

  ``tests``: the JAX work done while each test ran (in this process); ``durations``: each
  test's seconds from its reports (on xdist's controller: every worker's tests);
  ``current``: the test being run; ``programs``: compiles (``n``, ``s``) by program name.
  """

  def __init__(self) -> None:
    self.tests: dict[str, Counts] = collections.defaultdict(_empty)
    self.durations: collections.Counter = collections.Counter()
    self.programs: dict[str, Counts] = collections.defaultdict(lambda: {"n": 0.0, "s": 0.0})
    self.current = OUTSIDE

  def on_duration(self, event: str, seconds: float, **kwargs: Any) -> None:
    stage = STAGES.get(event)
    if stage is not None:
      row = self.tests[self.current]
      row[f"{stage}_n"] += 1
      row[f"{stage}_s"] += seconds
    if event == COMPILE_EVENT:  # JAX names the program with each compile
      program = self.programs[str(kwargs.get("fun_name", "(unnamed)"))]
      program["n"] += 1
      program["s"] += seconds

  def on_event(self, event: str, **kwargs: Any) -> None:
    del kwargs
    if event == CACHE_HIT_EVENT:
      self.tests[self.current]["cache_hits"] += 1

  def merge(self, tests: dict[str, Counts], programs: dict[str, Counts]) -> None:
    for into, counts_by_name in ((self.tests, tests), (self.programs, programs)):
      for name, counts in counts_by_name.items():
        row = into[name]
        for key, value in counts.items():
          row[key] += value


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
    "--census-json",
    metavar="FILE",
    default=None,
    help="compile_census: also write the per-test figures to FILE as JSON",
  )


def pytest_configure(config: pytest.Config) -> None:
  census = Census()
  jax.monitoring.register_event_duration_secs_listener(census.on_duration)
  jax.monitoring.register_event_listener(census.on_event)
  config.pluginmanager.register(_Hooks(census, config), "compile_census_hooks")


class _Hooks:
  """The census's pytest hooks, bound to this process's :class:`Census`."""

  def __init__(self, census: Census, config: pytest.Config) -> None:
    self.census = census
    self.config = config

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item: pytest.Item):
    self.census.current = item.nodeid
    start = time.process_time()
    yield
    self.census.tests[item.nodeid]["cpu_s"] += time.process_time() - start
    self.census.current = OUTSIDE

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    """Setup, call and teardown seconds; xdist's controller gets every worker's reports."""
    self.census.durations[report.nodeid] += report.duration

  def pytest_sessionfinish(self, session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the JAX counts to the controller
      workeroutput[_WORKER_KEY] = json.dumps(
        {"tests": self.census.tests, "programs": self.census.programs}
      )

  @pytest.hookimpl(optionalhook=True)
  def pytest_testnodedown(self, node) -> None:
    """xdist's controller, when a worker ends: add the worker's JAX counts."""
    data = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if data:
      counts = json.loads(data)
      self.census.merge(counts["tests"], counts["programs"])

  def pytest_terminal_summary(self, terminalreporter) -> None:
    if getattr(self.config, "workeroutput", None) is not None:
      return
    tests = per_test(self.census)
    rows = summarise(tests)
    if "total" not in rows:
      return
    terminalreporter.section("compile census (seconds: wall clock of the process that did it)")
    for line in format_table(rows):
      terminalreporter.write_line(line)
    t = rows["total"]
    jax_s = t["trace_s"] + t["lower_s"] + t["compile_s"]
    terminalreporter.write_line(
      f"JAX work (trace + lower + compile): {jax_s:.1f} s of {t['test_s']:.1f} test seconds "
      f"({t['cpu_s']:.1f} CPU seconds); "
      f"{t['compile_n']:.0f} programs compiled, {t['compile_n'] - t['cache_hits']:.0f} of them "
      "by XLA (the rest read from the persistent compilation cache)"
    )
    for line in format_programs(self.census.programs):
      terminalreporter.write_line(line)
    path = self.config.getoption("--census-json")
    if path:
      figures = {"files": rows, "tests": tests, "programs": dict(self.census.programs)}
      pathlib.Path(path).write_text(json.dumps(figures, indent=1))
      terminalreporter.write_line(f"per-test figures: {path}")


def _file_of(nodeid: str) -> str:
  return nodeid.split("::")[0]


def per_test(census: Census) -> dict[str, Counts]:
  """Each test's JAX work with its seconds (``test_s``) and ``tests`` = 1 (0 outside tests)."""
  return {
    name: {
      **census.tests.get(name, _empty()),
      "test_s": census.durations.get(name, 0.0),
      "tests": float(name != OUTSIDE),
    }
    for name in set(census.tests) | set(census.durations)
  }


def summarise(tests: dict[str, Counts]) -> dict[str, Counts]:
  """Per-file totals of :func:`per_test`'s rows, and their ``"total"``."""
  rows: dict[str, Counts] = collections.defaultdict(lambda: collections.Counter(_empty()))
  for name, counts in tests.items():
    for key in (_file_of(name), "total"):
      rows[key].update(counts)
  return {key: dict(row) for key, row in rows.items()}


def format_table(rows: dict[str, Counts]) -> list[str]:
  """One line per test file, costliest first, then the total."""
  header = (
    f"{'test file':42s} {'tests':>5s} {'test s':>7s} {'traced':>7s} {'trace s':>8s} "
    f"{'lowered':>8s} {'lower s':>8s} {'compiled':>9s} {'compile s':>10s} {'cache hits':>10s} "
    f"{'cpu s':>7s}"
  )
  lines = [header]
  order = sorted((k for k in rows if k != "total"), key=lambda k: -rows[k]["test_s"])
  for key in [*order, "total"]:
    r = rows[key]
    lines.append(
      f"{key:42s} {r['tests']:5.0f} {r['test_s']:7.1f} {r['trace_n']:7.0f} {r['trace_s']:8.1f} "
      f"{r['lower_n']:8.0f} {r['lower_s']:8.1f} {r['compile_n']:9.0f} {r['compile_s']:10.1f} "
      f"{r['cache_hits']:10.0f} {r['cpu_s']:7.1f}"
    )
  return lines


def format_programs(programs: dict[str, Counts], shown: int = PROGRAMS_SHOWN) -> list[str]:
  """The ``shown`` programs by name with the most compile seconds, then the rest in one line."""
  if not programs:
    return []
  order = sorted(programs, key=lambda name: -programs[name]["s"])
  total_s = sum(p["s"] for p in programs.values()) or 1.0  # shares of 0 s are 0
  lines = [
    f"{'program (compiles of every shape and setting)':48s} {'compiled':>9s} "
    f"{'compile s':>10s} {'share':>6s}"
  ]
  for name in order[:shown]:
    p = programs[name]
    lines.append(f"{name:48s} {p['n']:9.0f} {p['s']:10.1f} {p['s'] / total_s:6.1%}")
  rest = order[shown:]
  if rest:
    n = sum(programs[name]["n"] for name in rest)
    s = sum(programs[name]["s"] for name in rest)
    lines.append(f"{f'{len(rest)} other names':48s} {n:9.0f} {s:10.1f} {s / total_s:6.1%}")
  return lines
