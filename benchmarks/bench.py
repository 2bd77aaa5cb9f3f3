"""Times the building blocks and whole rounds of FedLAP / FedLAP-DP.

Every number is the median of ``--repeats`` runs after a warm-up run, with the
compile time reported separately; FLOPs come from XLA's cost analysis of the
compiled step (for rounds, whose loops XLA counts once, from the measured
operation FLOPs times the loop counts the round reports), memory from the
compiled step's buffer sizes and the process's peak RSS.

Usage, from the repository root::

  python -m benchmarks.bench --reference               # the issue's table, ratios to the authors' code
  python -m benchmarks.bench --reference --small       # a quick check of that mode (~2 min)
  python -m benchmarks.bench --config=mnist_nondp_ref --ops=fedavg_round:map \
      --client-sizes 1513,1700,1571,1570,1646          # any op on clients of these sizes
  python -m benchmarks.bench --per-example             # vmap / jax_privacy / layerwise clipping
  python -m benchmarks.bench --reference --json out.json

Data are random (standard normal images of the named shape, two classes per
client), which is all a timing needs: every loop bound is static except the
radius-limited ones, whose counts are printed. ``--reference`` runs on the
authors' workload: five clients of 1,513-1,700 records (8,000 in all,
:data:`AUTHORS_CLIENT_SIZES`), padded to the largest and masked as in a real run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.methods.fedlap import client as client_lib
from fedlap_jax import client_data
from fedlap_jax import dispatch as dispatch_lib
from fedlap_jax.methods.fedlap import config as config_lib
from fedlap_jax import (
  baselines,
  dispatch,
  matching,
  models,
  per_example,
  privacy,
  rounds,
  synthetic,
  training,
)
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.methods.fedlap import radius
from fedlap_jax.methods.fedlap import server
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY

# The authors' PyTorch code on this kind of machine (2 CPU threads).
REFERENCE_SECONDS = {
  "dp_gradient": 1.21,
  "nondp_gradient": 0.66,
  "synthetic_update": 0.139,
  "dp_round": 50.8,
  "nondp_round": 96.0,
  "fedavg_round": 18.8,
}


@dataclasses.dataclass(frozen=True)
class Problem:
  """Shape of the benchmark data: ``num_clients`` clients of ``records`` images each.

  ``client_sizes``: optional per-client record counts ``(N_1, ..., N_K)``
  (then ``records`` is ``N_max = max(client_sizes)`` and every client is padded
  to it with a validity mask, as in a real run); :func:`with_client_sizes`
  builds such a problem.
  """

  image_shape: tuple[int, int, int]
  records: int
  num_clients: int = 5
  num_classes: int = 10
  classes_per_client: int = 2
  client_sizes: tuple[int, ...] | None = None

  @property
  def sizes(self) -> tuple[int, ...]:
    """``(K,)`` records of each client (``records`` each unless ``client_sizes``)."""
    return self.client_sizes or (self.records,) * self.num_clients


def with_client_sizes(problem: Problem, sizes) -> Problem:
  """``problem`` with ``len(sizes)`` clients of ``sizes[k]`` records, padded to the largest."""
  sizes = tuple(sizes)  # checked where the user gives them (parse_client_sizes)
  return dataclasses.replace(
    problem, num_clients=len(sizes), records=max(sizes), client_sizes=sizes
  )


def parse_client_sizes(text: str) -> tuple[int, ...]:
  """``"1513,1700"`` -> ``(1513, 1700)``; a clear error for anything else."""
  try:
    sizes = tuple(int(t) for t in text.split(","))
  except ValueError:
    sizes = ()
  if not sizes or min(sizes) < 1:
    raise ValueError(
      f"--client-sizes {text!r} is invalid; allowed: comma-separated integers "
      ">= 1, one per client, e.g. 1513,1700,1571,1570,1646"
    )
  return sizes


PROBLEMS = {"mnist": Problem((28, 28, 1), 12_000), "cifar": Problem((32, 32, 3), 10_000)}

# The workload the authors' reference figures were timed on: MNIST-shaped data,
# 8,000 training records in all, the paper's two-classes-per-client partition.
# These are the five client sizes that the project's own partition
#   fedlap_runs.data.partition(y_train, num_clients=5, scheme="paper", num_classes=10)
# (classes {5,6}, {1,2}, {0,8}, {9,3}, {4,7}; sum 8,000, N_max 1,700) gave on the 8,000
# training records of the mnist10k subset the first result tables used
# (fedlap_runs.datasets.ORIGINAL_PAPER_CLIENT_SIZES); the timing data are random, only
# the sizes matter.
AUTHORS_CLIENT_SIZES = (1513, 1700, 1571, 1570, 1646)


def reference_dp_config() -> FedLAPConfig:
  """The issue's FedLAP-DP round: R_i 1, max_outer 2, batch_loop 2, R_b 2, R_l 1, ipc 10."""
  return config_lib.paper_dp_config(
    client=ClientConfig(
      ipc=10,
      iterations=1,
      max_outer=2,
      batch_loop=2,
      boost_loop=2,
      inner_loop=1,
      batch_size=256,
      radius=1.5,
      mse_weight=0.0,
      calibrate_radius=False,
      dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5),
    ),
    server=ServerConfig(radius_strategy="constant", weighting="uniform", max_epochs=100),
  )


