"""Flower's two engines with real processes: simulation (Ray) and deployment (SuperLink + SuperNodes).

Each test starts its own processes on free localhost ports through
:class:`flower_federation.Federation`, whose exit always stops them
(SIGTERM, then SIGKILL of each process group), and bounds every wait.
Insecure HTTP on loopback only (CI runs the suite under ``unshare -n`` with
``lo`` up).

The tests that compare numbers with ``experiments.run`` bit for bit are marked
``bitwise``: their processes compile with XLA's default CPU emitters
(``tests/conftest.py``). Under the tests' default setting
(``--xla_cpu_use_fusion_emitters=false``) the program that computes one client
(the Flower app) and the one that computes all clients batched
(``experiments.run``) are fused differently, and a client's radius can differ
in its last bit (0.6966202259 against 0.6966202855), which the server radius
carries on.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flower_harness import SAMPLED, TINY, read_jsonl, reference_run
from fedlap_flower import ledger as ledger_lib
from flower_federation import Federation
from local_network import loopback_up
from fedlap_flower import settings
from fedlap_jax import accounting

pytestmark = [pytest.mark.flower, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_loopback():
  if not loopback_up():
    pytest.skip("loopback networking is down: SuperLink and SuperNodes cannot talk")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """One persistent compilation cache for the ClientApp processes of this module."""
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_simulation_engine_equals_experiments_run(tmp_path, jax_cache):
  """``flwr run`` on the simulation engine, 5 virtual clients: experiments.run's numbers."""
  run_dir = tmp_path / "run"
  with Federation(
    tmp_path / "fed", simulation=True, env={"JAX_COMPILATION_CACHE_DIR": jax_cache}
  ) as fed:
    run_id = fed.run(
      {
        "config": "quickstart:nondp",
        "overrides": TINY,
        "run-dir": str(run_dir),
        "round-timeout": 300.0,
      },
      num_supernodes=5,
    )
    status = fed.wait(run_id, timeout=420)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
  got = read_jsonl(run_dir / "metrics.jsonl")
  want = reference_run("quickstart:nondp", TINY, tmp_path / "ref")
  assert [r["round"] for r in got] == [1, 2]
  for g, w in zip(got, want):
    assert g["clients_ok"] == [0, 1, 2, 3, 4]
    assert (g["test_accuracy"], g["test_loss"]) == (w["test_accuracy"], w["test_loss"])
    assert g["server_radius"] == w["server_radius"]


@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_simulation_engine_samples_clients_as_experiments_run(tmp_path, jax_cache):
  """20 virtual clients, 5 a round (data.clients_per_round), DP with the test-only server
  keys: the server asks only the drawn clients and its numbers are experiments.run's; each
  client's ledger holds only the rounds it computed."""
  run_dir, state = tmp_path / "run", tmp_path / "state"
  env = {
    "JAX_COMPILATION_CACHE_DIR": jax_cache,
    settings.UNSAFE_ENV: "1",
    settings.STATE_ROOT_ENV: str(state),
  }
  with Federation(tmp_path / "fed", simulation=True, env=env) as fed:
    run_id = fed.run(
      {
        "config": "quickstart:dp_loops",
        "overrides": SAMPLED,
        "run-dir": str(run_dir),
        "unsafe-dp-keys-from-server": True,
        "max-epsilon": 50.0,
        "round-timeout": 300.0,
      },
      num_supernodes=20,
    )
    status = fed.wait(run_id, timeout=600)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
  got = read_jsonl(run_dir / "metrics.jsonl")
  want = reference_run("quickstart:dp_loops", SAMPLED, tmp_path / "ref")
  assert [r["round"] for r in got] == [1, 2]
  for g, w in zip(got, want):
    assert g["clients"] == g["clients_ok"] == w["clients"]
    assert (g["test_accuracy"], g["test_loss"]) == (w["test_accuracy"], w["test_loss"])
    assert g["epsilon"] == w["epsilon"]
  reports = json.loads((run_dir / "client_reports.json").read_text())
  assert sorted(r["partition_id"] for r in reports) == sorted(
    k for r in got for k in r["clients"]
  )  # only the drawn clients were asked
  ledgers = accounting.ClientLedgers.from_dict(
    json.loads((tmp_path / "ref" / "privacy_ledger.json").read_text())
  )
  for k in range(20):
    directory = state / f"client-{k}"
    hist = ledger_lib.ClientState(directory).history() if directory.exists() else []
    assert [h["server_round"] for h in hist] == [r["round"] for r in got if k in r["clients"]]
    if hist:
      assert hist[-1]["epsilon"] == ledgers.ledgers[k].epsilon


