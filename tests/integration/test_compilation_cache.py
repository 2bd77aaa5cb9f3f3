"""Compile once per machine: experiments.run keeps its compiled programs in a persistent cache.

A second run of a config in a fresh process reads every program back and compiles none; the
entries of a DP run hold neither its data nor its keys; the cache's place follows the config
field, the environment and JAX's own setting, in that order, and a directory that others may
write to is refused.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from experiments import compilation_cache, run
from experiments import flags as run_flags
from fedlap_jax.checks import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SEED = 1234567  # a DP run's seed is secret: its keys must not reach a cached program
# A smaller FedLAP-DP round than the quickstart's (the same paths: DP-SGD client, synthetic sets,
# server training), so that its two runs take seconds.
SMALL = (
  "--config.model.width=8",
  "--config.model.depth=1",
  "--config.client.ipc=2",
  "--config.server.max_epochs=1",
  "--config.client.dsa_strategy=",
  "--config.server.dsa_strategy=",
)

# experiments.run in a child process, counting each program it builds: compiled by XLA, or read
# from the persistent cache (JAX reports a hit inside the compile it replaces).
COUNTING_RUN = """
import json, sys
import jax
built, hit = [], [False]
def on_event(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits":
    hit[0] = True
def on_duration(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    built.append([kwargs.get("fun_name"), hit[0]])
    hit[0] = False
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
from experiments import run
status = run.main(["experiments.run", *sys.argv[1:]])
print("BUILT " + json.dumps(built))
sys.exit(status)
"""


def counting_run(workdir: Path, cache: Path, *flags: str) -> tuple[list, dict]:
  """``(programs built: [name, read from the cache], last metrics record)`` of one run."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
  }
  # Every program is kept (JAX's threshold 0), so that "nothing compiles" covers them all.
  env.update({compilation_cache.ENV: str(cache), compilation_cache.MIN_COMPILE_ENV: "0"})
  proc = subprocess.run(
    [sys.executable, "-c", COUNTING_RUN, *flags, f"--workdir={workdir}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("BUILT "))
  records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return json.loads(line[len("BUILT ") :]), records[-1]


def entries(cache: Path) -> list[bytes]:
  """The cache's executables, decompressed as JAX reads them."""
  from jax._src import compilation_cache as jax_internal  # the format's one reader

  return [jax_internal.decompress_executable(p.read_bytes()) for p in cache.glob("*-cache")]


@pytest.mark.slow
def test_a_second_run_compiles_nothing_and_the_cached_programs_hold_no_data_or_keys(tmp_path):
  cache = tmp_path / "cache"
  flags = (
    "--config=quickstart:dp",
    "--config.rounds=1",
    f"--config.seed={SEED}",
    "--config.progress_bar=false",
    "--config.plots=false",
    *SMALL,
  )
  first, record_1 = counting_run(tmp_path / "first", cache, *flags)
  second, record_2 = counting_run(tmp_path / "second", cache, *flags)

  assert len(first) > 10 and not any(h for _, h in first)  # a cold cache: XLA built them all
  assert "jit(method_round)" in [name for name, _ in first]  # the generic round (rounds.py)
  assert stat.S_IMODE(cache.stat().st_mode) == 0o700
  compiled_again = [name for name, h in second if not h]
  assert compiled_again == []  # every program, the round's included, was read back
  assert len(second) == len(first)
  for field in ("test_accuracy", "test_loss", "epsilon"):
    assert record_2[field] == record_1[field]

  # What the cache holds of the run: programs, not the records or the keys they ran on.
  blobs = entries(cache)
  assert len(blobs) == len(first)

  def held(pattern: bytes) -> int:
    return sum(pattern in b for b in blobs)

  key = jax.random.key(SEED)
  keys = [key, *jax.random.split(key), *jax.random.split(jax.random.split(key)[1])]
  for k in keys:
    assert held(np.asarray(jax.random.key_data(k)).astype("<u4").tobytes()) == 0
  cfg, _ = run_flags.load_config("quickstart:dp")
  from experiments import data as data_lib  # pylint: disable=g-import-not-at-top

  dataset = data_lib.load_dataset(cfg.data)
  scale, offset = float(dataset.pixel_scale.ravel()[0]), float(dataset.pixel_offset.ravel()[0])
  windows = 0
  for image in dataset.x_train[::50].reshape(-1, 64).astype(np.float32):
    start = int(np.flatnonzero(image)[0])
    stored = image[start : start + 6]
    windows += held(stored.tobytes()) + held((stored * scale + offset).astype("<f4").tobytes())
  assert windows == 0
  # The search finds what a program does close over: the public normalisation constants.
  assert held(np.float32(scale).tobytes()) > 0


def test_the_cache_dir_follows_the_field_then_the_environment_then_jax(monkeypatch, tmp_path):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  given = jax.config.jax_compilation_cache_dir  # the test session's cache (tests/conftest.py)
  assert given and compilation_cache.resolve("") == Path(given).resolve()
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "env"))
  assert compilation_cache.resolve("") == tmp_path / "env"
  assert compilation_cache.resolve(str(tmp_path / "field")) == tmp_path / "field"
  assert compilation_cache.resolve("none") is None
  monkeypatch.setenv(compilation_cache.ENV, "none")
  assert compilation_cache.resolve("") is None
  assert compilation_cache.resolve(str(tmp_path / "field")) == tmp_path / "field"
  monkeypatch.delenv(compilation_cache.ENV)
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "fedlap_jax" / "jax_compilation_cache"
    assert compilation_cache.resolve("") == expected
  finally:
    jax.config.update("jax_compilation_cache_dir", given)
  with pytest.raises(ConfigError) as e:
    compilation_cache.resolve(3)
  assert e.value.field == "compilation_cache_dir"


def test_a_cache_dir_others_may_write_to_is_refused(monkeypatch, tmp_path, capsys):
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o775)
  with pytest.raises(ConfigError) as e:
    compilation_cache.prepare(str(shared))
  assert e.value.field == "compilation_cache_dir"
  assert "group or others may write to it" in str(e.value)
  assert "run their code" in str(e.value)
  monkeypatch.setenv(compilation_cache.ENV, str(shared))
  with pytest.raises(ConfigError) as e:
    compilation_cache.prepare("")
  assert e.value.field == compilation_cache.ENV
  monkeypatch.delenv(compilation_cache.ENV)
  a_file = tmp_path / "file"
  a_file.write_text("")
  with pytest.raises(ConfigError, match="cannot be created there"):
    compilation_cache.prepare(str(a_file / "cache"))
  made = compilation_cache.prepare(str(tmp_path / "new" / "cache"))
  assert made == tmp_path / "new" / "cache" and stat.S_IMODE(made.stat().st_mode) == 0o700

  # The command line refuses it before any run starts, in one line, with exit status 2.
  workdir = tmp_path / "run"
  status = run.main(
    [
      "prog",
      "--config=quickstart:dp",
      f"--workdir={workdir}",
      f"--config.compilation_cache_dir={shared}",
    ]
  )
  err = capsys.readouterr().err
  assert status == 2 and not workdir.exists()
  assert err.startswith("error: quickstart_dp: compilation_cache_dir=") and err.count("\n") == 1


