"""Compile once per machine: experiments.run keeps its compiled programs in a persistent cache.

A second run of a config in a fresh process reads every program back and compiles none, and
reads the round's exported program back instead of tracing it, with the same numbers bit for
bit; the entries of a DP run (compiled and exported) hold neither its data nor its keys; an
exported entry is keyed by what decides its program, and a damaged or foreign one is traced
again; the cache's place follows the config field, the environment and JAX's own setting, in
that order, and a directory that others may write to is refused.
"""

from __future__ import annotations

import functools
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

from experiments import run

from fedlap_runs import compilation_cache, export_cache
from fedlap_runs import flags as run_flags
from fedlap_jax.checks import ConfigError
from conftest import raises_field

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
built, hit, traced = [], [False], []
def on_event(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits":
    hit[0] = True
def on_duration(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    built.append([kwargs.get("fun_name"), hit[0]])
    hit[0] = False
  if event == "/jax/core/compile/jaxpr_trace_duration":
    traced.append(kwargs.get("fun_name"))
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
from experiments import run
from fedlap_jax import setup_jit
status = run.main(["experiments.run", *sys.argv[1:]])
assert setup_jit.compiler_options() == setup_jit.SETUP_OPTIONS, "XLA_FLAGS name a level"
print("BUILT " + json.dumps(built))
print("TRACED " + json.dumps(traced))
sys.exit(status)
"""


def counting_run(workdir: Path, cache: Path, *flags: str) -> tuple[list, list, list]:
  """``(programs built: [name, read from the cache], functions traced, metrics records)`` of
  one run, compiled with XLA's own settings, as a user's run is: not the tests' XLA_FLAGS, under
  which the set-up programs would compile as the round does (``fedlap_jax.setup_jit``)."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "XLA_FLAGS"))
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
  lines = proc.stdout.splitlines()
  built = next(x for x in lines if x.startswith("BUILT "))[len("BUILT ") :]
  traced = next(x for x in lines if x.startswith("TRACED "))[len("TRACED ") :]
  records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return json.loads(built), json.loads(traced), records


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
  first, traced_1, records_1 = counting_run(tmp_path / "first", cache, *flags)
  second, traced_2, records_2 = counting_run(tmp_path / "second", cache, *flags)

  assert len(first) > 10 and not any(h for _, h in first)  # a cold cache: XLA built them all
  names = [name for name, _ in first]
  assert "jit(method_round)" in names  # the generic round (rounds.py)
  # The set-up's programs, compiled at their own level (setup_jit), are searched below too.
  assert {"jit(_init_params)", "jit(_first_images)"} <= set(names), names
  assert stat.S_IMODE(cache.stat().st_mode) == 0o700
  compiled_again = [name for name, h in second if not h]
  assert compiled_again == []  # every program, the round's included, was read back
  assert len(second) == len(first)
  assert records_2 == records_1  # every field of every round, bit for bit
  # The round and the evaluation are traced once by the export (and once more, the call of its
  # export) in the first run; the second reads the exports back and traces only their calls.
  assert traced_1.count("method_round") == 2 and traced_2.count("method_round") == 1
  assert traced_1.count("evaluate_test_split") == 2 and traced_2.count("evaluate_test_split") == 1
  # The round's and the evaluation's exported programs (and the hint naming the round's).
  exported = sorted((cache / export_cache.SUBDIR).glob("*" + export_cache.SUFFIX))
  assert len(exported) == 2
  (hint,) = (cache / export_cache.SUBDIR / export_cache.HINTS).glob("*.key")
  assert hint.read_text() in [p.stem for p in exported]

  # What the cache holds of the run: programs, not the records or the keys they ran on.
  blobs = entries(cache)
  assert len(blobs) == len(first)
  for p in exported:  # the exported programs: StableHLO and its constants
    blobs.append(p.read_bytes())
    assert len(blobs[-1]) < 1 << 20

  def held(pattern: bytes) -> int:
    return sum(pattern in b for b in blobs)

  key = jax.random.key(SEED)
  keys = [key, *jax.random.split(key), *jax.random.split(jax.random.split(key)[1])]
  for k in keys:
    assert held(np.asarray(jax.random.key_data(k)).astype("<u4").tobytes()) == 0
  cfg, _ = run_flags.load_config("quickstart:dp")
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

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
  with raises_field("compilation_cache_dir"):
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


# ----------------------------------------------------------------------------
# The export cache: the round's traced program kept beside JAX's cache.
# ----------------------------------------------------------------------------


def small_run(name: str = "quickstart:dp"):
  """``(algorithm, state, clients)`` of the small FedLAP(-DP) run of :data:`SMALL`."""
  from fedlap_runs import calibration  # pylint: disable=g-import-not-at-top
  from fedlap_runs.build import build_run  # pylint: disable=g-import-not-at-top

  cfg, _ = run_flags.load_config(name, [f[len("--config.") :] for f in SMALL])
  cfg.seed = SEED
  calibration.calibrate_noise(cfg)
  setup = build_run(cfg)
  return setup.algorithm, setup.state, setup.clients


def host(tree) -> list[np.ndarray]:
  """Every leaf of ``tree`` on the host (keys as their data), for bitwise comparison."""
  prng = jax.dtypes.prng_key
  return [
    np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, prng) else x)
    for x in jax.tree.leaves(tree)
  ]