def reference_nondp_config() -> FedLAPConfig:
  """The issue's FedLAP round: R_i 1, max_outer 2, batch_loop 4, R_b 5, R_l 0, 5 epochs."""
  return config_lib.paper_nondp_config(
    client=ClientConfig(
      ipc=10,
      iterations=1,
      max_outer=2,
      batch_loop=4,
      boost_loop=5,
      inner_loop=0,
      batch_size=256,
      radius=10.0,
      mse_weight=0.1,
      calibrate_radius=True,
      calibration_epochs=5,
    ),
    server=ServerConfig(radius_strategy="min", weighting="size", max_epochs=5),
  )


def paper_nondp_bounded() -> FedLAPConfig:
  """The published non-DP configuration, calibration loss on 2,048 records per client."""
  cfg = config_lib.paper_nondp_config()
  return dataclasses.replace(
    cfg, client=dataclasses.replace(cfg.client, calibration_eval_size=2048)
  )


CONFIGS: dict[str, tuple[Callable[[], FedLAPConfig], str]] = {
  "mnist_dp_ref": (reference_dp_config, "mnist"),
  "mnist_nondp_ref": (reference_nondp_config, "mnist"),
  "cifar_dp": (config_lib.paper_dp_config, "cifar"),
  "cifar_nondp": (paper_nondp_bounded, "cifar"),
}

OPS = ("dp_gradient", "nondp_gradient", "synthetic_update", "server_update", "round")


# ---------------------------------------------------------------------------
# Data and model.
# ---------------------------------------------------------------------------


DATA_KINDS = ("float32", "uint8")


def random_clients(
  problem: Problem, seed: int = 0, data: str = "float32"
) -> client_data.ClientData:
  """``num_clients`` clients of random images, two classes each.

  Client ``k`` holds ``problem.sizes[k]`` records, padded to the largest with
  a validity mask (:func:`fedlap_jax.client_data.stack_clients`).

  ``data="float32"``: standard normal model inputs. ``"uint8"``: uniform
  pixels kept as uint8 on the device with the normalisation fused into every
  read (``mean`` 0.5, ``std`` 0.29 per channel: inputs in about [-1.7, 1.7]),
  as ``experiments.run`` keeps image datasets.
  """
  if data not in DATA_KINDS:
    raise ValueError(f"data={data!r} is invalid; allowed: one of {DATA_KINDS}")
  rng = np.random.default_rng(seed)
  xs, ys = [], []
  per = problem.classes_per_client
  for k, n_k in enumerate(problem.sizes):
    shape = (n_k, *problem.image_shape)
    if data == "uint8":
      xs.append(rng.integers(0, 256, shape, dtype=np.uint8))
    else:
      xs.append(rng.standard_normal(shape, np.float32))
    classes = (np.arange(per) + per * k) % problem.num_classes
    ys.append(np.resize(classes, n_k).astype(np.int32))
  if data == "uint8":
    channels = problem.image_shape[-1]
    scale, offset = client_data.pixel_normalisation([0.5] * channels, [0.29] * channels)
    return client_data.stack_clients(xs, ys, pixel_scale=scale, pixel_offset=offset)
  return client_data.stack_clients(xs, ys)


def make_model(problem: Problem, impl: str = "auto", width: int = 128, depth: int = 3):
  model = models.ConvNet(num_classes=problem.num_classes, width=width, depth=depth, impl=impl)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, *problem.image_shape)))[
    "params"
  ]

  def apply_fn(p, x):
    return model.apply({"params": p}, x)

  return model, apply_fn, params


