"""Kill test: real ``python -m experiments.run`` processes, killed and resumed.

A tiny FedLAP-DP run (digits, ConvNet-8x1, 6 rounds, a checkpoint every 2
rounds) is run once straight, and once as a chain of processes that are
interrupted at deterministic points by the fault-injection launcher
(``tests/fault_run.py POINT:ROUND[:SIGNAL]``):

1. SIGKILL during round 3 (computed, nothing of it written);
2. SIGKILL inside the checkpoint save of round 4 (orbax's temporary directory
   half written);
3. SIGKILL inside the atomic write of the privacy ledger after round 5;
4. SIGTERM during round 5: the round finishes, checkpoint 5 is saved, exit 143;
5. the last resume runs round 6.

The final metrics, privacy ledger, synthetic sets and checkpointed state must
equal the straight run's. The processes share a persistent XLA compilation
cache (only the first one compiles), so the whole test takes about a minute on
2 busy CPU cores.

A one-shot method (PSG: DP, the whole method is round 1) whose round outlasts
the SIGTERM grace period (the ``slow`` fault) must exit with 143 within the
grace period, its round abandoned but charged to the ledger, and a resume must
redo the round and end equal to an uninterrupted run. The same for a Flower
ClientApp process: SIGTERM in a long round ends it within seconds, its ledger
charged and intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from conftest import TINY_FEDLAP_FLAGS
from fault_run import command
from pathlib import Path

import numpy as np
import pytest

from fedlap_runs import checkpointing

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {
  **TINY_FEDLAP_FLAGS,
  "rounds": 6,
  "checkpoint_every": 2,
  "plots": False,
  "seed": 0,  # given: the interrupted run is compared with one in another work dir
}
TIMING = ("round_seconds", "wall_seconds", "first_in_process")


def _env(cache: Path) -> dict:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    FLWR_TELEMETRY_ENABLED="0",
  )
  return env


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
  """The compilation cache of every process this file starts: a program that several build (the
  Flower app's client step in both parts, the evaluation) is compiled once."""
  return tmp_path_factory.mktemp("xla_cache")


def launch(
  workdir: Path,
  cache: Path,
  fault: str | None = None,
  *,
  config="quickstart:dp_loops",
  flags=None,
  timeout: float = 300.0,
) -> subprocess.CompletedProcess:
  argv = [
    *command(fault),
    f"--config={config}",
    *(f"--config.{k}={v}" for k, v in (FLAGS if flags is None else flags).items()),
    f"--workdir={workdir}",
  ]
  return subprocess.run(
    argv, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=timeout
  )


def terminate_when(
  argv: list[str],
  env: dict,
  marker: str,
  timeout: float = 300.0,
  exit_timeout: float = 120.0,
  delay: float = 0.0,
):
  """Starts ``argv``, sends SIGTERM ``delay`` seconds after ``marker`` appears on its stderr
  (within ``timeout`` seconds); returns ``(returncode, stdout, stderr, seconds from SIGTERM to
  exit)``, the process killed after ``exit_timeout`` seconds."""
  proc = subprocess.Popen(
    argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  err, seen = [], threading.Event()

  def read():
    for line in proc.stderr:
      err.append(line)
      if marker in line:
        seen.set()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  out = []
  threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
  deadline = time.monotonic() + timeout
  while not seen.wait(1.0) and proc.poll() is None and time.monotonic() < deadline:
    pass
  if not seen.is_set() and proc.poll() is not None:
    reader.join(5)  # the exited process's last lines
  if not seen.is_set():
    proc.kill()
    proc.wait()
    raise AssertionError(
      f"no {marker!r} within {timeout} s (exit {proc.returncode}):\n" + "".join(err[-30:])
    )
  time.sleep(delay)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  try:
    rc = proc.wait(exit_timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    rc = proc.wait()
  seconds = time.monotonic() - t0
  reader.join(5)
  return rc, "".join(out), "".join(err), seconds


def rounds_in(workdir: Path) -> list[int]:
  return [r["round"] for r in checkpointing.read_metrics(workdir / "metrics.jsonl")]


def complete_checkpoints(workdir: Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def ledger_rounds(workdir: Path) -> int:
  return json.loads((workdir / "privacy_ledger.json").read_text())["rounds"]


def state_arrays(workdir: Path, round_index: int) -> dict:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(workdir / "checkpoints")
  restored = manager.restore(round_index, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return {k: np.asarray(v) for k, v in restored["state"].items()}


@pytest.mark.slow
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, cache):
  straight, chain = tmp_path / "straight", tmp_path / "chain"
  done = launch(straight, cache)
  assert done.returncode == 0, done.stderr[-2000:]

  # 1. SIGKILL in round 3: checkpoint 2 and records 1..2 survive.
  p = launch(chain, cache, "round:3")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert complete_checkpoints(chain) == [2] and rounds_in(chain) == [1, 2]
  assert ledger_rounds(chain) == 2

  # 2. SIGKILL inside the save of checkpoint 4: only orbax's temporary directory exists.
  p = launch(chain, cache, "checkpoint:4")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert "resuming from round 2" in p.stdout
  assert complete_checkpoints(chain) == [2] and rounds_in(chain) == [1, 2, 3, 4]
  assert [n.name for n in (chain / "checkpoints").iterdir() if not n.name.isdigit()]
  assert ledger_rounds(chain) == 4

  # 3. SIGKILL inside the ledger write of round 5: the old ledger file is intact.
  p = launch(chain, cache, "ledger:5")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert "resuming from round 2" in p.stdout
  assert complete_checkpoints(chain) == [2, 4] and rounds_in(chain) == [1, 2, 3, 4]
  assert ledger_rounds(chain) == 4
  assert list(chain.glob(".privacy_ledger.json.tmp*"))  # the write was cut short

  # 4. SIGTERM in round 5: the round finishes, checkpoint 5 is saved, exit 143.
  p = launch(chain, cache, "round:5:TERM")
  assert p.returncode == 143, p.stderr[-2000:]
  assert "resuming from round 4" in p.stdout
  assert "terminated by SIGTERM after round 5: checkpoint 5 saved" in p.stderr
  assert complete_checkpoints(chain) == [4, 5] and rounds_in(chain) == [1, 2, 3, 4, 5]
  assert ledger_rounds(chain) == 5

  # 5. The last resume finishes the run.
  p = launch(chain, cache)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "resuming from round 5" in p.stdout

  a = checkpointing.read_metrics(straight / "metrics.jsonl")
  b = checkpointing.read_metrics(chain / "metrics.jsonl")
  assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == [
    {k: v for k, v in r.items() if k not in TIMING} for r in b
  ]
  assert json.loads((straight / "privacy_ledger.json").read_text()) == json.loads(
    (chain / "privacy_ledger.json").read_text()
  )
  assert ledger_rounds(chain) == 6
  with (
    np.load(straight / "synthetic" / "round_0006.npz") as x,
    np.load(chain / "synthetic" / "round_0006.npz") as y,
  ):
    for k in x.files:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  want, got = state_arrays(straight, 6), state_arrays(chain, 6)
  assert want.keys() == got.keys() and len(want) > 5
  for k in want:  # parameters, synthetic sets, PRNG key, round counter
    np.testing.assert_array_equal(want[k], got[k], err_msg=k)


# PSG on the digits, shrunk: one round of T = 2 * 1 * 2 noisy accesses per client.
ONESHOT_CONFIG = """\
from fedlap_runs.configs import quickstart, quickstart_compare


def get_config():
  cfg = quickstart_compare.psg_config(quickstart.dp_config())
  cfg.dp.match_epsilon_of = ""
  return cfg
"""
ONESHOT_FLAGS = {
  "model.width": 8,
  "model.depth": 1,
  "client.ipc": 2,
  "condense.networks": 2,
  "condense.outer_loop": 1,
  "condense.inner_loop": 1,
  "condense.batch_loop": 2,
  "server.max_epochs": 2,
  "eval_chunk_size": 400,
  "plots": False,
  "progress_bar": False,
  "seed": 0,  # given: the interrupted run is compared with one in another work dir
}
GRACE_SECONDS = 2.0
# SIGTERM to exit: the grace period, then the ledger's charge (its composition takes seconds on a
# loaded 2-core machine), its write and os._exit (no checkpoint save).
EXIT_BUDGET_SECONDS = GRACE_SECONDS + 15.0


@pytest.mark.slow
def test_sigterm_abandons_a_long_oneshot_round_and_the_resume_redoes_it(tmp_path, cache):
  config = tmp_path / "oneshot_psg.py"
  config.write_text(ONESHOT_CONFIG)
  straight, chain = tmp_path / "straight", tmp_path / "chain"
  done = launch(straight, cache, config=str(config), flags=ONESHOT_FLAGS, timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  assert ledger_rounds(straight) == 1

  # SIGTERM while round 1 (the whole run) is still computing, past the grace period.
  flags = {**ONESHOT_FLAGS, "termination_grace_seconds": GRACE_SECONDS}
  argv = [
    *command("slow:1"),
    f"--config={config}",
    *(f"--config.{k}={v}" for k, v in flags.items()),
    f"--workdir={chain}",
  ]
  rc, out, err, seconds = terminate_when(argv, _env(cache), "fault: round 1 is slow", timeout=900)
  assert rc == 143, err[-2000:]
  assert GRACE_SECONDS <= seconds < EXIT_BUDGET_SECONDS, seconds
  assert (
    "terminated by SIGTERM (not done within termination_grace_seconds=2) during round 1: "
    "the round was abandoned; its noisy accesses are charged to privacy_ledger.json" in err
  )
  assert "no checkpoint was written yet" in err and "abandoned" in out  # train.log's line
  assert not complete_checkpoints(chain) and not rounds_in(chain)
  charged = json.loads((chain / "privacy_ledger.json").read_text())
  assert charged == json.loads((straight / "privacy_ledger.json").read_text())  # round 1
  assert not list(chain.glob(".privacy_ledger.json.tmp*"))

  # The resume redoes round 1 with the same keys: the same outputs, charged once.
  p = launch(chain, cache, config=str(config), flags=ONESHOT_FLAGS, timeout=900)
  assert p.returncode == 0, p.stderr[-2000:]
  a = checkpointing.read_metrics(straight / "metrics.jsonl")
  b = checkpointing.read_metrics(chain / "metrics.jsonl")
  assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == [
    {k: v for k, v in r.items() if k not in TIMING} for r in b
  ]
  assert json.loads((chain / "privacy_ledger.json").read_text()) == charged
  with (
    np.load(straight / "synthetic" / "round_0001.npz") as x,
    np.load(chain / "synthetic" / "round_0001.npz") as y,
  ):
    for k in x.files:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  want, got = state_arrays(straight, 1), state_arrays(chain, 1)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(want[k], got[k], err_msg=k)


# A Flower app process (as flwr-clientapp / flwr-serverapp run it: Flower's SIGTERM handler in the
# main thread) serving a run in process; one round of PART (client or server) is made long by
# one XLA computation after the real work, whose wait runs no Python bytecode in its thread (a
# handler in that thread runs only when it ends): SIGTERM comes 2 s into it.
FLOWER_APP = """\
import json, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.telemetry import EventType
import flower_harness
from fedlap_flower import method_work, server_work

spin = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, v: jnp.sin(v) + 1e-3, x))
ones = jnp.ones(64)
spin(ones, 1).block_until_ready()  # compiled before the run: the slow call only waits
part, round_to_slow = {part!r}, {round_to_slow}
calls = []

def slowed(real):
  def run(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(1)
    if len(calls) == round_to_slow:
      print("fault: the " + part + " round is slow", file=sys.stderr, flush=True)
      spin(ones, 2 ** 30).block_until_ready()
    return out
  return run

if part == "client":
  real_client_fn = method_work.client_fn  # the client's step, slowed once built
  method_work.client_fn = lambda *a: slowed(real_client_fn(*a))
else:
  server_work.method_update = slowed(server_work.method_update)
register_signal_handlers(event_type=EventType.FLWR_CLIENTAPP_RUN_LEAVE,
                         exit_message="Task stopped.")
run_config, state_root = json.loads(sys.argv[1]), sys.argv[2]  # the clients' own state-dirs
if part == "client":
  flower_harness.run_inprocess(run_config, state_root=state_root)
else:  # the ServerApp's entry point, as flwr-serverapp calls it
  from flwr.app import Context, RecordDict
  from fedlap_flower import client_app, server_app
  nodes = flower_harness.node_configs(state_root=state_root)
  grid = flower_harness.InProcessGrid(client_app.app, run_config, nodes)
  server_app.PromptGrid = lambda g: g  # the in-process Grid has send_and_receive only
  with flower_harness.task_identity():
    server_app.main(grid, Context(run_id=7, node_id=1, node_config={{}}, state=RecordDict(),
                                  run_config=run_config))
"""
# Flower's handler ends the process; it forces the exit 5 s after it ran (kill at 30 s).
FLOWER_EXIT_BUDGET_SECONDS = 25.0


@pytest.mark.slow
@pytest.mark.parametrize("part", ["client", "server"])
def test_sigterm_ends_a_flower_app_process_in_a_long_round(tmp_path, cache, part):
  from fedlap_flower.ledger import ClientState  # pylint: disable=g-import-not-at-top
  from flower_harness import TINY  # pylint: disable=g-import-not-at-top

  round_to_slow = 1 if part == "client" else 2
  run_config = {
    "config": "quickstart:dp_loops",
    "overrides": TINY,
    "run-dir": str(tmp_path / "run"),
    "max-epsilon": 50.0,
  }
  script = tmp_path / "app.py"
  script.write_text(
    FLOWER_APP.format(tests=str(ROOT / "tests"), part=part, round_to_slow=round_to_slow)
  )
  env = _env(cache)
  rc, _, err, seconds = terminate_when(
    [sys.executable, str(script), json.dumps(run_config), str(tmp_path / "state")],
    env,
    f"fault: the {part} round is slow",
    timeout=900,
    exit_timeout=60,
    delay=2.0,
  )
  assert seconds < FLOWER_EXIT_BUDGET_SECONDS, (seconds, err[-2000:])
  assert rc == 0, err[-2000:]  # Flower's graceful exit
  if part == "client":  # client 0 was computing round 1: its ledger is charged and intact
    state = ClientState(tmp_path / "state" / "client-0")
    assert [h["server_round"] for h in state.history()] == [1]
    assert not list(state.directory.glob(".*.tmp*"))
  else:  # the server was training round 2: round 1's record is on disk, whole
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith("\n")
    assert json.loads(lines[0])["round"] == 1
