"""The bound on an honest client's update: the optimiser's algebra, and real DP clients under it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import dp_below_floor, raises_field

from fedlap_jax import baselines, optim, update_bounds
from fedlap_jax.client_data import ClientData
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import RunFacts
from fedlap_jax.methods import REGISTRY, fedavg


@pytest.mark.parametrize(
  "prox_mu, momentum, weight_decay, nesterov",
  [
    (0.0, 0.0, 0.0, False),
    (0.3, 0.0, 0.0, False),
    (0.0, 0.9, 0.0, False),
    (0.2, 0.5, 0.1, False),
    (0.0, 0.9, 0.0, True),
    (0.2, 0.5, 0.1, True),
  ],
)
def test_the_coefficients_are_the_local_optimisers_linear_response(
  prox_mu, momentum, weight_decay, nesterov
):
  """delta_T of the written-out recurrence (SGD + momentum (Nesterov's or heavy-ball) + weight
  decay + FedProx, as fedlap_jax.optim and baselines.client_update apply them) is
  sum_j c_j (g_j + lambda x)."""
  rng = np.random.default_rng(0)
  eta, steps, x = 0.3, 7, rng.normal(size=5)
  g = rng.normal(size=(steps, 5))
  w, trace = x.copy(), np.zeros(5)
  for s in range(steps):
    d = g[s] + 2 * prox_mu * (w - x) + weight_decay * w
    trace = d + momentum * trace
    w = w - eta * (d + momentum * trace if nesterov else trace)
  c = update_bounds.step_coefficients(
    eta, steps, prox_mu=prox_mu, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
  )
  want = sum(cj * (gj + weight_decay * x) for cj, gj in zip(c, g))
  np.testing.assert_allclose(w - x, want, rtol=1e-12, atol=1e-12)


def test_the_bound_grows_with_what_moves_a_client():
  base = dict(
    learning_rate=0.1,
    steps=10,
    batch_size=32,
    l2_clip_norm=1.0,
    noise_multiplier=1.0,
    num_params=1000,
  )
  b = update_bounds.local_sgd_update_bound(**base)
  for change in (
    dict(learning_rate=0.2),
    dict(steps=20),
    dict(l2_clip_norm=2.0),
    dict(noise_multiplier=2.0),
    dict(num_params=4000),
    dict(false_refusal=1e-15),
  ):
    assert update_bounds.local_sgd_update_bound(**{**base, **change}) > b, change
  # eta = 0: an honest client sends x itself; only the rounding slack of ||x|| remains.
  zero = update_bounds.local_sgd_update_bound(**{**base, "learning_rate": 0.0, "params_norm": 10.0})
  assert 0 < zero < 1e-4
  with raises_field("false_refusal"):
    update_bounds.local_sgd_update_bound(**base, false_refusal=0.0)


@pytest.mark.parametrize(
  "spec",
  [
    optim.Optimizer(name="adam"),
    optim.Optimizer(name="adam", b1=0.99, b2=0.9),  # b1^2 > b2: memory grows with t
    optim.Optimizer(name="yogi"),
    optim.Optimizer(name="yogi", b1=0.5, b2=0.5, initial_accumulator=2.0),
    optim.Optimizer(name="adagrad"),
  ],
  ids=["adam", "adam_b1_above_b2", "yogi", "yogi_half", "adagrad"],
)
def test_normalised_steps_stay_below_their_per_coordinate_bound(spec):
  """optax's own steps (spec.direction(), fresh state) on 2,000 one-coordinate gradient
  sequences (random signs, magnitudes from 1e-6 to 1e6, and for Adam the Cauchy-Schwarz
  extremal g_s ~ (b2 / b1)^s): every |u_t| is at most A_t of normalised_step_bounds, and the
  largest reaches it (Adam, Adagrad) or a fair share of it (Yogi, whose bound is looser)."""
  steps, n = 30, 2000
  rng = np.random.default_rng(0)
  g = rng.choice([-1.0, 1.0], size=(steps, n)) * 10.0 ** rng.uniform(-6, 6, size=(steps, n))
  g[:, :50] = 10.0 ** rng.uniform(-6, 6, size=(steps, 50))  # one sign
  if spec.name == "adam":
    g[:, 0] = 1e3 * (spec.b2 / spec.b1) ** np.arange(steps)
  opt = spec.direction()
  state = opt.init(jnp.zeros(n, jnp.float32))
  a = np.asarray(
    update_bounds.normalised_step_bounds(
      spec.name,
      steps,
      b1=spec.b1 or 0.0,
      b2=spec.b2 or 0.0,
      initial_accumulator=spec.initial_accumulator or 0.0,
    )
  )
  ratios = []
  for t in range(steps):
    u, state = opt.update(jnp.asarray(g[t], jnp.float32), state)
    ratios.append(np.abs(np.asarray(u, np.float64)) / a[t])
  most = float(np.max(ratios))
  assert most <= 1.0 + update_bounds.FLOAT_SLACK, most
  assert most > (0.2 if spec.name == "yogi" else 0.99), most


def test_no_normalised_bound_where_the_second_moment_forgets():
  """b2 = 0: v holds the last gradient alone, m older ones: no step bound (None), unless m
  remembers nothing either (Adam with b1 = 0: |u| <= 1)."""
  assert update_bounds.normalised_step_bounds("adam", 5, b1=0.9, b2=0.0) is None
  assert update_bounds.normalised_step_bounds("yogi", 5, b1=0.0, b2=0.0) is None
  assert update_bounds.normalised_step_bounds("adam", 3, b1=0.0, b2=0.0) == [1.0] * 3


def _linear(params, x):
  return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]


ADAM = optim.Optimizer(name="adam")
# No initial accumulator: steps of about eta per coordinate from the first.
YOGI = optim.Optimizer(name="yogi", initial_accumulator=0.0)
ADAGRAD = optim.Optimizer(name="adagrad", initial_accumulator=0.0)
NESTEROV = optim.Optimizer(momentum=0.9, nesterov=True, weight_decay=0.01)
# (method, sigma, C, aligned records, the least ratio of the largest honest norm to the bound,
# the client optimiser)
HONEST = {
  "dp_fedavg_aligned": ("dp_fedavg", 1.0, 0.1, True, 0.4, optim.SGD),
  "dp_fedavg_low_noise_aligned": ("dp_fedavg", 0.05, 0.1, True, 0.4, optim.SGD),
  "dp_fedprox_aligned": ("dp_fedprox", 1.0, 0.5, True, 0.3, optim.SGD),  # gradients shrink below C
  # Random records: per-example gradients point every way, far from the worst case.
  "dp_fedavg_random": ("dp_fedavg", 1.0, 0.1, False, 0.1, optim.SGD),
  "dp_fedavg_nesterov": ("dp_fedavg", 0.05, 0.1, True, 0.3, NESTEROV),
  # Normalised steps: aligned low-noise gradients keep one sign, each coordinate moves ~eta.
  "dp_fedavg_adam": ("dp_fedavg", 0.05, 0.1, True, 0.3, ADAM),
  # (their model saturates within a few steps at eta = 0.5: the later steps shrink below eps,
  # or below the accumulated squares; test_normalised_steps_stay_below_their_per_coordinate_bound
  # shows the bound met)
  "dp_fedprox_yogi": ("dp_fedprox", 0.05, 1.0, True, 0.02, YOGI),
  "dp_fedavg_adagrad": ("dp_fedavg", 0.05, 1.0, True, 0.1, ADAGRAD),
}


@pytest.mark.parametrize("case", list(HONEST))
def test_honest_dp_clients_stay_below_the_bound_and_it_is_not_loose(case):
  """64 seeds of a real DP client (baselines.client_step, the family's plain SGD): every
  update norm is below fedavg.update_bound's. The bound holds for any records, so it is
  tight where every per-example gradient points one way (identical records, clipped to C):
  there the largest norm is a fair share of it."""
  method, sigma, clip, aligned, least, spec = HONEST[case]
  n, b, seeds = 64, 16, 64
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 10, size=n).astype(np.int32)
  if aligned:
    x, y = np.broadcast_to(x[:1], x.shape).copy(), np.zeros_like(y)
  data = ClientData(x, y, np.ones(n, bool))
  params = {
    "w": jnp.asarray(rng.normal(size=(64, 10)).astype(np.float32) * 0.1),
    "b": jnp.zeros(10, jnp.float32),
  }
  config = baselines.baseline_config(
    method,
    rounds=2,
    learning_rate=0.5,
    batch_size=b,
    dp=dp_below_floor(sigma, l2_clip_norm=clip, delta=1e-5),
    local_epochs=2,
    max_client_size=n,
    client_optimizer=spec,
  )
  lr = jnp.float32(0.5)

  def norm(key):
    y, _ = baselines.client_step(key, _linear, params, data, config, learning_rate=lr)
    return jnp.sqrt(
      sum(jnp.sum((a - p) ** 2) for a, p in zip(jax.tree.leaves(y), jax.tree.leaves(params)))
    )

  norms = np.asarray(jax.jit(jax.vmap(norm))(jax.random.split(jax.random.key(0), seeds)))
  facts = RunFacts((8, 8, 1), 1, 64 * 10 + 10, 10, n)
  bound = REGISTRY[method].update_bound(config, facts)(fedavg.Message(params, lr))
  ratio = float(norms.max() / bound)
  assert np.isfinite(norms).all() and least < ratio < 1.0, (
    f"largest honest norm / bound = {ratio:.3f} (norms {norms.min():.4g}..{norms.max():.4g}, "
    f"bound {bound:.4g})"
  )


def test_no_bound_without_dp_or_with_an_optimiser_whose_steps_have_none():
  import optax

  config = baselines.baseline_config(
    "fedavg", rounds=2, learning_rate=0.1, batch_size=16, dp=None, max_client_size=64
  )
  facts = RunFacts((8, 8, 1), 1, 650, 10, 64)
  assert REGISTRY["fedavg"].update_bound(config, facts) is None
  # An optax transformation is opaque: only a config's spec is bounded.
  assert fedavg.family("dp_fedavg", client_optimizer=optax.scale_by_adam()).update_bound is None
  assert REGISTRY["scaffold"].update_bound is None

  def dp(spec):
    return baselines.baseline_config(
      "dp_fedavg",
      rounds=2,
      learning_rate=0.1,
      batch_size=16,
      dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5),
      max_client_size=64,
      client_optimizer=spec,
    )

  forgets = optim.Optimizer(name="adam", b2=0.0)
  assert REGISTRY["dp_fedavg"].update_bound(dp(forgets), facts) is None
  message = fedavg.Message({"w": np.ones((650,), np.float32)}, np.float32(0.1))

  def bound(spec):
    return REGISTRY["dp_fedavg"].update_bound(dp(spec), facts)(message)

  plain = bound(optim.SGD)
  assert bound(optim.Optimizer(momentum=0.9)) > 3 * plain
  assert bound(optim.Optimizer(momentum=0.9, nesterov=True)) > 3 * plain
  # Adagrad: at most eta per coordinate and step, over the T steps of the config.
  steps = dp(optim.SGD).local.scheduled_steps()
  want = 0.1 * np.sqrt(650) * steps
  assert want < bound(optim.Optimizer(name="adagrad")) < want * (1 + 2 * update_bounds.FLOAT_SLACK)