# ---------------------------------------------------------------------------
# Measurement.
# ---------------------------------------------------------------------------


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def measure(
  name: str,
  fn,
  args: tuple,
  *,
  repeats: int = 3,
  warmup: bool = True,
  profile_dir: str | None = None,
) -> dict:
  """Compiles ``jit(fn)`` on ``args``, runs it once to warm up, then ``repeats`` times.

  ``warmup=False`` skips the warm-up run (for long rounds: the compile is
  already separate). ``profile_dir``: after the timed runs, one more run under
  ``jax.profiler.trace`` into ``profile_dir/<name>`` (an XSpace ``.xplane.pb``
  for TensorBoard / XProf); not part of the timings.

  Returns a dict with ``compile_s``, ``times_s`` (wall), ``median_s``,
  ``cpu_median_s`` (process CPU time, all threads), ``flops`` (XLA cost
  analysis; loop bodies counted once), ``temp_bytes`` / ``argument_bytes`` /
  ``output_bytes`` of the compiled step, the load average around the runs,
  and ``output`` (the last result, not serialised).
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  cost = _cost(compiled)
  mem = compiled.memory_analysis()
  out = jax.block_until_ready(compiled(*args)) if warmup else None
  load_before = os.getloadavg()[0]
  times, cpus = [], []
  for _ in range(repeats):
    t, c = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
  if profile_dir:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")
    with jax.profiler.trace(os.path.join(profile_dir, slug)):
      out = jax.block_until_ready(compiled(*args))
  return {
    "name": name,
    "compile_s": compile_s,
    "times_s": times,
    "median_s": statistics.median(times),
    "cpu_median_s": statistics.median(cpus),
    "flops": float(cost.get("flops", 0.0)),
    "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0),
    "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0) or 0),
    "output_bytes": int(getattr(mem, "output_size_in_bytes", 0) or 0),
    "load_before": load_before,
    "load_after": os.getloadavg()[0],
    "output": out,
  }


def compiled_flops(fn, *args) -> float:
  """XLA's FLOP count of ``jit(fn)(*args)`` (compiles, does not run)."""
  return float(_cost(jax.jit(fn).lower(*args).compile()).get("flops", 0.0))


# ---------------------------------------------------------------------------
# The operations.
# ---------------------------------------------------------------------------


def _batch(clients, slots: int, real: int):
  """Client 0's first ``slots`` records as model inputs, the first ``real`` marked real."""
  first = jax.tree.map(lambda a: a[0], clients)
  idx = jnp.arange(slots)
  return first.images(idx), first.y[idx], idx >= real


def op_gradient(
  apply_fn,
  params,
  clients,
  cfg: FedLAPConfig,
  *,
  dp: bool,
  slots: int,
  method: str = "auto",
  microbatch_size: int | None = None,
):
  """``(fn, args)`` of one real-data gradient on ``slots`` slots, ``B`` of them real.

  ``microbatch_size`` defaults to the config's for the DP gradient (``None``:
  ``method="auto"`` picks one on CPU) and to ``"auto"`` for the non-DP one, as
  in a round.
  """
  cc = cfg.client
  x, y, pad = _batch(clients, slots, min(cc.batch_size, slots))
  if dp:
    dpc = cc.dp or DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
    mb = microbatch_size or dpc.microbatch_size

    # The one DP gradient, on a client holding exactly these records (every one drawn: the
    # buffer is the batch), as a round takes it.
    query = privacy.PoissonGradient(
      batch_size=cc.batch_size,
      capacity=slots,
      l2_clip_norm=dpc.l2_clip_norm,
      noise_multiplier=dpc.noise_multiplier,
      microbatch_size=mb,
      per_example_method=method,
    )
    data = client_data.ClientData(x, y, jnp.logical_not(pad))

    def fn(key, p, data):
      return privacy.poisson_gradient(query, key, apply_fn, p, data).gradient

    return fn, (jax.random.PRNGKey(1), params, data)

  mb = "auto" if microbatch_size is None else microbatch_size

  def fn(p, x, y, pad):
    return privacy.real_gradient(apply_fn, p, x, y, pad, microbatch_size=mb)

  return fn, (params, x, y, pad)


def _synthetic(clients, cfg: FedLAPConfig, problem: Problem):
  labels, mask = synthetic.synthetic_labels(
    [np.asarray(y)[np.asarray(m)] for y, m in zip(clients.y, clients.mask)], cfg.client.ipc
  )
  x = synthetic.noise_images(jax.random.PRNGKey(3), jnp.asarray(mask), problem.image_shape)
  return client_data.SyntheticSet(x, jnp.asarray(labels), jnp.asarray(mask))


