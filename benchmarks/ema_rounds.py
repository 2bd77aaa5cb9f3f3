"""What an exponential moving average of the global model would give a finished run.

  python -m benchmarks.ema_rounds RUN_DIR [--decay 0.5 0.7 0.9]

``RUN_DIR`` is a work dir of ``python -m experiments.run`` that kept a checkpoint of every
round (``--config.checkpoint_every=1 --config.keep_checkpoints=R`` for ``R`` rounds). Each
round's global model is released (DP output, or computed from DP output only), so an average
of them is post-processing: no privacy cost, the same guarantee. For each decay ``beta`` the
average ``a_1 = x_1``, ``a_m = beta a_{m-1} + (1 - beta) x_m`` over the rounds is evaluated
on the run's test split (a validation split where the run's data has one in its place),
beside the last round's own model. One JSON line per run is printed; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections

from experiments import audit
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import normalise_pixels
from fedlap_jax.training import evaluate
from fedlap_runs import checkpointing


def ema_accuracies(run_dir: Path, decays: list[float]) -> dict:
  """``{"rounds", "last", "ema": {decay: accuracy}}`` of the run in ``run_dir``."""
  cfg = ml_collections.ConfigDict(json.loads((run_dir / "config.json").read_text()))
  built = audit.rebuild_run(cfg)
  ckpt = checkpointing.Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
  try:
    rounds = ckpt.all_rounds()
    if rounds != list(range(1, int(cfg.rounds) + 1)):
      field = "checkpoint_every" if cfg.checkpoint_every != 1 else "keep_checkpoints"
      raise ConfigError(
        field,
        cfg[field],
        f"1 and keep_checkpoints={cfg.rounds}, so that every round 1..{cfg.rounds} is kept "
        f"({run_dir} keeps rounds {rounds})",
      )
    params = [built.algorithm.params_of(ckpt.restore(built.template, m)[0]) for m in rounds]
  finally:
    ckpt.close()
  ds = built.dataset
  x, y = jnp.asarray(ds.x_test), jnp.asarray(ds.y_test)
  pre = lambda a: normalise_pixels(
    a, pixel_scale=jnp.asarray(ds.pixel_scale), pixel_offset=jnp.asarray(ds.pixel_offset)
  )
  # The test split is an argument, not a constant of the program (XLA would fold it).
  evaluated = jax.jit(lambda p, x, y: evaluate(built.apply_fn, p, x, y, preprocess=pre).accuracy)
  accuracy = lambda p: evaluated(p, x, y)
  out = {"rounds": len(rounds), "last": float(accuracy(params[-1])), "ema": {}}
  for beta in decays:
    avg = params[0]
    for p in params[1:]:
      avg = jax.tree.map(lambda a, b: beta * a + (1 - beta) * b, avg, p)
    out["ema"][beta] = float(accuracy(avg))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dirs", nargs="+", type=Path)
  parser.add_argument("--decay", nargs="+", type=float, default=[0.5, 0.7, 0.9])
  args = parser.parse_args(argv)
  for beta in args.decay:
    if not 0 <= beta < 1:
      parser.error(f"--decay {beta} is invalid; allowed: numbers in [0, 1)")
  for run_dir in args.run_dirs:
    try:
      out = ema_accuracies(run_dir, args.decay)
    except ConfigError as e:
      print(f"ema_rounds: {e}", file=sys.stderr)
      return 2
    print(json.dumps({"run_dir": run_dir.name, **out}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