@pytest.fixture(scope="module")
def small_round():
  """``(algorithm, state, clients, the round's leaves)`` of :func:`small_run`, run plainly."""
  alg, state, clients = small_run()
  return alg, state, clients, host(alg.round(state, clients))


def fresh(alg, cache: Path, notes: list):
  """``alg``'s round served from ``cache``, as a new process finds it (nothing loaded)."""
  export_cache._loaded.clear()  # pylint: disable=protected-access
  return export_cache.ExportedRound(alg.round, cache, notice=notes.append)


def test_the_exported_round_is_the_round_bit_for_bit_and_a_bad_entry_is_traced_again(
  tmp_path, small_round
):
  alg, state, clients, plain = small_round
  cache, notes = tmp_path / "exported", []

  cold = fresh(alg, cache, notes)
  assert all(np.array_equal(a, b) for a, b in zip(host(cold(state, clients)), plain, strict=True))
  (entry,) = cache.glob("*" + export_cache.SUFFIX)
  assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and not list(cache.glob(".tmp-*"))
  assert entry.stat().st_size < 1 << 20  # a program, a few hundred kB
  good = entry.read_bytes()

  def served(expect_note: str | None):
    notes.clear()
    out = host(fresh(alg, cache, notes)(state, clients))
    assert all(np.array_equal(a, b) for a, b in zip(out, plain, strict=True))
    if expect_note is None:
      assert notes == []
    else:
      (note,) = notes
      assert str(entry) in note and expect_note in note and "tracing it again" in note
      assert "\n" not in note
      assert entry.read_bytes() == good  # written again, whole

  served(None)  # read back: the same numbers (params, keys, metrics), nothing said
  header_end = good.index(b"\n", len(export_cache.MAGIC)) + 1
  damaged = bytearray(good)
  damaged[-100] ^= 0xFF
  other_key = good.replace(entry.stem.encode(), b"0" * 64, 1)
  # An entry cut short, or its header only, fails the digest check as one changed byte does:
  # refused. Served, one entry per reason: traced again, the same numbers.
  for bad in (good[: len(good) // 2], good[:header_end]):
    entry.write_bytes(bad)
    with pytest.raises(ValueError, match="damaged"):
      export_cache.read_entry(entry, entry.stem)
  for bad, why in (
    (bytes(damaged), "damaged"),  # one byte changed: its digest
    (other_key, "another program"),  # another key's entry under this name
    (b"not an entry", "not an exported round"),
  ):
    entry.write_bytes(bad)
    served(why)


def test_a_prefetched_round_is_the_round_bit_for_bit_and_a_wrong_hint_changes_nothing(
  tmp_path, small_round
):
  alg, state, clients, plain = small_round
  cache, notes = tmp_path / "exported", []
  hint = export_cache.hint_of("a run", {"rounds": 1})

  def served(**kwargs):
    export_cache._loaded.clear()  # pylint: disable=protected-access
    rnd = export_cache.ExportedRound(alg.round, cache, notes.append, **kwargs)
    out = host(rnd(state, clients))
    assert all(np.array_equal(a, b) for a, b in zip(out, plain, strict=True))
    return rnd

  assert not export_cache.prefetch(hint, cache)  # nothing kept under it yet
  served(hint=hint)  # exported, and its key kept under the hint
  (entry,) = cache.glob("*" + export_cache.SUFFIX)
  assert (cache / export_cache.HINTS / f"{hint}.key").read_text() == entry.stem

  export_cache._loaded.clear()  # pylint: disable=protected-access
  assert export_cache.prefetch(hint, cache)  # loading, on its own thread
  assert not export_cache.prefetch(hint, cache)  # once
  # (Looked up by its key: another test of this process may have left a load of its own.)
  future = export_cache._prefetching[entry.stem]  # pylint: disable=protected-access
  exported, fn, _ = future.result(timeout=300)
  rnd = export_cache.ExportedRound(alg.round, cache, notes.append, hint=hint)
  assert rnd.program(state, clients) is fn  # the round runs the prefetched program
  assert entry.stem not in export_cache._prefetching  # pylint: disable=protected-access
  assert all(np.array_equal(a, b) for a, b in zip(host(rnd(state, clients)), plain, strict=True))
  assert exported.fun_name == "method_round" and notes == []

  # A hint naming another entry, or a damaged one: no load, or one the round leaves unused.
  other = export_cache.hint_of("another run")
  (cache / export_cache.HINTS / f"{other}.key").write_text("0" * 64)
  (cache / export_cache.HINTS / "junk.key").write_text("../../x")
  export_cache._loaded.clear()  # pylint: disable=protected-access
  assert not export_cache.prefetch(other, cache) and not export_cache.prefetch("junk", cache)
  entry.write_bytes(entry.read_bytes()[:-10])  # damaged after the hint was written
  assert export_cache.prefetch(hint, cache)
  served(hint=hint)  # read by the round itself, noticed, and traced again
  assert any("cannot be used" in n for n in notes)
  assert entry.stem not in export_cache._prefetching  # pylint: disable=protected-access

  # A hint naming an entry this run's round is not: the load it started is dropped, not kept.
  stale = "f" * 64
  (cache / f"{stale}{export_cache.SUFFIX}").write_bytes(b"not read by this round")
  (cache / export_cache.HINTS / f"{hint}.key").write_text(stale)
  export_cache._loaded.clear()  # pylint: disable=protected-access
  assert export_cache.prefetch(hint, cache)
  assert stale in export_cache._prefetching  # pylint: disable=protected-access
  served(hint=hint)
  assert stale not in export_cache._prefetching  # pylint: disable=protected-access
  assert (cache / export_cache.HINTS / f"{hint}.key").read_text() == entry.stem


def test_the_key_changes_with_what_decides_the_program(monkeypatch):
  fp = export_cache.fingerprint

  def closing_over(value):
    return lambda x: x * value

  assert fp(closing_over(2.0)) == fp(closing_over(2.0))
  assert fp(closing_over(2.0)) != fp(closing_over(3.0))  # a closed-over value
  assert fp(lambda x: x + 1) != fp(lambda x: x + 2)  # the code
  assert fp({"a": np.zeros(3, np.float32)}) != fp({"a": np.ones(3, np.float32)})
  alg, state, clients = small_run()
  keywords = alg.round.keywords
  assert fp(keywords) == fp(small_run()[0].round.keywords)  # the same config: one key
  cfg = keywords["config"]
  changed = type(cfg)(**{**cfg.__dict__, "learning_rate": cfg.learning_rate * 2})
  assert fp({**keywords, "config": changed}) != fp(keywords)
  with pytest.raises(export_cache.Unkeyable):
    fp(object())

  args = (state, clients)
  key = functools.partial(export_cache.entry_key, "m:f", fp(keywords))
  base = key(args, "source")
  assert key(args, "source") == base
  assert key(args, "edited source") != base
  assert key((state, clients._replace(mask=clients.mask[:, :-1])), "source") != base
  monkeypatch.setenv(
    "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true"
  )
  assert key(args, "source") != base
  monkeypatch.undo()
  promotion = jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_rank_promotion", "warn" if promotion != "warn" else "allow")
  try:
    assert key(args, "source") != base
  finally:
    jax.config.update("jax_numpy_rank_promotion", promotion)
  assert key(args, "source") == base
  assert export_cache.source_digest() == export_cache.SOURCE_AT_IMPORT


def test_the_export_cache_is_on_exactly_when_jax_s_cache_is(tmp_path):
  alg, _, _ = small_run()
  given = jax.config.jax_compilation_cache_dir
  assert export_cache.directory() == Path(given) / export_cache.SUBDIR
  assert isinstance(export_cache.wrap(alg).round, export_cache.ExportedRound)
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    assert export_cache.directory() is None
    assert export_cache.wrap(alg) is alg
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
  notes = []
  unkeyable = alg._replace(
    round=functools.partial(alg.round.func, **{**alg.round.keywords, "mesh": object()})
  )
  assert export_cache.wrap(unkeyable, tmp_path, notice=notes.append) is unkeyable
  assert len(notes) == 1 and "cannot be keyed" in notes[0]


# ----------------------------------------------------------------------------
# The Flower app: a node's fresh process reads its steps back as experiments.run does.
# ----------------------------------------------------------------------------

# A Flower run in a child process (the ServerApp against the ClientApp, in process), with the
# programs kept where this machine's environment says: what it exports (traces and lowers for
# the export cache), what XLA builds, and every reply's arrays.
COUNTING_FLOWER_RUN = """
import hashlib, json, sys
sys.path.insert(0, "tests")
import jax
from fedlap_runs import compilation_cache
compilation_cache.enable()
built, hit, exported = [], [False], []
def on_event(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits":
    hit[0] = True
def on_duration(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    built.append([kwargs.get("fun_name"), hit[0]])
    hit[0] = False
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
export = jax.export.export
def counted(fn, **kwargs):
  exported.append(getattr(fn, "__name__", repr(fn)))
  return export(fn, **kwargs)
jax.export.export = counted
from flower_harness import run_inprocess
run_config = {"config": sys.argv[1], "overrides": sys.argv[2], "run-dir": sys.argv[3] + "/run"}
records, grid = run_inprocess(run_config, state_root=sys.argv[3] + "/state")
replies = []
for reply in grid.replies:
  h = hashlib.sha256()
  for name, record in sorted(reply.content.array_records.items()):
    for key, array in sorted(record.items()):
      h.update(name.encode() + key.encode() + array.numpy().tobytes())
  replies.append(h.hexdigest())
print("OUT " + json.dumps({"built": built, "exported": exported, "replies": replies,
  "records": [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")}
              for r in records]}))
"""


def counting_flower_run(workdir: Path, cache: Path, config: str, overrides: str) -> dict:
  """What :data:`COUNTING_FLOWER_RUN` reports of one Flower run in a fresh process."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
  }
  env.update({compilation_cache.ENV: str(cache), compilation_cache.MIN_COMPILE_ENV: "0"})
  proc = subprocess.run(
    [sys.executable, "-c", COUNTING_FLOWER_RUN, config, overrides, str(workdir)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = next(x for x in proc.stdout.splitlines() if x.startswith("OUT "))
  return json.loads(out[len("OUT ") :])


@pytest.mark.slow
def test_a_flower_nodes_second_process_reads_its_steps_back_with_the_same_replies(tmp_path):
  """FedLAP's nodes, on a small model. Their client and server run the method's steps: the
  three programs every method's node exports and reads back (FedAvg's too)."""
  overrides = (
    "rounds=1 model.width=8 model.depth=1 client.ipc=2 client.batch_loop=1 "
    "client.boost_loop=1 client.max_outer=1 client.calibration_epochs=2 "
    "client.dsa_strategy='' server.dsa_strategy='' server.max_epochs=2 eval_chunk_size=128"
  )
  steps = ["method_client_step", "method_server_step", "evaluate_test_split"]
  cache = tmp_path / "cache"
  first = counting_flower_run(tmp_path / "first", cache, "quickstart:nondp", overrides)
  second = counting_flower_run(tmp_path / "second", cache, "quickstart:nondp", overrides)

  assert sorted(set(first["exported"])) == sorted(steps)  # traced and lowered once, then kept
  assert second["exported"] == []  # read back: neither traced nor lowered again
  assert len(list((cache / export_cache.SUBDIR).glob("*" + export_cache.SUFFIX))) >= len(steps)
  assert [name for name, h in second["built"] if not h] == []  # every program from JAX's cache
  assert second["replies"] == first["replies"] and len(first["replies"]) == 5  # bit for bit
  assert second["records"] == first["records"]