def op_synthetic_update(apply_fn, params, clients, cfg, problem):
  """One synthetic-image update: ``L_dis`` grad w.r.t. the images (grad of grad) + SGD step."""
  cc = cfg.client
  syn = jax.tree.map(lambda a: a[0], _synthetic(clients, cfg, problem))
  x, y, pad = _batch(clients, cc.capacity, cc.batch_size)
  g_real = jax.jit(functools.partial(privacy.real_gradient, apply_fn))(params, x, y, pad)
  opt = client_lib.default_image_optimizer(cc)

  def fn(p, syn, g_real, key, opt_state):
    _, grad_x = matching.matching_step(
      apply_fn, p, syn, g_real, key, dsa_strategy=cc.dsa_strategy, mse_weight=cc.mse_weight
    )
    updates, opt_state = opt.update(grad_x, opt_state, syn.x)
    return syn.x + updates, opt_state

  return fn, (params, syn, g_real, jax.random.PRNGKey(4), opt.init(syn.x))


def op_server_update(apply_fn, params, clients, cfg, problem):
  """``global_update`` on all clients' synthetic sets, radius ``r`` (runs to ``r`` or the cap)."""
  syn = _synthetic(clients, cfg, problem)
  weights = dispatch.client_weights(cfg.server.weighting, dispatch.record_counts(clients))
  lr = float(training.cosine_learning_rate(1, cfg.rounds, cfg.learning_rate))
  r_g = radius.server_radius(
    jnp.full((problem.num_clients,), cfg.client.radius),
    cfg.server.radius_strategy,
    cfg.client.radius,
  )

  def fn(key, p, syn, w, r):
    return server.global_update(key, apply_fn, p, syn, w, r, learning_rate=lr, config=cfg.server)

  return fn, (jax.random.PRNGKey(7), params, syn, weights, r_g)


def op_round(apply_fn, params, clients, cfg, problem, *, client_backend="auto"):
  """A whole round (all clients + server): FedLAP's generic round
  (:func:`fedlap_jax.rounds.make_round_fn`)."""
  state = federated.init_state(jax.random.PRNGKey(8), params, clients, cfg)
  round_fn = rounds.make_round_fn(
    REGISTRY["fedlap"], cfg, ModelFns(apply_fn), client_backend=client_backend
  )
  return round_fn, (state, clients)


def op_fedavg_round(apply_fn, params, clients, problem, client_backend: str = "map"):
  """A FedAvg round with one local epoch (:func:`fedlap_jax.rounds.algorithm`)."""
  config = baselines.baseline_config(
    "fedavg",
    rounds=200,
    learning_rate=0.1,
    local_epochs=1,
    batch_size=256,
    prox_mu=0.0,
    dp=None,
    max_client_size=max(problem.sizes),
  )
  facts = RunFacts(tuple(problem.image_shape), problem.num_clients, models.count_params(params), 1)
  alg = rounds.algorithm(
    REGISTRY["fedavg"], config, ModelFns(apply_fn), facts, client_backend=client_backend
  )
  state = alg.init(jax.random.PRNGKey(9), params, clients)
  return alg.round, (state, clients)


# ---------------------------------------------------------------------------
# FLOPs of a round from its loop counts.
# ---------------------------------------------------------------------------


def gradient_flops(
  apply_fn,
  params,
  clients,
  cfg,
  slots: int,
  *,
  dp: bool,
  method: str = "auto",
  microbatch_size: int | None = None,
) -> float:
  """FLOPs of the real-gradient work actually done on a ``slots`` buffer with ``B`` real examples.

  XLA counts a microbatch loop once, so this is the one-pass FLOP count times
  the fraction of slots processed (microbatches up to the last real example).
  """
  cc = cfg.client
  fn, args = op_gradient(
    apply_fn, params, clients, cfg, dp=dp, slots=slots, method=method, microbatch_size=slots
  )
  one_pass = compiled_flops(fn, *args)
  mb = microbatch_size or (cc.dp.microbatch_size if dp and cc.dp else None)
  if mb is None and method == "auto":
    x = args[-1].x if dp else args[-3]  # the DP gradient takes a ClientData, the other (x, y, pad)
    mb = per_example.auto_plan(apply_fn, params, x)[1]
  if mb is None or mb >= slots:
    return one_pass
  processed = min(math.ceil(min(cc.batch_size, slots) / mb) * mb, slots)
  return one_pass * processed / slots