HOLD = Path(__file__).resolve().parents[1] / "flower_hold"  # its sitecustomize holds a reply


def _federated_run(run_dir: Path) -> str:
  return json.loads((run_dir / "run_info.json").read_text())["federated_run"]


def _wait_for(predicate, timeout: float, what: str, fed: Federation):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    time.sleep(0.5)
  raise TimeoutError(
    f"{what} did not happen within {timeout} s; superlink log: {fed.log_tail('superlink.log')}"
  )


def test_deployment_engine_survives_a_crashed_supernode(tmp_path, jax_cache):
  """SuperLink + 5 SuperNode processes, FedLAP-DP with client-secret keys, 3 rounds.

  SuperNode 4 is killed (SIGKILL) during round 2, after its ledger recorded the
  round and it kept round 2's images, before it replied (``tests/flower_hold``
  holds its reply there, so the kill never races a fast reply): the server
  finishes round 2 with the other four (min-clients=4) and logs the loss; the
  restarted SuperNode finds its ledger on disk and takes part in round 3,
  charging on top: rounds 1, 2 (spent, never delivered) and 3. Its
  noise-initialised synthetic images are carried between rounds; round 2's
  update took no reply of it, so round 3's message names round 1 and the client
  starts from round 1's images, as a client not drawn for round 2, and then drops
  the round 2 images it kept.
  """
  run_dir = tmp_path / "run"
  states = {k: tmp_path / f"client-{k}" for k in range(5)}
  overrides = TINY.replace("rounds=2", "rounds=3")
  held = tmp_path / "client-4-held"
  hold = {
    "PYTHONPATH": os.pathsep.join([str(HOLD), os.environ.get("PYTHONPATH", "")]),
    "FEDLAP_TEST_HOLD_ROUND": "2",
    "FEDLAP_TEST_HOLD_MARKER": str(held),
  }
  with Federation(tmp_path / "fed", env={"JAX_COMPILATION_CACHE_DIR": jax_cache}) as fed:
    for k in range(5):
      fed.start_supernode(
        k,
        {"partition-id": k, "num-partitions": 5, "state-dir": str(states[k]), "max-epsilon": 10.0},
        env=hold if k == 4 else None,
      )
    run_id = fed.run(
      {
        "config": "quickstart:dp_loops",
        "overrides": overrides,
        "run-dir": str(run_dir),
        "min-clients": 4,
        "round-timeout": 300.0,
      }
    )
    _wait_for(held.exists, 420, "client 4 holding its round-2 reply", fed)
    ledger4 = ledger_lib.ClientState(states[4])
    assert [h["server_round"] for h in ledger4.history()] == [1, 2]
    assert ledger4.carried_rounds(_federated_run(run_dir)) == [1, 2]  # kept, then held
    fed.kill_supernode(4)
    fed.start_supernode(4)  # same node config, no hold: the same state directory
    status = fed.wait(run_id, timeout=420)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]

  recs = read_jsonl(run_dir / "metrics.jsonl")
  reports = json.loads((run_dir / "client_reports.json").read_text())
  assert [r["clients_ok"] for r in recs[:2]] == [[0, 1, 2, 3, 4], [0, 1, 2, 3]]
  lost = [r for r in reports if r["round"] == 2 and r["status"] != "ok"]
  assert len(lost) == 1 and lost[0]["status"] in ("missing", "error"), lost
  assert "4" not in recs[1]["epsilon_per_client"]
  kept = ledger_lib.ClientState(states[4]).carried_rounds(_federated_run(run_dir))
  (third,) = [r for r in reports if r["round"] == 3 and r["partition_id"] == 4]
  assert recs[2]["clients_ok"] == [0, 1, 2, 3, 4] and third["status"] == "ok", (recs[2], third)
  assert kept == [1, 3], kept  # round 3's, and round 1's it started from
  # Every ledger restores (recomputing its epsilons); client 4's holds the rounds it spent.
  cfg, _ = settings.load_config("quickstart:dp_loops", overrides)
  steps = cfg.client.iterations * cfg.client.max_outer * cfg.client.batch_loop
  spent = [1, 2, 3]
  for k in range(5):
    state = ledger_lib.ClientState(states[k])
    hist = state.history()
    assert [h["server_round"] for h in hist] == spent, (k, hist)
    assert all(h["keys"] == "client" for h in hist)
    stored = json.loads((states[k] / ledger_lib.LEDGER_FILE).read_text())
    led = accounting.PrivacyLedger.from_dict(stored["ledger"])
    fresh = accounting.PrivacyLedger(**{**led.privacy_fields(), "steps_per_round": steps})
    assert led.epsilons == [fresh.record_round() for _ in spent]
  # Round 3: client 4 reports the epsilon of its third round.
  assert (
    recs[2]["epsilon_per_client"]["4"] == ledger_lib.ClientState(states[4]).history()[2]["epsilon"]
  )