def test_enable_switches_this_process_to_the_cache_with_the_run_settings(monkeypatch, tmp_path):
  saved = {
    name: getattr(jax.config, name)
    for name in (
      "jax_enable_compilation_cache",
      "jax_compilation_cache_dir",
      "jax_persistent_cache_min_compile_time_secs",
      "jax_compilation_cache_max_size",
    )
  }
  monkeypatch.delenv(compilation_cache.MIN_COMPILE_ENV, raising=False)
  monkeypatch.delenv(compilation_cache.MAX_BYTES_ENV, raising=False)
  try:
    assert compilation_cache.enable(str(tmp_path / "c")) == tmp_path / "c"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert (
      jax.config.jax_persistent_cache_min_compile_time_secs == compilation_cache.MIN_COMPILE_SECS
    )
    assert jax.config.jax_compilation_cache_max_size == compilation_cache.MAX_BYTES
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.jit(lambda x: x * 3.0 + 1.0)(np.float32(SEED)).block_until_ready()
    assert len(list((tmp_path / "c").glob("*-cache"))) == 1  # written where enable said
    monkeypatch.setenv(compilation_cache.MIN_COMPILE_ENV, "0.5")  # JAX's own variable wins
    compilation_cache.enable(str(tmp_path / "d"))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert compilation_cache.enable("none") is None
    assert not jax.config.jax_enable_compilation_cache
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()