def unit_flops(apply_fn, params, clients, cfg, problem) -> dict[str, float]:
  """XLA FLOPs of the loop bodies a round repeats (compiled, not run)."""
  cc = cfg.client
  units = {}
  units["real_gradient"] = gradient_flops(
    apply_fn, params, clients, cfg, cc.capacity, dp=cc.dp is not None
  )
  fn, args = op_synthetic_update(apply_fn, params, clients, cfg, problem)
  units["synthetic_update"] = compiled_flops(fn, *args)
  syn = jax.tree.map(lambda a: a[0], _synthetic(clients, cfg, problem))
  s = syn.x.shape[0]

  def step(p, x, y, bs, strategy):
    w = jnp.ones((x.shape[0],))
    return training.sgd_epoch(
      jax.random.PRNGKey(0), apply_fn, p, x, y, w, 0.1, batch_size=bs, dsa_strategy=strategy
    )[0]

  units["client_step"] = compiled_flops(
    functools.partial(step, bs=cc.model_batch_size, strategy=cc.dsa_strategy), params, syn.x, syn.y
  )
  k = problem.num_clients
  sb = min(cfg.server.batch_size, k * s)
  units["server_step"] = compiled_flops(
    functools.partial(step, bs=cfg.server.batch_size, strategy=cfg.server.dsa_strategy),
    params,
    jnp.zeros((sb, *problem.image_shape)),
    jnp.zeros((sb,), jnp.int32),
  )
  units["forward_per_image"] = compiled_flops(apply_fn, params, clients.x[0, :256]) / 256
  return units


def round_flops(metrics, units, cfg: FedLAPConfig, problem: Problem) -> float:
  """FLOPs of one executed round: loop counts from ``RoundMetrics`` x unit FLOPs."""
  cc = cfg.client
  accesses = float(np.sum(metrics.client.real_accesses))
  outer = np.asarray(metrics.client.outer_iterations)  # (K, R_i)
  trained = np.minimum(outer, cc.max_outer - 1).sum() * cc.inner_loop
  s = cc.ipc * problem.classes_per_client
  total = accesses * (units["real_gradient"] + cc.boost_loop * units["synthetic_update"])
  total += trained * math.ceil(s / cc.model_batch_size) * units["client_step"]
  if cc.calibrate_radius:
    # Every client evaluates its padded buffer of N_max slots (or eval_size of them).
    n_eval = min(cc.calibration_eval_size or problem.records, problem.records)
    per_epoch = (
      math.ceil(s / cc.model_batch_size) * units["client_step"]
      + n_eval * units["forward_per_image"]
    )
    total += problem.num_clients * cc.calibration_epochs * per_epoch
  total += float(np.sum(metrics.server.steps)) * units["server_step"]
  return total


# ---------------------------------------------------------------------------
# Reports.
# ---------------------------------------------------------------------------