@pytest.mark.bitwise  # differently built programs, bit for bit (conftest's compiler note)
def test_the_app_runs_on_stock_flower_supernodes(tmp_path, jax_cache):
  """Flower's own flower-supernode, its default subprocess isolation (a ClientApp process per
  message), no fedlap_flower.node: the same numbers as experiments.run."""
  run_dir = tmp_path / "run"
  overrides = f"{TINY.replace('rounds=2', 'rounds=1')} data.num_clients=2"
  with Federation(tmp_path / "fed", env={"JAX_COMPILATION_CACHE_DIR": jax_cache}) as fed:
    for k in range(2):
      node = {"partition-id": k, "num-partitions": 2, "state-dir": str(tmp_path / f"client-{k}")}
      fed.start_supernode(k, node, stock=True)
    run_id = fed.run(
      {
        "config": "quickstart:nondp",
        "overrides": overrides,
        "run-dir": str(run_dir),
        "round-timeout": 300.0,
      }
    )
    status = fed.wait(run_id, timeout=900)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
    logs = [fed.log_tail(f"supernode-{k}.log", 200_000) for k in range(2)]
  assert all("[fedlap node]" not in log for log in logs)  # Flower's own node, nothing of ours
  (got,) = read_jsonl(run_dir / "metrics.jsonl")
  (want,) = reference_run("quickstart:nondp", overrides, tmp_path / "ref")
  assert got["clients_ok"] == [0, 1]
  assert (got["test_accuracy"], got["test_loss"]) == (want["test_accuracy"], want["test_loss"])
  assert got["server_radius"] == want["server_radius"]


