"""The benchmark scripts whose numbers docs/benchmarks.md reports, run as a user runs them.

Every script runs in its own process (``python -m benchmarks.X``, from the
repository root), so the tests import nothing from ``benchmarks``: arguments
are refused with the documented status and message, and the report modes turn
given measurements into the documented lines.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


def run_script(*argv: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
  """``python -m <argv>`` (a ``benchmarks`` script, or pytest with a benchmark plugin) from the
  repository root, ``env`` added to the environment."""
  return subprocess.run(
    [sys.executable, "-m", *argv],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env={**os.environ, **env},
  )


def test_bench_refuses_bad_client_sizes_with_status_2():
  bad = run_script("benchmarks.bench", "--client-sizes", "1,x")
  assert bad.returncode == 2, bad.stderr[-2000:]
  assert "--client-sizes '1,x' is invalid" in bad.stderr
  assert "comma-separated integers >= 1" in bad.stderr
  small = run_script("benchmarks.bench", "--small")
  assert small.returncode == 2 and "--small is for --reference only" in small.stderr


def test_trace_summary_busy_time_and_totals(tmp_path):
  """Overlapping kernels count once towards busy time; totals and counts per event name."""
  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "name": "conv", "ts": 0, "dur": 10_000},
    {"ph": "X", "pid": 1, "name": "conv", "ts": 5_000, "dur": 10_000},  # overlaps the first
    {"ph": "X", "pid": 1, "name": "add", "ts": 30_000, "dur": 5_000},
    {"ph": "X", "pid": 2, "name": "launch", "ts": 0, "dur": 100_000},
  ]
  path = tmp_path / "op" / "host.trace.json.gz"
  path.parent.mkdir()
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  out = run_script("benchmarks.trace_summary", str(tmp_path))
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == "## op/host.trace.json.gz"
  gpu = lines.index("/device:GPU:0: busy 20.0 ms of 100.0 ms (20%)")  # [0, 15] + [30, 35]
  assert re.fullmatch(r"\s+20\.00 ms\s+2x\s+conv", lines[gpu + 1]), lines
  assert re.fullmatch(r"\s+5\.00 ms\s+1x\s+add", lines[gpu + 2]), lines
  assert "/host:CPU: busy 100.0 ms of 100.0 ms (100%)" in lines
  missing = run_script("benchmarks.trace_summary", str(tmp_path / "missing"))
  assert missing.returncode == 2 and "no *.trace.json.gz under" in missing.stderr


def test_gpu_script_variants_and_goals(tmp_path):
  bad = run_script("benchmarks.gpu_round", "--variants", "new,pmap")
  assert bad.returncode == 1 and "--variants item 'pmap' is invalid" in bad.stderr
  rows = [
    {"config": "cifar_dp", "variant": "new", "median_s": 2.5, "compile_s": 40.0},
    {"config": "cifar_dp", "variant": "old", "median_s": 7.5, "compile_s": 44.0},
  ]
  saved = tmp_path / "gpu_round.json"
  saved.write_text(json.dumps({"rows": rows}))
  out = run_script("benchmarks.gpu_round", "--from-json", str(saved))
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == (
    "cifar_dp [new]: 2.50 s/round (goal <= 3 s: met), compile 40.0 s (goal <= 30 s: NOT met)"
  )
  assert lines[1].startswith("cifar_dp [old]: 7.50 s/round (goal <= 3 s: NOT met)")
  assert lines[-1].startswith("cifar_dp: new / old = 2.50 / 7.50 s = 0.33")


def test_many_clients_defaults_to_the_built_subset_and_tabulates_a_log(tmp_path):
  """Without --data the benchmark reads where ``fedlap_runs.datasets`` writes mnist10k (the
  data cache under the home directory), and says how to build it when it is missing."""
  missing = run_script("benchmarks.many_clients", "--data", str(tmp_path / "missing.npz"))
  assert missing.returncode == 1
  assert "built by `python -m fedlap_runs.datasets mnist10k`" in missing.stderr
  assert f"--data={str(tmp_path / 'missing.npz')!r} is invalid" in missing.stderr
  default = run_script("benchmarks.many_clients", HOME=str(tmp_path))
  built = tmp_path / ".cache" / "fedlap_jax" / "mnist10k.npz"
  assert default.returncode == 1 and f"--data={str(built)!r} is invalid" in default.stderr
  row = dict(
    method="fedlap_dp",
    clients=500,
    per_round=5,
    n_min=3,
    n_max=48,
    first_round_s=1.0,
    round_s=0.5,
    accounting_s=0.1,
    peak_rss_mb=900.0,
    host_data_mb=18.8,
    block_mb=0.19,
    load=[3.0, 3.1],
  )
  log = tmp_path / "run.log"
  log.write_text("a progress line\n" + json.dumps(row) + "\n")
  png = tmp_path / "many_clients.png"
  out = run_script("benchmarks.many_clients", "--from-log", str(log), "--png", str(png))
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [line for line in out.stdout.splitlines() if line.startswith("|")]
  assert len(lines) == 3 and lines[2].startswith("| fedlap_dp | 500 | 5 | 3..48 | 1.0 | 0.5 | 0.1")
  assert lines[0].count("|") == lines[2].count("|")
  assert png.stat().st_size > 1000


def test_device_check_script_is_valid_and_uses_existing_flags():
  """benchmarks/device_check.sh parses, and every --flag it passes exists in the script it calls."""
  script = ROOT / "benchmarks" / "device_check.sh"
  subprocess.run(["bash", "-n", str(script)], check=True)
  # Join continuation lines, then check each command's flags against its target's source.
  text = script.read_text().replace("\\\n", " ")
  targets = {
    "benchmarks/gpu_round.py": ROOT / "benchmarks" / "gpu_round.py",
    "-m benchmarks.bench": ROOT / "benchmarks" / "bench.py",
    "-m benchmarks.trace_summary": ROOT / "benchmarks" / "trace_summary.py",
  }
  checked = 0
  for line in text.splitlines():
    for call, source in targets.items():
      if call in line and not line.lstrip().startswith("#"):
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line.split(call, 1)[1]))
        for flag in flags:
          assert f'"{flag}"' in source.read_text(), f"{call} has no option {flag}"
          checked += 1
  assert checked >= 8


def test_compile_census_counts_each_tests_jax_work_across_xdist_workers(tmp_path):
  """``-p benchmarks.compile_census``: one jitted call is one trace, lowering and compile of the
  test that made it; a test without JAX has none; the workers' counts add up on the controller."""
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "test_two.py").write_text(
    "import jax, numpy as np\n"
    "def test_jitted():\n"
    "  assert np.asarray(jax.jit(lambda x: x * 2.0)(np.float32(1.5))) == 3.0\n"
    "def test_python_only():\n"
    "  assert 1 + 1 == 2\n"
  )
  out_json = tmp_path / "census.json"
  out = run_script(  # no persistent compilation cache: it would be this session's
    "pytest",
    "-q",
    "-n",
    "2",
    "-p",
    "benchmarks.compile_census",
    "--census-json",
    str(out_json),
    "-c",
    str(tmp_path / "pytest.ini"),
    "--rootdir",
    str(tmp_path),
    str(tmp_path / "test_two.py"),
    JAX_COMPILATION_CACHE_DIR="",
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "compile census" in out.stdout
  row = next(line for line in out.stdout.splitlines() if line.startswith("test_two.py"))
  assert row.split()[1:2] == ["2"], row  # two tests
  census = json.loads(out_json.read_text())
  jitted, plain = (
    census["tests"]["test_two.py::test_jitted"],
    census["tests"]["test_two.py::test_python_only"],
  )
  assert (jitted["trace_n"], jitted["lower_n"], jitted["compile_n"]) == (1, 1, 1), jitted
  assert jitted["compile_s"] > 0 and jitted["test_s"] >= jitted["compile_s"]
  assert jitted["cpu_s"] > 0 and plain["cpu_s"] >= 0
  assert (plain["trace_n"], plain["lower_n"], plain["compile_n"]) == (0, 0, 0), plain
  total = census["files"]["total"]
  assert total["tests"] == 2
  assert total["compile_n"] == sum(t["compile_n"] for t in census["tests"].values())
  # By name: the lambda is the one program the tests compiled (JAX's setup outside the
  # tests may compile others), and every compile is counted under some name.
  programs = census["programs"]
  assert programs["jit(<lambda>)"]["n"] == 1, programs
  assert programs["jit(<lambda>)"]["s"] == pytest.approx(jitted["compile_s"])
  assert sum(p["n"] for p in programs.values()) == total["compile_n"]
  assert any(line.startswith("jit(<lambda>) ") for line in out.stdout.splitlines()), out.stdout


# A smaller FedLAP-DP round than the quickstart's (the same paths), so that four processes
# build and run it in about a minute.
SMALL_DP = ("model.width=8", "model.depth=1", "client.ipc=2", "server.max_epochs=1")


ONLY_FROM_TREE = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("compile_times", sys.argv[1])
compile_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compile_times)
compile_times._only_from(Path(sys.argv[2]))
import experiments
try:
  import fedlap_runs.export_cache
  print("imported", fedlap_runs.export_cache.__file__)
