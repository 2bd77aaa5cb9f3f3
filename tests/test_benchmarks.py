"""The benchmark helpers whose numbers docs/benchmarks.md reports: data and FLOP bookkeeping."""

from __future__ import annotations

import dataclasses
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench
from fedlap_jax import config as config_lib

TINY = bench.Problem((4, 4, 3), records=50, num_clients=3)


def test_random_clients_uint8_are_pixels_read_as_normalised_inputs():
  pixels = bench.random_clients(TINY, data="uint8")
  floats = bench.random_clients(TINY)
  chex.assert_type(pixels.x, jnp.uint8)
  chex.assert_type(floats.x, jnp.float32)
  chex.assert_shape([pixels.x, floats.x], (3, 50, 4, 4, 3))
  assert pixels.x.nbytes * 4 == floats.x.nbytes
  chex.assert_trees_all_equal(pixels.y, floats.y)
  x = np.asarray(pixels._replace(x=pixels.x[0], pixel_scale=pixels.pixel_scale[0],
                                 pixel_offset=pixels.pixel_offset[0]).images(jnp.arange(50)))
  # Uniform pixels, normalised with mean 0.5 and std 0.29: ~zero mean, unit spread.
  assert abs(x.mean()) < 0.1 and 0.9 < x.std() < 1.1
  assert x.min() >= -0.5 / 0.29 - 1e-5 and x.max() <= 0.5 / 0.29 + 1e-5
  with pytest.raises(ValueError, match=r"data='int8' is invalid"):
    bench.random_clients(TINY, data="int8")


def test_client_sizes_pad_to_the_largest_and_mask_the_rest():
  problem = bench.with_client_sizes(TINY, (7, 12, 9))
  assert (problem.num_clients, problem.records, problem.sizes) == (3, 12, (7, 12, 9))
  clients = bench.random_clients(problem)
  chex.assert_shape(clients.x, (3, 12, 4, 4, 3))
  np.testing.assert_array_equal(np.sum(np.asarray(clients.mask), axis=1), [7, 12, 9])
  assert not np.asarray(clients.mask)[0, 7:].any()
  # Two classes per client on its real records.
  assert set(np.asarray(clients.y)[1][np.asarray(clients.mask)[1]]) == {2, 3}
  # The authors' workload: 8,000 records in all, as the paper partition of mnist10k gives.
  assert sum(bench.AUTHORS_CLIENT_SIZES) == 8000 and len(bench.AUTHORS_CLIENT_SIZES) == 5
  with pytest.raises(ValueError, match=r"client_sizes=\(7, 12\) is invalid.*3 integers"):
    bench.Problem((4, 4, 3), records=12, num_clients=3, client_sizes=(7, 12))
  with pytest.raises(ValueError, match=r"records=50 is invalid.*maximum 12"):
    dataclasses.replace(problem, records=50)
  assert bench.parse_client_sizes("1513,1700") == (1513, 1700)
  for bad in ("", "12,x", "0,5"):
    with pytest.raises(ValueError, match=r"--client-sizes .* is invalid"):
      bench.parse_client_sizes(bad)


def test_fedavg_round_on_uneven_clients_runs_each_clients_own_epoch():
  """round(N_k / 256) Poisson steps per client, not round(N_max / 256) each."""
  problem = bench.with_client_sizes(bench.Problem((8, 8, 1), 1), (300, 900, 640))
  clients = bench.random_clients(problem)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  model = nn.Dense(problem.num_classes)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))["params"]

  def apply_fn(p, x):
    return model.apply({"params": p}, x.reshape((x.shape[0], -1)))
  fn, args = bench.op_fedavg_round(apply_fn, params, clients, problem)
  _, metrics = jax.jit(fn)(*args)
  np.testing.assert_array_equal(np.asarray(metrics.client.steps), [1, 4, 3])


def test_main_rejects_bad_client_sizes_with_status_2(capsys):
  for argv in (["--client-sizes", "1,x"], ["--client-sizes", "5,6", "--records", "9"],
               ["--small"], ["--client-sizes", "uniform"]):
    with pytest.raises(SystemExit) as e:
      bench.main(argv)
    assert e.value.code == 2
  assert "--client-sizes '1,x' is invalid" in capsys.readouterr().err