def test_flwr_stop_stops_a_round_on_the_nodes(tmp_path, jax_cache):
  """``flwr stop`` during a round: each node finishes its task there ``stopped``, its worker
  abandons the task within seconds (and is started again), and the node then computes the
  next run. Each node holds its round-1 reply (``tests/flower_hold``) until the stop, so the
  stop always meets a running task, whatever the machine's speed (a long round raced the
  ``flwr`` command's start on a fast machine)."""
  states = [tmp_path / f"client-{k}" for k in range(2)]
  held = [tmp_path / f"client-{k}-held" for k in range(2)]
  with Federation(tmp_path / "fed", env={"JAX_COMPILATION_CACHE_DIR": jax_cache}) as fed:
    for k in range(2):
      fed.start_supernode(
        k,
        {"partition-id": k, "num-partitions": 2, "state-dir": str(states[k]), "max-epsilon": 50.0},
        env={
          "PYTHONPATH": os.pathsep.join([str(HOLD), os.environ.get("PYTHONPATH", "")]),
          "FEDLAP_TEST_HOLD_ROUND": "1",
          "FEDLAP_TEST_HOLD_MARKER": str(held[k]),
        },
      )
    run_id = fed.run(
      {
        "config": "quickstart:dp",
        "overrides": f"{TINY} data.num_clients=2",
        "run-dir": str(tmp_path / "long"),
      }
    )
    _wait_for(lambda: all(h.exists() for h in held), 600, "both nodes holding round 1", fed)
    t_stop = time.time()
    res = fed._flwr("stop", str(run_id), "test")
    assert res.returncode == 0, res.stdout + res.stderr
    _wait_for(
      lambda: all("task stopped" in fed.log_tail(f"supernode-{k}.log", 200_000) for k in range(2)),
      60,
      "the nodes stopping their tasks",
      fed,
    )
    took = time.time() - t_stop
    assert fed.wait(run_id, timeout=60).startswith("finished:stopped")
    for k in range(2):
      log = fed.log_tail(f"supernode-{k}.log", 200_000)
      assert "its task on this node is stopped" in log and "starting it again" in log, log[-3000:]
    assert [len(ledger_lib.ClientState(s).history()) for s in states] == [1, 1]
    run_dir = tmp_path / "next"
    nondp = f"{TINY.replace('rounds=2', 'rounds=1')} data.num_clients=2"
    # The nodes' ledgers hold the stopped run's round, above what one round can give a fresh
    # ledger: without a max-epsilon the run bounds what it charged them (run-epsilon) instead.
    next_id = fed.run({"config": "quickstart:dp", "overrides": nondp, "run-dir": str(run_dir)})
    status = fed.wait(next_id, timeout=600)
    assert status == "finished:completed", fed.logs(next_id)[-4000:]
  assert took < 30, took
  assert [r["clients_ok"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [[0, 1]]


def test_dp_fedavg_runs_on_the_deployment_engine_through_the_method_strategy(tmp_path, jax_cache):
  """SuperLink + 2 SuperNode processes, DP-FedAvg (the generic MethodStrategy) with
  client-secret keys, 2 rounds: both rounds aggregate both clients, every reply is inside
  its update bound, and each client's ledger holds both rounds with the epsilons it
  reported."""
  run_dir = tmp_path / "run"
  states = [tmp_path / f"client-{k}" for k in range(2)]
  overrides = (
    "method=dp_fedavg rounds=2 baseline.local_epochs=1 eval_chunk_size=128 data.num_clients=2"
  )
  with Federation(tmp_path / "fed", env={"JAX_COMPILATION_CACHE_DIR": jax_cache}) as fed:
    for k in range(2):
      fed.start_supernode(
        k,
        {"partition-id": k, "num-partitions": 2, "state-dir": str(states[k]), "max-epsilon": 50.0},
      )
    run_id = fed.run(
      {
        "config": "quickstart:dp_loops",
        "overrides": overrides,
        "run-dir": str(run_dir),
        "round-timeout": 300.0,
      }
    )
    status = fed.wait(run_id, timeout=600)
    assert status == "finished:completed", fed.logs(run_id)[-4000:]
  recs = read_jsonl(run_dir / "metrics.jsonl")
  assert [r["round"] for r in recs] == [1, 2]
  assert all(r["clients_ok"] == [0, 1] and "update_refused" not in r for r in recs), recs
  assert all(r["epsilon"] > 0 and r["epsilon_kind"] for r in recs)
  assert (run_dir / "done").exists() and (run_dir / "final_params.npz").exists()
  info = json.loads((run_dir / "run_info.json").read_text())
  assert info["method"] == "dp_fedavg" and info["dp"] is True
  reports = json.loads((run_dir / "client_reports.json").read_text())
  assert len(reports) == 4 and all(r["status"] == "ok" for r in reports), reports
  assert all(0 < r["update_norm"] < r["max_update_norm"] for r in reports), reports
  for k in range(2):
    hist = ledger_lib.ClientState(states[k]).history()
    assert [h["server_round"] for h in hist] == [1, 2], (k, hist)
    assert all(h["keys"] == "client" for h in hist)
    mine = [r["metrics"]["epsilon"] for r in reports if r["partition_id"] == k]
    assert mine == [h["epsilon"] for h in hist]
  assert recs[-1]["epsilon"] == max(
    h["epsilon"] for s in states for h in ledger_lib.ClientState(s).history()
  )