except ImportError:
  print("missing")
print("foreign", compile_times._foreign_modules(Path(sys.argv[2])))
"""


def test_compile_times_children_import_the_project_from_their_tree_alone(tmp_path):
  """A ref tree that lacks a module (``fedlap_runs.export_cache`` before it was written) does
  not get it from the tree the project is installed from (an editable install's finder)."""
  (tmp_path / "experiments").mkdir()
  (tmp_path / "experiments" / "__init__.py").write_text("")
  out = subprocess.run(
    [
      sys.executable,
      "-P",
      "-c",
      ONLY_FROM_TREE,
      str(ROOT / "benchmarks" / "compile_times.py"),
      str(tmp_path),
    ],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": str(tmp_path)},
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == ["missing", "foreign []"]


@pytest.mark.slow
def test_compile_times_measures_cold_warm_and_the_compile_phases(tmp_path):
  """``benchmarks.compile_times --phases`` on the smallest round: the round program is built
  cold (XLA compiles it) and warm (read back from the cache the cold process wrote), in fresh
  processes; with ``--phases`` a third process compiles it under the profiler and splits XLA's
  compile into its phases. (A ``--ref`` tree runs the same measuring code; that its processes
  import from their tree alone is the test above.)"""
  out_json = tmp_path / "times.json"
  sets = [a for s in SMALL_DP for a in ("--set", s)]
  out = run_script(
    "benchmarks.compile_times",
    "--configs",
    "quickstart:dp",
    *sets,
    "--later-rounds",
    "1",
    "--phases",
    "--json",
    str(out_json),
    timeout=900,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = json.loads(out_json.read_text())
  assert [r["tree"] for r in results] == ["this tree"]
  assert pathlib.Path(results[0]["cold"]["fedlap_jax"]) == ROOT
  for r in results:
    cold, warm = r["cold"], r["warm"]
    assert (cold["events"]["round"]["compile_n"], cold["events"]["round"]["cache_hits"]) == (1, 0)
    # Warm, the round's program is read back in round 1, or before it on the background
    # thread of a tree that prefetches it (fedlap_runs.export_cache.prefetch).
    built = [warm["events"].get(phase, {}) for phase in ("round", "background")]
    assert sum(b.get("compile_n", 0) for b in built) == 1
    assert sum(b.get("cache_hits", 0) for b in built) == 1
    assert sum(b.get("compile_s", 0) for b in built) < cold["events"]["round"]["compile_s"]
    assert cold["first_round_done_s"] > cold["rounds_s"][0]
    assert r["cache_entries"] >= 1 and r["cache_bytes"] > 0
    assert cold["hlo_input"]["instructions"] > 1000 and cold["hlo_optimised"]["fusions"] > 0
    kernels = cold["kernels"]  # distinct fused kernels, each attributed once
    assert 0 < kernels["distinct"] <= cold["hlo_optimised"]["fusions"]
    assert kernels["distinct"] == kernels["prng"] + kernels["model"] + kernels["other"]
    assert kernels["prng"] > 0 and kernels["model"] > 0  # DP noise and DSA draws; the ConvNet
    shapes = cold["kernel_shapes"]  # the same kernels, by origin and result shape
    assert {o: sum(n.values()) for o, n in shapes.items()} == {
      o: kernels[o] for o in ("prng", "model", "other") if kernels[o]
    }
    assert warm["hlo_input"] == cold["hlo_input"]  # one program, built twice
    assert len(cold["rounds_s"]) == 2 and "round1_overhead_s" in cold
    profiled = r["phases"]  # compiled once more, without the cache: XLA compiled it
    built = profiled["events"]["round"]
    assert (built["compile_n"], built["cache_hits"]) == (1, 0)
    ph = profiled["phases"]
    parts = [ph["hlo_passes_s"], ph["emission_s"], ph["llvm_s"]]
    assert all(p > 0 for p in parts) and sum(parts) <= ph["total_s"]
    assert ph["other_s"] == pytest.approx(ph["total_s"] - sum(parts))
    # Kernels of XLA's fusion emitters, if it used them (the tests' XLA options choose its
    # older emitters, which trace none): fusions of the same program.
    assert 0 <= ph["emitted_kernels"] <= profiled["hlo_optimised"]["fusions"]
    assert profiled["kernels"] == cold["kernels"]
    assert ph["llvm_tasks"] > 0 and ph["llvm_task_s"] > 0
    assert ph["total_s"] <= built["compile_s"]
  assert results[0]["warm"]["prefetch"] is True  # this tree loads it while it sets up
  assert "| this tree | quickstart:dp | cold |" in out.stdout
  assert "| this tree | quickstart:dp | warm |" in out.stdout
  assert "| tree | config | kernels | trace s | lower s | XLA compile s |" in out.stdout
