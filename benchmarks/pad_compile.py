"""Compilations of a loop over single clients, with and without padding to one capacity.

  python -m benchmarks.pad_compile [--sizes 300,320,350,375] [--dp]

A user's loop calls the jitted :func:`fedlap_jax.client_step` once per client (as a Flower
client, or their own driver does). Each client's records have their own ``N_k``; unpadded,
every distinct ``N_k`` is a new shape and a new compilation. Padded to one capacity with
:func:`fedlap_jax.pad_client` (and the synthetic sets to one size with
:func:`fedlap_jax.client_synthetic`'s ``max_classes``), the loop compiles once.

The model is the ConvNet of width 32 and depth 2 on random 8x8x1 images of two classes per
client (no data set is read), FedLAP-DP loops of the quickstart's size (``R_i = 1``,
``max_outer = 2``, ``batch_loop = 5``, ``R_b = 3``, ``R_l = 1``, ``B = 32``). Prints, for
each way, the XLA compilations and the seconds spent compiling (``jax.monitoring``'s
``backend_compile`` events) over one pass of the loop, then the time of a second pass.
"""

from __future__ import annotations

import argparse
import sys
import time

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _sizes(text: str) -> list[int]:
  try:
    sizes = [int(s) for s in text.split(",")]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 40:
    print(f"--sizes {text!r} is invalid; allowed: comma-separated integers >= 40", file=sys.stderr)
    raise SystemExit(2)
  return sizes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="300,320,350,375")
  parser.add_argument("--dp", action="store_true", help="FedLAP-DP (sigma 1, C 1)")
  args = parser.parse_args(argv)
  sizes = _sizes(args.sizes)

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import fedlap_jax as fl  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  clients = []
  for k, n in enumerate(sizes):
    y = np.repeat(np.array([2 * k % 10, (2 * k + 1) % 10]), [n // 2, n - n // 2])
    clients.append((rng.normal(size=(n, 8, 8, 1)).astype(np.float32), y.astype(np.int32)))
  model = fl.ConvNet(num_classes=10, width=32, depth=2)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]

  def apply_fn(p, x):
    return model.apply({"params": p}, x)

  client = fl.ClientConfig(
    ipc=5,
    iterations=1,
    max_outer=2,
    batch_loop=5,
    boost_loop=3,
    inner_loop=1,
    batch_size=32,
    radius=10.0,
    mse_weight=0.0,
    calibrate_radius=False,
    dsa_strategy="",
  )
  config = fl.FedLAPConfig(
    client=client,
    server=fl.ServerConfig(radius_strategy="constant"),
    rounds=2,
    synthetic_init="noise",
  )
  if args.dp:
    config = config.with_dp(fl.DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5))
  step = jax.jit(fl.client_step, static_argnames=("apply_fn", "config"))

  def inputs(padded: bool):
    out = []
    for k, (x, y) in enumerate(clients):
      if padded:
        data = fl.pad_client(x, y, capacity=max(sizes), num_classes=10)
      else:
        data = fl.ClientData(jnp.asarray(x), jnp.asarray(y), jnp.ones(len(y), bool))
      out.append((data, fl.client_synthetic(jax.random.key(k), data, client.ipc, max_classes=2)))
    return out

  durations: list[float] = []

  def listen(event, duration_secs, **kwargs):
    del kwargs
    if event == COMPILE_EVENT:
      durations.append(duration_secs)

  jax.monitoring.register_event_duration_secs_listener(listen)
  print(
    f"clients of {sizes} records, {'FedLAP-DP' if args.dp else 'FedLAP'}, jax {jax.__version__}"
  )
  for padded in (False, True):
    jax.clear_caches()
    data = inputs(padded)
    durations.clear()
    t0 = time.perf_counter()
    for k, (d, s) in enumerate(data):
      out = step(jax.random.key(10 + k), apply_fn, params, s, d, config, learning_rate=0.05)
      jax.block_until_ready(out)
    first = time.perf_counter() - t0
    compiles, compiling = len(durations), sum(durations)
    t0 = time.perf_counter()
    for k, (d, s) in enumerate(data):
      jax.block_until_ready(
        step(jax.random.key(20 + k), apply_fn, params, s, d, config, learning_rate=0.05)
      )
    second = time.perf_counter() - t0
    way = f"padded to {max(sizes)}" if padded else "unpadded"
    print(
      f"{way:>15}: {compiles} compilations, {compiling:.1f} s compiling; first pass {first:.1f} s, "
      f"second pass {second:.1f} s"
    )
  jax.monitoring.unregister_event_duration_listener(listen)
  return 0


if __name__ == "__main__":
  sys.exit(main())