def environment() -> dict:
  return {
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "cpu_count": os.cpu_count(),
    "processor": platform.processor() or platform.machine(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "load_average": os.getloadavg(),
  }


def row(result: dict, reference: float | None = None, note: str = "") -> dict:
  flops = result.get("flops_executed", result["flops"])
  r = {k: v for k, v in result.items() if k != "output"}
  r["gflops"] = flops / 1e9
  r["gflops_per_s"] = flops / result["median_s"] / 1e9 if result["median_s"] > 0 else 0.0
  r["reference_s"] = reference
  r["ratio"] = result["median_s"] / reference if reference else None
  r["note"] = note
  return r


def markdown(rows: list[dict], title: str) -> str:
  lines = [
    f"### {title}",
    "",
    "| operation | ours (s) | compile (s) | GFLOP | GFLOP/s | temp MiB | reference (s) "
    "| ratio | note |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in rows:
    ref = f"{r['reference_s']:.3g}" if r["reference_s"] else "-"
    ratio = f"**{r['ratio']:.2f}**" if r["ratio"] else "-"
    lines.append(
      f"| {r['name']} | {r['median_s']:.3f} | {r['compile_s']:.1f} | {r['gflops']:.1f} "
      f"| {r['gflops_per_s']:.1f} | {r['temp_bytes'] / 2**20:.0f} | {ref} | {ratio} "
      f"| {r['note']} |"
    )
  return "\n".join(lines)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Modes.
# ---------------------------------------------------------------------------


PARTIAL_PATH: str | None = None  # if set, every row is appended here as a JSON line


def _save_partial(r: dict) -> None:
  if PARTIAL_PATH:
    with open(PARTIAL_PATH, "a") as f:
      f.write(json.dumps(r, default=str) + "\n")


def _op_backend(op: str, default: str) -> str:
  """The client backend of ``round:map`` / ``fedavg_round:vmap`` style ops, ``auto`` resolved."""
  return dispatch.resolve_client_backend(op.split(":")[1] if ":" in op else default)


def run_config(
  name: str,
  cfg: FedLAPConfig,
  problem: Problem,
  ops,
  *,
  repeats: int,
  impl: str,
  references: dict | None = None,
  client_backend: str = "auto",
  data: str = "float32",
  profile_dir: str | None = None,
) -> list[dict]:
  """Measures ``ops`` of one configuration; rows for the report.

  ``data``: how the clients' images are stored (:func:`random_clients`).
  ``profile_dir``: also trace one run of each op there (:func:`measure`).
  """
  timed = functools.partial(measure, profile_dir=profile_dir)
  references = references or {}
  rows = _Rows(name)
  clients = random_clients(problem, data=data)
  _, apply_fn, params = make_model(problem, impl)
  cc = cfg.client
  for op in ops:
    _log(f"[{name}] {op} ...")
    if op in ("dp_gradient", "nondp_gradient"):
      dp = op == "dp_gradient"
      for slots, label in (
        (cc.batch_size, f"{cc.batch_size} slots"),
        (cc.capacity, f"{cc.capacity}-slot Poisson buffer, {cc.batch_size} real (as in a round)"),
      ):
        fn, args = op_gradient(apply_fn, params, clients, cfg, dp=dp, slots=slots)
        res = timed(f"{op} [{slots}]", fn, args, repeats=repeats)
        res["flops_executed"] = gradient_flops(apply_fn, params, clients, cfg, slots, dp=dp)
        ref = references.get(op) if slots == cc.batch_size else None
        rows.append(row(res, ref, label))
      continue
    if op == "synthetic_update":
      fn, args = op_synthetic_update(apply_fn, params, clients, cfg, problem)
      res = timed(op, fn, args, repeats=repeats)
      rows.append(
        row(
          res,
          references.get(op),
          f"{cc.ipc * problem.classes_per_client} images, DSA '{cc.dsa_strategy}'",
        )
      )
    elif op == "server_update":
      fn, args = op_server_update(apply_fn, params, clients, cfg, problem)
      res = timed(op, fn, args, repeats=repeats)
      m = res["output"][1]
      res["flops_executed"] = res["flops"] * max(int(m.steps), 1)  # XLA counts one step
      rows.append(
        row(
          res,
          None,
          f"{int(m.epochs)} epochs, {int(m.steps)} steps of "
          f"{problem.num_clients * cc.ipc * problem.classes_per_client} "
          "images",
        )
      )
    elif op.startswith("round"):
      backend = _op_backend(op, client_backend)
      fn, args = op_round(apply_fn, params, clients, cfg, problem, client_backend=backend)
      res = timed(f"round [{backend}]", fn, args, repeats=repeats, warmup=False)
      metrics = res["output"][1]
      units = unit_flops(apply_fn, params, clients, cfg, problem)
      res["flops_executed"] = round_flops(metrics, units, cfg, problem)
      res["unit_flops"] = units
      key = "dp_round" if cc.dp is not None else "nondp_round"
      note = (
        f"client_backend={backend!r}: {_clients_note(problem)}, "
        f"{int(np.sum(metrics.client.real_accesses))} real batches, "
        f"server {int(metrics.server.epochs)} epochs; FLOPs from loop counts"
      )
      rows.append(row(res, references.get(key), note))
    elif op.split(":")[0] == "fedavg_round":
      backend = _op_backend(op, client_backend)
      fn, args = op_fedavg_round(apply_fn, params, clients, problem, client_backend=backend)
      res = timed(f"fedavg_round [{backend}]", fn, args, repeats=repeats, warmup=False)
      steps = (
        int(np.sum(res["output"][1].client.steps)) if hasattr(res["output"][1], "client") else None
      )
      if steps:  # XLA counts the local step (and its gradient's chunk loop) once
        res["flops_executed"] = steps * gradient_flops(
          apply_fn, params, clients, cfg, cc.capacity, dp=False
        )
      rows.append(
        row(
          res,
          references.get("fedavg_round"),
          f"client_backend={backend!r}: FedAvg, 1 local epoch, "
          f"{_clients_note(problem)}" + (f", {steps} local steps of B=256" if steps else ""),
        )
      )
    else:
      raise ValueError(f"--ops: unknown operation {op!r}; allowed: {OPS + ('fedavg_round',)}")
  return list(rows)


def _clients_note(problem: Problem) -> str:
  """``"5 clients x 12000"`` or ``"5 clients of 1513/1700/... records"``."""
  if problem.client_sizes is None:
    return f"{problem.num_clients} clients x {problem.records}"
  return (
    f"{problem.num_clients} clients of {'/'.join(map(str, problem.sizes))} records "
    f"(padded to {problem.records})"
  )


class _Rows(list):
  """A list of report rows that tags each with the config and saves it at once."""

  def __init__(self, config: str):
    super().__init__()
    self.config = config

  def append(self, r: dict) -> None:
    r.setdefault("config", self.config)
    super().append(r)
    _save_partial(r)
    _log(
      f"  {r['name']}: {r['median_s']:.3f} s (compile {r['compile_s']:.1f} s, "
      f"cpu {r['cpu_median_s']:.3f} s, load {r['load_before']:.1f})"
    )


def small_reference(cfg: FedLAPConfig) -> FedLAPConfig:
  """``cfg`` cut down for ``--reference --small``: server <= 2 epochs, 1 calibration epoch."""
  return dataclasses.replace(
    cfg,
    client=dataclasses.replace(cfg.client, calibration_epochs=1),
    server=dataclasses.replace(cfg.server, max_epochs=min(cfg.server.max_epochs, 2)),
  )


def reference_mode(
  repeats: int,
  impl: str,
  *,
  client_sizes=AUTHORS_CLIENT_SIZES,
  small: bool = False,
  dp_round_backends=("map", "vmap"),
) -> list[dict]:
  """The issue's table: operations and the three rounds on the authors' workload.

  ``client_sizes``: records of each client (default: the authors' 8,000 MNIST
  records in the paper's partition, :data:`AUTHORS_CLIENT_SIZES`), random
  MNIST-shaped data padded to the largest client and masked, as in a real run;
  ``None``: 5 clients x 12,000 (the earlier reference figures). The DP round runs
  with each of ``dp_round_backends`` (``map``: clients one after another,
  ``vmap``: all at once), twice each; the non-DP and FedAvg rounds once, with ``map``. ``small``: a quick check of the
  whole mode (client sizes / 4, :func:`small_reference` configs, no reference
  ratios), not a measurement.
  """
  problem = PROBLEMS["mnist"]
  if client_sizes is not None:
    if small:
      client_sizes = [max(1, -(-n // 4)) for n in client_sizes]
    problem = with_client_sizes(problem, client_sizes)
  dp_cfg, nondp_cfg = reference_dp_config(), reference_nondp_config()
  refs = REFERENCE_SECONDS
  if small:
    dp_cfg, nondp_cfg, refs = small_reference(dp_cfg), small_reference(nondp_cfg), {}
  rows = run_config(
    "mnist_dp_ref",
    dp_cfg,
    problem,
    ("dp_gradient", "nondp_gradient", "synthetic_update", "server_update"),
    repeats=repeats,
    impl=impl,
    references=refs,
  )
  rows += run_config(
    "mnist_dp_ref",
    dp_cfg,
    problem,
    tuple(f"round:{b}" for b in dp_round_backends),
    repeats=2,
    impl=impl,
    references=refs,
  )
  # The vmap backend of the non-DP round needs ~18 GB at 12,000 records per
  # client (five clients' calibration evaluations at once): --ops=round:vmap.
  rows += run_config(
    "mnist_nondp_ref",
    nondp_cfg,
    problem,
    ("round:map", "fedavg_round:map"),
    repeats=1,
    impl=impl,
    references=refs,
  )
  return rows


def ratio_lines(rows: list[dict]) -> list[str]:
  """One line per row with a reference: ``operation: reference R s, ours O s, ratio X``."""
  return [
    f"{r['config']} {r['name']}: reference {r['reference_s']:.3g} s, ours "
    f"{r['median_s']:.3g} s, ratio {r['ratio']:.2f}"
    for r in rows
    if r.get("reference_s")
  ]


def per_example_mode(repeats: int, problem_name: str = "mnist") -> list[dict]:
  """DP gradient of ConvNet-128 by every per-example method, both ConvNet implementations."""
  problem = PROBLEMS[problem_name]
  cfg = reference_dp_config()
  clients = random_clients(problem)
  rows = _Rows("per_example")
  methods = ["layerwise", "vmap", "jax_privacy"]
  try:
    import jax_privacy  # noqa: F401
  except ImportError:
    methods.remove("jax_privacy")
  variants = [(m, None) for m in methods] + [("layerwise", 64), ("vmap", 64), ("auto", None)]
  for impl in ("hybrid", "im2col", "flax"):
    _, apply_fn, params = make_model(problem, impl)
    fn, args = op_gradient(apply_fn, params, clients, cfg, dp=False, slots=256)
    res = measure(f"non-DP gradient, impl={impl}", fn, args, repeats=repeats)
    res["flops_executed"] = gradient_flops(apply_fn, params, clients, cfg, 256, dp=False)
    rows.append(row(res, REFERENCE_SECONDS["nondp_gradient"], "no clipping: the floor"))
    for method, mb in variants:
      _log(f"[per-example] impl={impl} method={method} microbatch={mb}")
      fn, args = op_gradient(
        apply_fn, params, clients, cfg, dp=True, slots=256, method=method, microbatch_size=mb
      )
      label = f"DP gradient, impl={impl}, {method}" + (f", microbatch {mb}" if mb else "")
      res = measure(label, fn, args, repeats=repeats)
      res["flops_executed"] = gradient_flops(
        apply_fn, params, clients, cfg, 256, dp=True, method=method, microbatch_size=mb
      )
      plan = per_example.auto_plan(apply_fn, params, args[2].x)
      note = "256 examples" + (
        f" (auto: {plan[0]}, microbatch {plan[1]})" if method == "auto" else ""
      )
      rows.append(row(res, REFERENCE_SECONDS["dp_gradient"], note))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="mnist_dp_ref", choices=sorted(CONFIGS))
  parser.add_argument(
    "--ops",
    default=",".join(OPS),
    help=f"comma-separated subset of {OPS + ('fedavg_round',)}; "
    "round:map / round:vmap pick the client backend",
  )
  parser.add_argument(
    "--reference", action="store_true", help="the issue's table: ratios to the authors' code"
  )
  parser.add_argument(
    "--per-example", action="store_true", help="DP gradient by every per-example method"
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--impl", default="auto", choices=models.IMPLS, help="ConvNet.impl")
  parser.add_argument(
    "--client-sizes",
    default=None,
    metavar="N1,N2,...",
    help="records of each client (padded to the largest and masked); "
    "--reference defaults to the authors' workload "
    f"{','.join(map(str, AUTHORS_CLIENT_SIZES))}; 'uniform' there: "
    "5 x 12000 (the earlier reference figures)",
  )
  parser.add_argument(
    "--small",
    action="store_true",
    help="--reference: a quick check of the whole mode (sizes / 4, server 2 "
    "epochs, 1 calibration epoch, DP round with map only, no ratios), "
    "not a measurement",
  )
  parser.add_argument("--client-backend", default="auto", choices=dispatch_lib.CLIENT_BACKENDS)
  parser.add_argument(
    "--profile",
    default=None,
    metavar="DIR",
    help="named configs: trace one extra run of each op into DIR/<op> "
    "(jax.profiler; view with XProf or TensorBoard)",
  )
  parser.add_argument(
    "--data",
    default="float32",
    choices=DATA_KINDS,
    help="named configs: client images as float32 inputs or uint8 pixels "
    "normalised as they are read",
  )
  parser.add_argument("--json", default=None, help="write the results here")
  args = parser.parse_args(argv)
  global PARTIAL_PATH
  if args.json:
    PARTIAL_PATH = args.json + ".partial.jsonl"

  try:
    sizes = (
      None if args.client_sizes in (None, "uniform") else parse_client_sizes(args.client_sizes)
    )
  except ValueError as e:
    parser.error(str(e))  # exit status 2
  if args.client_sizes == "uniform" and not args.reference:
    parser.error("--client-sizes 'uniform' is for --reference only; allowed elsewhere: N1,N2,...")
  if args.small and not args.reference:
    parser.error("--small is for --reference only")

  env = environment()
  _log(f"environment: {env}")
  if args.reference:
    if args.client_sizes is None:
      sizes = AUTHORS_CLIENT_SIZES
    rows = reference_mode(
      args.repeats,
      args.impl,
      client_sizes=sizes,
      small=args.small,
      dp_round_backends=("map",) if args.small else ("map", "vmap"),
    )
    title = (
      "Reference settings, "
      + (f"client sizes {','.join(map(str, sizes))}" if sizes else "5 x 12000 records")
      + (", --small (a check, not a measurement)" if args.small else "")
    )
  elif args.per_example:
    rows, title = per_example_mode(args.repeats), "Per-example DP gradient, ConvNet-128, MNIST"
  else:
    make, problem_name = CONFIGS[args.config]
    cfg = make()
    problem = PROBLEMS[problem_name]
    if sizes:
      problem = with_client_sizes(problem, sizes)
    ops = [o for o in args.ops.split(",") if o]
    rows = run_config(
      args.config,
      cfg,
      problem,
      ops,
      repeats=args.repeats,
      impl=args.impl,
      client_backend=args.client_backend,
      data=args.data,
      profile_dir=args.profile,
      references=REFERENCE_SECONDS if args.config.endswith("_ref") else None,
    )
    title = f"{args.config} data={args.data}"
  env["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  env["load_average_end"] = os.getloadavg()
  table = markdown(rows, title)
  print(table)
  lines = ratio_lines(rows)
  if lines:
    print("\n" + "\n".join(lines))
  print(
    f"\n{env['date']}, jax {env['jax']} on {env['backend']} ({env['device_kind']}, "
    f"{env['cpu_count']} CPUs), peak RSS {env['peak_rss_mib']:.0f} MiB, "
    f"load average {env['load_average'][0]:.2f} -> {env['load_average_end'][0]:.2f}"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"environment": env, "title": title, "rows": rows}, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
