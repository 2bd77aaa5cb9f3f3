"""Clients sharded over devices give the single-device round (fedlap_jax.sharding).

JAX fixes the device count at start-up, so each device count runs in its own
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``; the
subprocess runs this file as a script and prints the round results as JSON.
5 clients on 4 devices also exercises the padding with empty clients. The
multi-host path runs as two processes on this host joined by
``jax.distributed.initialize`` (collectives over gloo), two devices each.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository

NUM_CLIENTS = 5


def _worker(
  backend: str,
  process_id: int | None = None,
  num_processes: int | None = None,
  coordinator: str | None = None,
) -> dict:
  """Two rounds of FedLAP-DP, one of FedLAP and one of FedAvg on a tiny problem; returns numbers.

  The clients hold uint8 pixels with a normalisation, so the per-client pixel
  scale and offset are sharded with the data. With ``num_processes`` the
  worker is one of several processes (hosts) joined by
  ``jax.distributed.initialize`` over ``coordinator``; inputs are then placed as
  global arrays and outputs gathered from all processes.
  """
  import jax

  from fedlap_jax import sharding

  if num_processes:  # before any computation: gloo on CPU, the host name checked
    sharding.initialize_hosts(coordinator, num_processes, process_id, initialization_timeout=120)
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  from experiments.train import CompileCounter
  from fedlap_jax import baselines, client_data, dispatch, models, rounds
  from fedlap_jax.methods.fedlap import state as federated
  from fedlap_jax.method import ModelFns, RunFacts
  from fedlap_jax.methods import REGISTRY
  from fedlap_jax import dp_config
  from fedlap_jax.methods.fedlap import config as C

  multi = jax.process_count() > 1

  def host(a):
    return np.asarray(multihost_utils.process_allgather(a, tiled=True) if multi else a)

  # norm="none": the checks compare numbers over several rounds, and FedLAP-DP
  # rounds of the paper's kind amplify float differences (a 1e-7 relative change
  # of the parameters changes the quickstart's synthetic images completely
  # within one round, in float64 too; `benchmarks/matching_precision.py` at abda0b3).
  # This tiny model without instance norm is tame: runs agree to 1e-5.
  model = models.ConvNet(num_classes=10, width=8, depth=1, norm="none")
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
  apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
  rng = np.random.default_rng(0)
  sizes = [40, 48, 40, 44, 40]
  xs = [rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8) for n in sizes]
  ys = [np.resize([2 * k, 2 * k + 1], n).astype(np.int32) for k, n in enumerate(sizes)]
  scale, offset = client_data.pixel_normalisation([0.5], [0.29])
  clients = client_data.stack_clients(xs, ys, pixel_scale=scale, pixel_offset=offset)
  if multi:
    clients = sharding.put_clients(clients)
  dp = C.FedLAPConfig(
    client=C.ClientConfig(
      ipc=2,
      iterations=1,
      max_outer=2,
      batch_loop=2,
      boost_loop=2,
      inner_loop=1,
      batch_size=16,
      radius=5.0,
      mse_weight=0.0,
      image_lr=1.0,
      calibrate_radius=False,
      dsa_strategy="color_flip",
      dp=dp_config.DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5, microbatch_size=8),
    ),
    server=C.ServerConfig(
      radius_strategy="constant", weighting="uniform", max_epochs=3, dsa_strategy=""
    ),
    rounds=3,
    learning_rate=0.05,
    synthetic_init="noise",
  )
  nondp = C.FedLAPConfig(
    client=C.ClientConfig(
      ipc=2,
      iterations=1,
      max_outer=2,
      batch_loop=2,
      boost_loop=2,
      inner_loop=0,
      batch_size=16,
      radius=5.0,
      image_lr=1.0,
      calibration_epochs=2,
      dsa_strategy="",
    ),
    server=C.ServerConfig(radius_strategy="min", max_epochs=2, dsa_strategy=""),
    rounds=3,
    learning_rate=0.05,
    synthetic_init="real",
  )
  out = {
    "devices": jax.device_count(),
    "processes": jax.process_count(),
    "backend": dispatch.resolve_client_backend(backend),
  }
  # Programs read from a persistent compilation cache (the multi-process tests share
  # one) count as compilations too.
  cache_hits = []
  jax.monitoring.register_event_listener(
    lambda event, **_: (
      cache_hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
  )
  for name, cfg, num_rounds in (("dp", dp, 2), ("nondp", nondp, 1)):
    state = federated.init_state(jax.random.PRNGKey(1), params, clients, cfg)
    if backend == "shard" or multi:
      state = sharding.replicate(state)
    round_fn = rounds.make_round_fn(
      REGISTRY["fedlap"], cfg, ModelFns(apply_fn), client_backend=backend
    )
    for r in range(num_rounds):
      hits_before = len(cache_hits)
      with CompileCounter() as compiles:
        state, metrics = round_fn(state, clients)
        jax.block_until_ready(state)
      if r:
        # The state round 1 returns (replicated over the mesh when sharded) must
        # not compile a second program (single-process runs leave it unplaced).
        out["compiles_after_round_1"] = compiles.count + len(cache_hits) - hits_before
    out[name] = {
      "params": [host(a).ravel().tolist() for a in jax.tree.leaves(state.params)],
      "synthetic": host(state.synthetic.x).ravel().tolist(),
      "matching_loss": host(metrics.client.matching_loss).ravel().tolist(),
      "radius": host(metrics.client_radius).tolist(),
      "server_epochs": int(host(metrics.server.epochs)),
      "accesses": host(metrics.client.real_accesses).tolist(),
    }
  fedavg = rounds.algorithm(
    REGISTRY["fedavg"],
    baselines.baseline_config(
      "fedavg",
      rounds=3,
      learning_rate=0.05,
      local_epochs=1,
      batch_size=16,
      prox_mu=0.0,
      dp=None,
      max_client_size=max(sizes),
    ),
    ModelFns(apply_fn),
    RunFacts((8, 8, 1), NUM_CLIENTS, models.count_params(params), 1),
    client_backend=backend,
  )
  state = fedavg.init(jax.random.PRNGKey(2), params, clients)
  if multi:
    state = sharding.replicate(state)
  state, metrics = fedavg.round(state, clients)
  out["fedavg"] = {
    "params": [host(a).ravel().tolist() for a in jax.tree.leaves(state.params)],
    "steps": host(metrics.client.steps).tolist(),
  }
  return out


def _experiments_worker(workdir: str) -> dict:
  """``experiments.train`` on 4 devices: 3 rounds, then round 3 again from checkpoint 2."""
  import shutil

  import jax

  from experiments import train

  from fedlap_runs import build

  # This file runs as a script from tests/integration/; the module it reads imports from
  # tests/conftest.py, as pytest lets it.
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  from test_experiments_run import tiny_config

  cfg = tiny_config(rounds=3, checkpoint_every=1, progress_bar=False, plots=False)
  first = train.train_and_evaluate(cfg, workdir)
  shutil.rmtree(f"{workdir}/checkpoints/3")  # as if the run had stopped after round 2
  resumed = train.train_and_evaluate(cfg, workdir)
  assert [r["test_accuracy"] for r in resumed["records"]] == [
    r["test_accuracy"] for r in first["records"]
  ]
  setup = build.build_run(cfg)
  return {
    "devices": jax.device_count(),
    "compilations": [first["compilations"], resumed["compilations"]],
    "client_devices": len(setup.clients.x.sharding.device_set),
    "accuracy": [r["test_accuracy"] for r in resumed["records"]],
    "backend": json.load(open(f"{workdir}/run_info.json"))["client_backend"],
  }


def _env(devices: int, cache=None) -> dict:
  """``devices`` CPU devices; with ``cache``, a persistent compilation cache there."""
  env = dict(os.environ)
  # After the session's own flags (tests/conftest.py), so both sides compile alike.
  flags = (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(f for f in flags if f)
  env["JAX_PLATFORMS"] = "cpu"
  # The worker runs as a script (its folder first on the path): the checkout's command line,
  # ``experiments``, which no install provides, comes from the repository root.
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
  if cache is not None:
    env.update(
      JAX_COMPILATION_CACHE_DIR=str(cache),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  return env


def _run(devices: int, *backends: str) -> list[dict]:
  """The worker's results for each of ``backends``, run one after another in one process."""
  proc = subprocess.run(
    [sys.executable, __file__, ",".join(backends)],
    env=_env(devices),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_processes(
  num_processes: int,
  devices_per_process: int,
  tmp_path,
  hosts: list[list[str]] | None = None,
  cache=None,
) -> list[dict]:
  """The worker as ``num_processes`` JAX processes.

  Without ``hosts`` all run on this host with the coordinator on localhost.
  With ``hosts`` (from the ``network_hosts`` fixture) process ``i`` runs under
  the command prefix ``hosts[i]`` (its own network namespace, address and host
  name) and the coordinator is on host 0's address. Output goes to files, not
  pipes: a process blocked on a full pipe would stall the others at the
  distributed shutdown barrier.
  """
  if hosts:
    coordinator = f"{NETWORK_ADDRESSES[0]}:{NETWORK_PORT}"
  else:
    # Imported here: this file also runs as the workers' script, without tests/ on its path.
    from local_network import free_port, loopback_up

    if not loopback_up("localhost"):
      pytest.skip("no loopback network for the coordinator")
    coordinator = f"localhost:{free_port('localhost')}"
  procs, logs = [], []
  for i in range(num_processes):
    out, err = tmp_path / f"process{i}.out", tmp_path / f"process{i}.err"
    prefix = hosts[i] if hosts else []
    with open(out, "w") as fo, open(err, "w") as fe:
      procs.append(
        subprocess.Popen(
          [*prefix, sys.executable, __file__, "auto", str(i), str(num_processes), coordinator],
          env=_env(devices_per_process, cache),
          stdout=fo,
          stderr=fe,
          text=True,
        )
      )
    logs.append((out, err))
  try:
    codes = [proc.wait(timeout=600) for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  results = []
  for code, (out, err) in zip(codes, logs):
    assert code == 0, err.read_text()[-3000:]
    results.append(json.loads(out.read_text().strip().splitlines()[-1]))
  return results


NETWORK_ADDRESSES = ("10.231.0.1", "10.231.0.2")
NETWORK_PORT = 23456


@pytest.fixture
def network_hosts(tmp_path):
  """Two "hosts": network namespaces joined by a virtual Ethernet pair.

  Each has its own address (:data:`NETWORK_ADDRESSES`) and its own host name,
  resolved by a private ``/etc/hosts`` (bind-mounted in a private mount
  namespace, so the machine's is untouched), as on a cluster. Yields one
  command prefix per host. Needs root and iproute2; skips otherwise.
  """
  import shutil

  if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")):
    pytest.skip("two network hosts need root, ip (iproute2) and unshare")
  tag = f"fj{os.getpid() % 100000}"
  names = [f"{tag}h{i}" for i in range(2)]
  setup = [
    ["ip", "netns", "add", names[0]],
    ["ip", "netns", "add", names[1]],
    ["ip", "link", "add", f"{tag}v0", "type", "veth", "peer", "name", f"{tag}v1"],
  ]
  for i, (name, address) in enumerate(zip(names, NETWORK_ADDRESSES)):
    setup += [
      ["ip", "link", "set", f"{tag}v{i}", "netns", name],
      ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", f"{tag}v{i}"],
      ["ip", "-n", name, "link", "set", f"{tag}v{i}", "up"],
      ["ip", "-n", name, "link", "set", "lo", "up"],
    ]
  hosts_file = tmp_path / "hosts"
  hosts_file.write_text(
    "127.0.0.1 localhost\n"
    + "".join(f"{address} {name}\n" for name, address in zip(names, NETWORK_ADDRESSES))
  )
  try:
    for cmd in setup:
      proc = subprocess.run(cmd, capture_output=True, text=True)
      if proc.returncode:
        pytest.skip(f"cannot build two network hosts: {' '.join(cmd)}: {proc.stderr.strip()}")
    yield [
      [
        "ip",
        "netns",
        "exec",
        name,
        "unshare",
        "--uts",
        "--mount",
        "sh",
        "-c",
        f'mount --bind {hosts_file} /etc/hosts && hostname {name} && exec "$@"',
        "sh",
      ]
      for name in names
    ]
  finally:  # deleting a namespace deletes the pair end in it, and with it the pair
    subprocess.run(["ip", "link", "del", f"{tag}v0"], capture_output=True)  # if never moved
    for name in names:
      subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def multi_process_cache(tmp_path_factory):
  """A compilation cache the multi-process tests share (the same programs on 2 x 2 devices)."""
  return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def one_device():
  """One device, one process: clients one after another (what "auto" picks) and side by side."""
  single, side = _run(1, "auto", "vmap")
  assert single["devices"] == 1 and single["processes"] == 1 and single["backend"] == "map"
  return single, side


@pytest.fixture(scope="module")
def single_device(one_device):
  return one_device[0]


def _assert_same_round(single: dict, sharded: dict):
  assert single["compiles_after_round_1"] == sharded["compiles_after_round_1"] == 0
  for name in ("dp", "nondp"):
    a, b = single[name], sharded[name]
    assert a["accesses"] == b["accesses"] and len(a["radius"]) == NUM_CLIENTS
    assert a["server_epochs"] == b["server_epochs"]
    for field in ("synthetic", "matching_loss", "radius"):
      np.testing.assert_allclose(b[field], a[field], rtol=1e-4, atol=1e-5, err_msg=field)
    for pa, pb in zip(a["params"], b["params"]):
      np.testing.assert_allclose(pb, pa, rtol=1e-4, atol=1e-5, err_msg="params")
  a, b = single["fedavg"], sharded["fedavg"]
  assert a["steps"] == b["steps"] and min(a["steps"]) > 0
  for pa, pb in zip(a["params"], b["params"]):
    np.testing.assert_allclose(pb, pa, rtol=1e-4, atol=1e-5, err_msg="fedavg params")


@pytest.mark.slow
def test_one_vs_four_devices_same_round(single_device):
  (sharded,) = _run(4, "auto")
  assert sharded["devices"] == 4 and sharded["backend"] == "shard"  # what "auto" picks
  _assert_same_round(single_device, sharded)


@pytest.mark.slow
def test_side_by_side_clients_same_round(one_device):
  """The vmap backend (clients side by side, masked loops, shared DSA families; the worker's
  DSA draws a family among two) gives the numbers of one client after another, one program."""
  single, side = one_device
  assert side["devices"] == 1 and side["backend"] == "vmap"
  _assert_same_round(single, side)


@pytest.mark.slow
def test_two_processes_same_round(single_device, tmp_path, multi_process_cache):
  """Two JAX processes (jax.distributed, gloo) with two CPU devices each: the multi-host path."""
  first, second = _run_processes(2, 2, tmp_path, cache=multi_process_cache)
  for out in (first, second):
    assert out["processes"] == 2 and out["devices"] == 4 and out["backend"] == "shard"
    _assert_same_round(single_device, out)
  assert first == second  # every process ends with the same gathered results


@pytest.mark.slow
@pytest.mark.multihost
def test_two_network_hosts_same_round(single_device, network_hosts, tmp_path, multi_process_cache):
  """The same, with each process on its own network host (namespace, address, host name)."""
  first, second = _run_processes(2, 2, tmp_path, hosts=network_hosts, cache=multi_process_cache)
  for out in (first, second):
    assert out["processes"] == 2 and out["devices"] == 4 and out["backend"] == "shard"
    _assert_same_round(single_device, out)
  assert first == second


def test_initialize_hosts_refuses_a_loopback_host_name_on_cpu(monkeypatch):
  import jax

  from fedlap_jax import sharding

  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax.config, "update", lambda *a: None)  # keep this process's settings
  monkeypatch.setattr(socket, "gethostname", lambda: "node7")
  monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
  with pytest.raises(ValueError, match=r"'node7' resolves to 127\.0\.1\.1.*'10\.0\.0\.1:1234'"):
    sharding.initialize_hosts("10.0.0.1:1234", 2, 1, cpu=True)
  monkeypatch.setattr(sharding, "_cpu_only", lambda: True)  # the default: detected
  with pytest.raises(ValueError, match="loopback"):
    sharding.initialize_hosts("10.0.0.1:1234", 2, 1)
  assert not calls
  # Allowed: all processes on one host, or accelerators (NCCL does not use gloo).
  sharding.initialize_hosts("localhost:1234", 2, 1, cpu=True)
  sharding.initialize_hosts("10.0.0.1:1234", 2, 1, cpu=False, initialization_timeout=5)
  assert calls == [
    (("localhost:1234",), {"num_processes": 2, "process_id": 1}),
    (("10.0.0.1:1234",), {"num_processes": 2, "process_id": 1, "initialization_timeout": 5}),
  ]
  monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.7")
  sharding.initialize_hosts("10.0.0.1:1234", 2, 1, cpu=True)
  assert len(calls) == 3

  def unresolvable(name):
    raise socket.gaierror("Name or service not known")

  monkeypatch.setattr(socket, "gethostbyname", unresolvable)
  with pytest.raises(ValueError, match="does not resolve"):
    sharding.initialize_hosts("10.0.0.1:1234", 2, 1, cpu=True)


@pytest.mark.slow
def test_experiments_run_on_four_devices_compiles_once(tmp_path):
  """The experiment driver shards by itself: client data placed once, one program per run."""
  proc = subprocess.run(
    [sys.executable, __file__, "experiments", str(tmp_path)],
    env=_env(4),
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["devices"] == 4 and out["backend"] == "shard"
  assert out["client_devices"] == 4  # 5 clients on 4 devices: replicated, the round pads
  # One program; the resumed run reuses it (same process, memoised algorithm).
  assert out["compilations"] == [1, 0]
  assert len(out["accuracy"]) == 3 and all(a > 0.1 for a in out["accuracy"])


def test_placement_is_a_no_op_for_placed_arrays():
  import jax
  import jax.numpy as jnp

  from fedlap_jax import dispatch, sharding

  mesh = sharding.client_mesh()
  tree = {"x": jnp.arange(8.0).reshape(4, 2), "key": jax.random.key(3)}
  placed = sharding.replicate(tree, mesh)
  again = sharding.replicate(placed, mesh)
  assert again["x"] is placed["x"] and again["key"] is placed["key"]
  assert jax.dtypes.issubdtype(placed["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(
    jax.random.key_data(placed["key"]), jax.random.key_data(tree["key"])
  )
  clients = sharding.put_clients({"x": np.ones((4, 3), np.uint8)}, mesh)
  assert sharding.put_clients(clients, mesh)["x"] is clients["x"]
  assert clients["x"].dtype == np.uint8
  # map and vmap rounds are the jitted function itself; shard ones place their inputs.
  fn = jax.jit(lambda s, c: (s, c))
  assert dispatch.place_inputs(fn, "map") is fn
  wrapped = dispatch.place_inputs(fn, "shard", mesh)
  assert isinstance(wrapped, sharding.PlacedRound) and wrapped._cache_size() == 0
  state, _ = wrapped(tree, clients)
  assert state["x"].sharding.is_equivalent_to(placed["x"].sharding, 2)
  # Unplaced client data is placed once per object, not on every call.
  raw = {"x": np.ones((4, 3), np.float32)}
  wrapped(state, raw)
  first = wrapped._clients[1]["x"]
  wrapped(state, raw)
  assert wrapped._clients[1]["x"] is first
  _, other = wrapped(state, {"x": np.zeros((4, 3), np.float32)})
  assert wrapped._clients[1]["x"] is not first and float(other["x"].sum()) == 0.0


def test_map_clients_pads_and_refuses_bad_input():
  import jax
  import jax.numpy as jnp

  from fedlap_jax import sharding

  mesh = sharding.client_mesh()
  x = jnp.arange(10.0).reshape(5, 2)
  out = jax.jit(lambda x: sharding.map_clients(lambda b: 2.0 * b, x, mesh=mesh))(x)
  np.testing.assert_array_equal(out, 2.0 * x)
  assert sharding.padded_size(5, 4) == 8 and sharding.padded_size(8, 4) == 8
  with pytest.raises(ValueError, match="client axis"):
    sharding.map_clients(lambda b: b, (x, jnp.ones(4)), mesh=mesh)
  from jax.sharding import Mesh

  with pytest.raises(ValueError, match="axis_names"):
    sharding.map_clients(lambda b: b, x, mesh=Mesh(np.array(jax.devices()), ("data",)))


if __name__ == "__main__":
  if sys.argv[1] == "experiments":
    print(json.dumps(_experiments_worker(sys.argv[2])))
  elif len(sys.argv) > 2:  # backend, process id, number of processes, coordinator address
    print(json.dumps(_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
  else:  # backends, comma-separated
    print(json.dumps([_worker(backend) for backend in sys.argv[1].split(",")]))