def test_round_flops_is_loop_counts_times_step_flops():
  cfg = config_lib.paper_nondp_config()
  cc = dataclasses.replace(cfg.client, ipc=3, calibration_eval_size=20, model_batch_size=4,
                           inner_loop=2)
  cfg = dataclasses.replace(cfg, client=cc)
  units = {"real_gradient": 7.0, "synthetic_update": 11.0, "client_step": 13.0,
           "server_step": 17.0, "forward_per_image": 2.0}
  metrics = types.SimpleNamespace(
      client=types.SimpleNamespace(real_accesses=np.array([4, 6, 5]),
                                   outer_iterations=np.array([[2], [5], [3]])),
      server=types.SimpleNamespace(steps=np.array(9)))
  s = cc.ipc * TINY.classes_per_client                     # 6 synthetic images per client
  steps_per_epoch = -(-s // cc.model_batch_size)            # 2
  trained = (2 + 4 + 3) * cc.inner_loop                     # last outer iteration trains not
  expected = (15 * (7.0 + cc.boost_loop * 11.0)
              + trained * steps_per_epoch * 13.0
              + 3 * cc.calibration_epochs * (steps_per_epoch * 13.0 + 20 * 2.0)
              + 9 * 17.0)
  assert bench.round_flops(metrics, units, cfg, TINY) == pytest.approx(expected)


def test_trace_summary_busy_time_and_totals(tmp_path):
  """Overlapping kernels count once towards busy time; totals and counts per event name."""
  import gzip  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  from benchmarks import trace_summary  # pylint: disable=g-import-not-at-top
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "name": "conv", "ts": 0, "dur": 10},
      {"ph": "X", "pid": 1, "name": "conv", "ts": 5, "dur": 10},    # overlaps the first
      {"ph": "X", "pid": 1, "name": "add", "ts": 30, "dur": 5},
      {"ph": "X", "pid": 2, "name": "launch", "ts": 0, "dur": 100},
  ]
  path = tmp_path / "op" / "host.trace.json.gz"
  path.parent.mkdir()
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  gpu, cpu = trace_summary.summarise(trace_summary.load(path))
  assert gpu.name == "/device:GPU:0" and cpu.name == "/host:CPU"
  assert gpu.span_us == 100 and gpu.busy_us == 20       # [0, 15] + [30, 35]
  assert gpu.events == [("conv", 20, 2), ("add", 5, 1)]
  assert cpu.busy_us == 100
  assert trace_summary.main([str(tmp_path)]) == 0
  assert trace_summary.main([str(tmp_path / "missing")]) == 2


def test_measure_writes_a_profile_when_asked(tmp_path):
  res = bench.measure("double it", lambda x: 2.0 * x, (jnp.ones(3),), repeats=1,
                      profile_dir=str(tmp_path))
  assert res["times_s"] and float(res["output"][0]) == 2.0
  traces = list((tmp_path / "double_it").rglob("*.trace.json.gz"))
  assert len(traces) == 1


def test_device_check_script_is_valid_and_uses_existing_flags():
  """benchmarks/device_check.sh parses, and every --flag it passes exists in the script it calls."""
  import pathlib
  import re
  import subprocess

  root = pathlib.Path(__file__).resolve().parents[1]
  script = root / "benchmarks" / "device_check.sh"
  subprocess.run(["bash", "-n", str(script)], check=True)
  # Join continuation lines, then check each command's flags against its target's source.
  text = script.read_text().replace("\\\n", " ")
  targets = {"benchmarks/gpu_round.py": root / "benchmarks" / "gpu_round.py",
             "-m benchmarks.bench": root / "benchmarks" / "bench.py",
             "-m benchmarks.trace_summary": root / "benchmarks" / "trace_summary.py"}
  checked = 0
  for line in text.splitlines():
    for call, source in targets.items():
      if call in line and not line.lstrip().startswith("#"):
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line.split(call, 1)[1]))
        for flag in flags:
          assert f'"{flag}"' in source.read_text(), f"{call} has no option {flag}"
          checked += 1
  assert checked >= 8
