"""How exact the synthetic-image gradient is in float32, and how sensitive a round is.

Two measurements on scikit-learn's digits (offline), printed as text:

1. **Precision.** The gradient of the matching distance with respect to 20
   synthetic images, computed in float32 and in float64 (the same inputs),
   for a DP real gradient (clipped, noised) and a non-DP one, with the
   ConvNet's convolution biases (``conv_bias=True``, the authors' model) and
   without (``False``, the same function: instance norm removes a per-channel
   constant). A convolution bias before instance norm has a gradient that is
   zero in exact arithmetic and float noise in float32; the cosine distance
   divides by its tiny norm, and under DP the noised real gradient does not
   cancel it.
2. **Sensitivity.** One FedLAP-DP round of the ``quickstart:dp_loops`` setting from
   the same state with the parameters scaled by ``1 + eps``: how far the
   synthetic images move. This is why runs on different device or thread
   counts agree per round to float precision but not after several rounds.

  python -m benchmarks.matching_precision [--skip-sensitivity]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import matching, models, privacy


def _digits(n: int):
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top

  d = load_digits()
  x = (d.images[:n, :, :, None] / 16.0 - 0.3) / 0.4
  return jnp.asarray(x, jnp.float32), jnp.asarray(d.target[:n])


def image_gradient(apply_fn, params, g_real, x_syn, y_syn, dtype):
  """``d L_dis / d x_syn`` with every input cast to ``dtype``; float64 numpy.

  For ``jnp.float64`` call it inside ``with jax.enable_x64(True):``.
  """
  cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)  # noqa: E731
  params, g_real, x_syn = cast(params), cast(g_real), x_syn.astype(dtype)

  def loss(x):
    g_syn = privacy.real_gradient(apply_fn, params, x, y_syn, jnp.zeros(len(y_syn), bool))
    return matching.matching_distance(g_real, g_syn)

  return np.asarray(jax.jit(jax.grad(loss))(x_syn), np.float64)


def precision() -> None:
  x, y = _digits(64)
  x_syn = jax.random.normal(jax.random.key(2), (20, 8, 8, 1), jnp.float32)
  y_syn = jnp.repeat(jnp.arange(10), 2)
  print("| conv_bias | real gradient | rel. error float32 vs float64 | norm (float64) |")
  print("|---|---|---:|---:|")
  for conv_bias in (True, False):
    model, params = models.init_convnet(
      jax.random.key(0), (8, 8, 1), width=32, depth=2, conv_bias=conv_bias
    )
    apply_fn = lambda p, v, m=model: m.apply({"params": p}, v)  # noqa: E731
    clipped, _ = privacy.clipped_gradient_sum(
      apply_fn, params, x, y, jnp.zeros(len(y), bool), l2_clip_norm=1.0
    )
    g_dp = privacy.privatise(
      jax.random.key(1), clipped, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=64.0
    )
    g_plain = privacy.real_gradient(apply_fn, params, x, y, jnp.zeros(len(y), bool))
    for name, g in (("DP (C 1, sigma 1)", g_dp), ("non-DP", g_plain)):
      exact = image_gradient(apply_fn, params, g, x_syn, y_syn, jnp.float64)
      single = image_gradient(apply_fn, params, g, x_syn, y_syn, jnp.float32)
      err = np.linalg.norm(single - exact) / np.linalg.norm(exact)
      print(f"| {conv_bias} | {name} | {err:.2e} | {np.linalg.norm(exact):.4f} |")


def sensitivity() -> None:
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  setup = build.build_run(quickstart.dp_config())
  alg, state, clients = setup.algorithm, setup.state, setup.clients

  def synthetic_after_round(st):
    return np.asarray(alg.round(st, clients)[0].synthetic.x)

  base = synthetic_after_round(state)
  print("\n| parameter perturbation | max change of the synthetic images | max image value |")
  print("|---:|---:|---:|")
  for eps in (0.0, 1e-7, 1e-5):
    moved = state._replace(params=jax.tree.map(lambda a: a * (1 + eps), state.params))
    diff = np.abs(synthetic_after_round(moved) - base).max()
    print(f"| {eps:g} | {diff:.3g} | {np.abs(base).max():.3g} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--skip-sensitivity", action="store_true", help="only the float32/float64 comparison"
  )
  args = parser.parse_args(argv)
  with jax.enable_x64(True):
    precision()
  if not args.skip_sensitivity:
    sensitivity()


if __name__ == "__main__":
  main()
