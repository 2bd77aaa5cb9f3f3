"""Client data kept as stored pixels (uint8) with the normalisation fused into every read:
the normalisation's formula, the stacked memory and the refusals of bad statistics. Rounds on
pixels equal rounds on floats: ``tests/integration/test_round_pixels.py``.
"""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax.client_data import ClientData, pixel_normalisation, stack_clients

from conftest import PIXEL_MAX, raises_field


def test_pixel_normalisation_matches_the_formula(pixel_parts):
  parts, mean, std = pixel_parts
  scale, offset = pixel_normalisation(mean, std, pixel_max=PIXEL_MAX)
  chex.assert_shape([scale, offset], (1,))
  chex.assert_type([scale, offset], jnp.float32)
  x = parts[0][0]
  data = ClientData(x, np.zeros(len(x), np.int32), np.ones(len(x), bool), scale, offset)
  idx = np.array([3, 0, 7, 3], np.int32)
  got = jax.jit(ClientData.images)(data, idx)
  chex.assert_shape(got, (4, 8, 8, 1))
  chex.assert_type(got, jnp.float32)
  want = (x[idx] / PIXEL_MAX - mean) / std
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  # uint8 pixels of CIFAR-10's statistics: 0 and 255 map to (0 - m) / s and (1 - m) / s.
  s, o = pixel_normalisation([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010])
  np.testing.assert_allclose(
    np.asarray(o),
    -np.array([0.4914, 0.4822, 0.4465]) / np.array([0.2023, 0.1994, 0.2010]),
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    255 * np.asarray(s) + np.asarray(o),
    (1 - np.array([0.4914, 0.4822, 0.4465])) / np.array([0.2023, 0.1994, 0.2010]),
    rtol=1e-6,
  )
  # Float model inputs without a normalisation are read as they are.
  plain = ClientData(x.astype(np.float32), data.y, data.mask)
  chex.assert_trees_all_equal(plain.images(idx), x.astype(np.float32)[idx])


def test_stacked_pixels_stay_uint8_at_a_quarter_of_the_memory(pixel_and_float_clients):
  pixels, floats = pixel_and_float_clients
  chex.assert_type(pixels.x, jnp.uint8)
  chex.assert_shape([pixels.pixel_scale, pixels.pixel_offset], (5, 1))
  assert pixels.x.nbytes * 4 == floats.x.nbytes
  chex.assert_trees_all_equal(pixels.mask, floats.mask)
  assert floats.pixel_scale is None and floats.pixel_offset is None


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(), "pixel_scale"),
    (dict(pixel_scale=[1.0]), "pixel_offset"),
    (dict(pixel_scale=[1.0, 2.0], pixel_offset=[0.0, 0.0]), "pixel_scale"),
  ],
)
def test_stack_clients_refuses_pixels_without_a_valid_normalisation(kwargs, field):
  x = np.zeros((3, 8, 8, 1), np.uint8)
  with raises_field(field):
    stack_clients([x], [np.zeros(3, np.int32)], **kwargs)
  with raises_field("xs"):
    stack_clients([x, x.astype(np.float32)], [np.zeros(3), np.zeros(3)])


@pytest.mark.parametrize("mean, std, field", [([0.5], [0.0], "std"), ([0.5, 0.5], [0.2], "std")])
def test_pixel_normalisation_refuses_bad_statistics(mean, std, field):
  with raises_field(field):
    pixel_normalisation(mean, std)
