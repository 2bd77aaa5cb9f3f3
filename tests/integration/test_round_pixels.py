"""Rounds on client data kept as stored pixels (uint8), the normalisation fused into every
read, equal the rounds on the same data normalised up front as float32: a FedLAP round
(real-image init, real batches, radius calibration), a FedLAP-DP round (private real
gradients) and a FedAvg round. The pixel data themselves: ``tests/unit/test_pixels.py``.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest

from fedlap_jax import baselines, rounds
from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.methods.fedlap.state import init_state
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import count_params
from fedlap_jax.methods.fedlap.radius import calibrate_radius


def test_calibration_reads_pixels_through_the_preprocess(
  pixel_and_float_clients, linear_apply_fn, linear_params
):
  pixels, floats = pixel_and_float_clients
  syn_x = jax.random.normal(jax.random.PRNGKey(0), (20, 8, 8, 1))
  syn_y = jnp.arange(20) % 10
  syn_mask = jnp.ones(20, bool)
  syn = SyntheticSet(syn_x, syn_y, syn_mask)
  one = jax.tree.map(lambda a: a[1], pixels)
  ref = jax.tree.map(lambda a: a[1], floats)
  for eval_size in (None, 64):
    got = calibrate_radius(
      jax.random.PRNGKey(1),
      linear_apply_fn,
      linear_params,
      syn,
      one,
      learning_rate=0.1,
      max_radius=10.0,
      epochs=4,
      batch_size=8,
      eval_size=eval_size,
    )
    want = calibrate_radius(
      jax.random.PRNGKey(1),
      linear_apply_fn,
      linear_params,
      syn,
      ref,
      learning_rate=0.1,
      max_radius=10.0,
      epochs=4,
      batch_size=8,
      eval_size=eval_size,
    )
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


SMALL = ClientConfig(
  ipc=2,
  iterations=1,
  max_outer=2,
  batch_loop=2,
  boost_loop=2,
  inner_loop=1,
  batch_size=32,
  radius=5.0,
  calibration_epochs=3,
)


# Non-DP with DSA on the client: colour (which depends on the pixel values) and flips. The
# server trains on synthetic images only, which hold floats either way.
NONDP = FedLAPConfig(
  client=dataclasses.replace(SMALL, dsa_strategy="color_flip"),
  server=ServerConfig(max_epochs=3, dsa_strategy=""),
  rounds=2,
)


DP = FedLAPConfig(
  client=dataclasses.replace(
    SMALL,
    calibrate_radius=False,
    dsa_strategy="",
    dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5),
  ),
  server=ServerConfig(radius_strategy="constant", max_epochs=3),
  rounds=2,
  synthetic_init="noise",
)


# A FedLAP round amplifies the last bits in which the two programs may differ (the fused
# normalisation of a pixel read against the up-front float copy): compiled with XLA's default
# emitters, under which they agree (conftest's compiler note).
@pytest.mark.bitwise
@pytest.mark.parametrize("config", [NONDP, DP], ids=["fedlap", "fedlap_dp"])
def test_fedlap_round_on_pixels_equals_the_round_on_floats(
  config, pixel_and_float_clients, linear_apply_fn, linear_params
):
  pixels, floats = pixel_and_float_clients
  round_fn = rounds.make_round_fn(REGISTRY["fedlap"], config, ModelFns(linear_apply_fn))
  outs = []
  for clients in (pixels, floats):
    state = init_state(jax.random.PRNGKey(2), linear_params, clients, config)
    outs.append(round_fn(state, clients))
  (s_pix, m_pix), (s_flt, m_flt) = outs
  assert int(jnp.sum(m_pix.client.real_accesses)) > 0
  chex.assert_trees_all_close(s_pix, s_flt, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(m_pix, m_flt, rtol=1e-4, atol=1e-5)
  # The round really moved something (a test of two no-ops would pass too).
  assert (
    float(
      jnp.max(
        jnp.abs(
          s_pix.synthetic.x
          - init_state(jax.random.PRNGKey(2), linear_params, pixels, config).synthetic.x
        )
      )
    )
    > 1e-3
  )


def test_fedavg_round_on_pixels_equals_the_round_on_floats(
  pixel_and_float_clients, linear_apply_fn, linear_params
):
  pixels, floats = pixel_and_float_clients
  config = baselines.baseline_config(
    "fedavg",
    rounds=2,
    learning_rate=0.1,
    local_epochs=1,
    batch_size=32,
    prox_mu=0.0,
    dp=None,
    max_client_size=int(jnp.max(jnp.sum(pixels.mask, axis=1))),
  )
  alg = rounds.algorithm(
    REGISTRY["fedavg"],
    config,
    ModelFns(linear_apply_fn),
    RunFacts((8, 8, 1), 5, count_params(linear_params), 2),
  )
  outs = [alg.round(alg.init(jax.random.PRNGKey(3), linear_params, c), c) for c in (pixels, floats)]
  chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))), alg.params_of(outs[0][0]), linear_params
  )
  assert max(jax.tree.leaves(moved)) > 1e-4
