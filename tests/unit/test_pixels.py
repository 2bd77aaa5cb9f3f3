"""Client data kept as stored pixels (uint8) with the normalisation fused into every read.

Every result must equal the one from the same data normalised up front as
float32: a FedLAP round (real-image init, real batches, radius calibration), a
FedLAP-DP round (private real gradients) and a FedAvg round.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import datasets

from fedlap_jax import baselines
from fedlap_jax.client_data import ClientData, SyntheticSet, pixel_normalisation, stack_clients
from fedlap_jax.config import ClientConfig, DPConfig, FedLAPConfig, ServerConfig
from fedlap_jax.federated import init_state, make_round_fn
from fedlap_jax.models import count_params
from fedlap_jax.radius import calibrate_radius

from conftest import partition

# Its module fixtures run once: under xdist (-n 2) all of this file goes to one worker.
pytestmark = pytest.mark.xdist_group("pixels")

PIXEL_MAX = 16.0  # digits' pixels are integers 0..16


@pytest.fixture(scope="module")
def pixel_parts():
  """Five clients of raw digits pixels, ``uint8`` in 0..16, and their mean / std."""
  data = datasets.load_digits()
  x = data.images.astype(np.uint8)[..., None]
  y = data.target.astype(np.int32)
  unit = x / PIXEL_MAX
  mean, std = unit.mean(axis=(0, 1, 2)), unit.std(axis=(0, 1, 2))
  return partition(x, y), mean, std


@pytest.fixture(scope="module")
def pixel_and_float_clients(pixel_parts):
  """The same clients twice: uint8 pixels + normalisation, and float32 model inputs.

  The float copy is normalised up front with the same XLA arithmetic. (NumPy's
  ``x * scale + offset`` differs by one float32 ulp where XLA fuses a
  multiply-add, and a FedLAP-DP round, image step 100 on a cosine matching
  loss, amplifies that to visible differences in the synthetic images.)
  """
  parts, mean, std = pixel_parts
  scale, offset = pixel_normalisation(mean, std, pixel_max=PIXEL_MAX)
  xs, ys = [x for x, _ in parts], [y for _, y in parts]
  pixels = stack_clients(xs, ys, pixel_scale=scale, pixel_offset=offset)
  floats = ClientData(jax.jit(jax.vmap(lambda c: c.normalise(c.x)))(pixels), pixels.y, pixels.mask)
  np.testing.assert_allclose(  # the up-front copy is the formula, to float32 rounding
    np.asarray(floats.x[0, : len(xs[0])]),
    np.asarray(xs[0], np.float32) * np.asarray(scale) + np.asarray(offset),
    atol=1e-6,
  )
  return pixels, floats


def test_pixel_normalisation_matches_the_formula(pixel_parts):
  parts, mean, std = pixel_parts
  scale, offset = pixel_normalisation(mean, std, pixel_max=PIXEL_MAX)
  chex.assert_shape([scale, offset], (1,))
  chex.assert_type([scale, offset], jnp.float32)
  x = parts[0][0]
  data = ClientData(
    jnp.asarray(x), jnp.zeros(len(x), jnp.int32), jnp.ones(len(x), bool), scale, offset
  )
  idx = jnp.array([3, 0, 7, 3])
  got = jax.jit(ClientData.images)(data, idx)
  chex.assert_shape(got, (4, 8, 8, 1))
  chex.assert_type(got, jnp.float32)
  want = (x[np.asarray(idx)] / PIXEL_MAX - mean) / std
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  # uint8 pixels of CIFAR-10's statistics: 0 and 255 map to (0 - m) / s and (1 - m) / s.
  s, o = pixel_normalisation([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010])
  np.testing.assert_allclose(
    np.asarray(o),
    -np.array([0.4914, 0.4822, 0.4465]) / np.array([0.2023, 0.1994, 0.2010]),
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    np.asarray(255 * s + o),
    (1 - np.array([0.4914, 0.4822, 0.4465])) / np.array([0.2023, 0.1994, 0.2010]),
    rtol=1e-6,
  )
  # Float model inputs without a normalisation are read as they are.
  plain = ClientData(jnp.asarray(x, jnp.float32), data.y, data.mask)
  chex.assert_trees_all_equal(plain.images(idx), jnp.asarray(x, jnp.float32)[idx])


def test_stacked_pixels_stay_uint8_at_a_quarter_of_the_memory(pixel_and_float_clients):
  pixels, floats = pixel_and_float_clients
  chex.assert_type(pixels.x, jnp.uint8)
  chex.assert_shape([pixels.pixel_scale, pixels.pixel_offset], (5, 1))
  assert pixels.x.nbytes * 4 == floats.x.nbytes
  chex.assert_trees_all_equal(pixels.mask, floats.mask)
  assert floats.pixel_scale is None and floats.pixel_offset is None


@pytest.mark.parametrize(
  "kwargs,pattern",
  [
    (dict(), r"dtype uint8 need pixel_scale and pixel_offset"),
    (dict(pixel_scale=[1.0]), r"pixel_scale and pixel_offset must be given together"),
    (
      dict(pixel_scale=[1.0, 2.0], pixel_offset=[0.0, 0.0]),
      r"pixel_scale has shape \(2,\); allowed: \(1,\)",
    ),
  ],
)
def test_stack_clients_refuses_pixels_without_a_valid_normalisation(kwargs, pattern):
  x = np.zeros((3, 8, 8, 1), np.uint8)
  with pytest.raises(ValueError, match=pattern):
    stack_clients([x], [np.zeros(3, np.int32)], **kwargs)
  with pytest.raises(ValueError, match=r"differ in dtype or shape"):
    stack_clients([x, x.astype(np.float32)], [np.zeros(3), np.zeros(3)])


@pytest.mark.parametrize(
  "mean,std,pattern",
  [([0.5], [0.0], r"std=\[0\.0\] is invalid"), ([0.5, 0.5], [0.2], r"both be \(C,\) vectors")],
)
def test_pixel_normalisation_refuses_bad_statistics(mean, std, pattern):
  with pytest.raises(ValueError, match=pattern):
    pixel_normalisation(mean, std)


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
  round_fn = make_round_fn(linear_apply_fn, config)
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
  alg = baselines.algorithm(
    linear_apply_fn,
    config,
    num_clients=5,
    image_shape=(8, 8, 1),
    num_params=count_params(linear_params),
  )
  outs = [alg.round(alg.init(jax.random.PRNGKey(3), linear_params, c), c) for c in (pixels, floats)]
  chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))), alg.params_of(outs[0][0]), linear_params
  )
  assert max(jax.tree.leaves(moved)) > 1e-4
