"""``data.features='scattering'``: images replaced by their scattering once, when loaded, for the
``scattered_`` models (a ScatterNet's head alone): the same model as ``scatternet_`` on the
images, and the couplings refused by the field they name."""

from __future__ import annotations

import chex
import jax
import ml_collections
import numpy as np
import pytest

from conftest import raises_field
from fedlap_jax.models import SCATTER_CHANNELS, ScatterNet
from fedlap_runs import catalog, library_configs
from fedlap_runs import data as data_lib
from fedlap_runs.configs import default


def digits(features: str):
  return data_lib.load_dataset(
    ml_collections.ConfigDict(
      dict(
        name="digits",
        source="sklearn",
        cache_dir="none",
        normalisation="test_split",
        features=features,
      )
    )
  )


@pytest.mark.parametrize("head", ["linear", "cnn"])
def test_the_scattered_head_on_the_features_is_the_scatternet_on_the_images(head):
  images, features = digits("pixels"), digits("scattering")
  chex.assert_shape(features.x_train, (1400, 2, 2, SCATTER_CHANNELS))
  chex.assert_shape(features.x_test, (397, 2, 2, SCATTER_CHANNELS))
  np.testing.assert_array_equal(features.y_train, images.y_train)
  # Already model inputs: the loader's normalisation of them is the identity.
  np.testing.assert_array_equal(features.normalise(features.x_test[:3]), features.x_test[:3])
  x = images.normalise(images.x_test[:16])
  whole = catalog.model_factory(f"scatternet_{head}")(10)
  alone = catalog.model_factory(f"scattered_{head}")(10)
  assert isinstance(alone, ScatterNet) and not alone.front_end
  params = jax.jit(whole.init)(jax.random.PRNGKey(0), x)["params"]
  np.testing.assert_allclose(
    alone.apply({"params": params}, features.x_test[:16]),
    whole.apply({"params": params}, x),
    rtol=1e-4,
    atol=1e-5,
  )


@pytest.mark.parametrize(
  "features, model, field",
  [
    ("pixels", "scattered_linear", "data.features"),
    ("scattering", "scatternet_linear", "model.name"),
    ("wavelets", "convnet", "data.features"),
  ],
)
def test_a_features_and_model_mismatch_is_refused_by_field(features, model, field):
  cfg = default.get_config()
  cfg.data.features, cfg.model.name = features, model
  with raises_field(field):
    library_configs.validate_config(cfg)


def test_scattering_images_whose_side_is_not_a_multiple_of_4_is_refused_by_field(tmp_path):
  path = tmp_path / "odd.npz"
  x = np.zeros((4, 10, 10, 1), np.uint8)
  np.savez(path, x_train=x, y_train=np.arange(4) % 2, x_test=x, y_test=np.arange(4) % 2)
  cfg = ml_collections.ConfigDict(
    dict(
      name="custom",
      source=f"npz:{path}",
      cache_dir="none",
      normalisation="test_split",
      features="scattering",
    )
  )
  with raises_field("data.features"):
    data_lib.load_dataset(cfg)


def test_a_flower_clients_own_data_file_gets_the_features_the_loader_gives(tmp_path):
  from fedlap_flower import task

  x = np.random.default_rng(0).integers(0, 256, (6, 28, 28, 1), dtype=np.uint8)
  y = np.arange(6, dtype=np.int64) % 10
  path = tmp_path / "site.npz"
  np.savez(path, x_train=x, y_train=y, x_test=x, y_test=y)
  cfg = default.get_config()
  cfg.data.update(
    dict(
      name="mnist",
      source=f"npz:{path}",
      normalisation="published",
      features="scattering",
      cache_dir="none",
    )
  )
  own_x, own_y, scale, offset, _ = task.load_own_data(cfg, path)
  loaded = data_lib.load_dataset(cfg.data)
  np.testing.assert_allclose(own_x, loaded.x_train, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(own_y, loaded.y_train)
  np.testing.assert_array_equal(scale, loaded.pixel_scale)
  np.testing.assert_array_equal(offset, loaded.pixel_offset)
