"""Data loading (sklearn digits, npz, tfds under mock_data, offline detection) and partitions.

Nothing here reaches the network: tfds runs under ``tfds.testing.mock_data`` and
the offline check is exercised with the probe monkeypatched.
"""

import time

import ml_collections
import numpy as np
import pytest

from fedlap_runs import data as data_lib
from fedlap_runs import library_configs
from conftest import raises_field


def data_cfg(**kw):
  cfg = ml_collections.ConfigDict(
    dict(
      name="digits",
      source="sklearn",
      data_dir=None,
      cache_dir="none",
      partition="paper",
      dirichlet_alpha=0.5,
      num_clients=5,
      train_fraction=1.0,
    )
  )
  cfg.update(kw)
  return cfg


@pytest.fixture(scope="module")
def digits():
  return data_lib.load_dataset(data_cfg())


def test_digits_split_and_standardisation(digits):
  assert digits.x_train.shape == (1400, 8, 8, 1) and digits.x_test.shape == (397, 8, 8, 1)
  assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
  assert digits.num_classes == 10
  assert digits.x_train.min() == 0.0 and digits.x_train.max() == 1.0  # stored: pixels / 16
  x = digits.normalise(digits.x_train)
  np.testing.assert_allclose(x.mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(x.std(), 1.0, atol=1e-4)
  # Stratified: each class keeps ~78 % of its records in train (135..143) and 39..40 in test.
  np.testing.assert_array_equal(
    np.bincount(digits.y_test), [39, 40, 39, 40, 40, 40, 40, 40, 39, 40]
  )
  assert np.bincount(digits.y_train).min() == 135
  # Un-normalising gives pixels in [0, 1] again.
  raw = x * digits.std + digits.mean
  assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5
  again = data_lib.load_dataset(data_cfg())
  np.testing.assert_array_equal(again.y_test, digits.y_test)


def test_paper_partition_owns_whole_classes_in_the_paper_order(digits):
  parts = data_lib.partition(digits.y_train, num_clients=5, scheme="paper", num_classes=10)
  order = data_lib.PAPER_CLASS_ORDER
  for i, p in enumerate(parts):
    assert set(digits.y_train[p]) == {order[2 * i], order[2 * i + 1]}
    assert len(p) == np.isin(digits.y_train, order[2 * i : 2 * i + 2]).sum()
  assert sorted(np.concatenate(parts).tolist()) == list(range(len(digits.y_train)))


def test_iid_partition_is_disjoint_balanced_and_seeded(digits):
  a = data_lib.partition(digits.y_train, num_clients=5, scheme="iid", num_classes=10, seed=0)
  b = data_lib.partition(digits.y_train, num_clients=5, scheme="iid", num_classes=10, seed=1)
  assert sorted(np.concatenate(a).tolist()) == list(range(1400))
  assert {len(p) for p in a} == {280}
  assert not all(np.array_equal(x, y) for x, y in zip(a, b))
  for p in a:  # each fifth sees (almost) every class
    assert len(set(digits.y_train[p])) == 10


def test_dirichlet_partition_skew_grows_as_alpha_shrinks(digits):
  def classes_per_client(alpha):
    parts = data_lib.partition(
      digits.y_train, num_clients=5, scheme="dirichlet", num_classes=10, alpha=alpha, seed=0
    )
    assert sorted(np.concatenate(parts).tolist()) == list(range(1400))
    # classes holding >= 5 % of the client's records
    return np.mean(
      [np.sum(np.bincount(digits.y_train[p], minlength=10) >= 0.05 * len(p)) for p in parts]
    )

  assert classes_per_client(0.1) < classes_per_client(100.0)
  assert classes_per_client(100.0) == 10


def test_subsample_is_stratified(digits):
  keep = data_lib.subsample(digits.y_train, 0.1, seed=0)
  counts = np.bincount(digits.y_train[keep])
  expected = np.round(0.1 * np.bincount(digits.y_train)).astype(int)
  np.testing.assert_array_equal(counts, expected)
  cfg = data_cfg(train_fraction=0.5)
  parts = data_lib.client_split(digits, cfg)
  assert sum(len(p) for p in parts) == int(np.round(0.5 * np.bincount(digits.y_train)).sum())


# Client sizes and a digest of the index arrays of client_split on the digits, as the code
# before data.partition_seed computed them from the run's seed 0 and 1: partition_seed S draws
# exactly what seed S drew, so every seed-0 run keeps its partition bit for bit.
SPLITS = {  # (partition, train_fraction, seed) -> (sizes, sha256 prefix)
  ("dirichlet", 1.0, 0): ([198, 278, 325, 362, 237], "1d0851866d5046d5"),
  ("dirichlet", 1.0, 1): ([341, 290, 227, 293, 249], "ce825a3f735d4c6c"),
  ("dirichlet", 0.5, 0): ([65, 198, 195, 103, 140], "678824f3d63aac75"),
  ("iid", 0.5, 0): ([141, 140, 140, 140, 140], "2435216227461e0d"),
  ("iid", 0.5, 1): ([141, 140, 140, 140, 140], "c65c7d0533ad4189"),
}


@pytest.mark.parametrize("scheme, fraction, seed", list(SPLITS))
def test_partition_seed_draws_what_the_seed_drew_before(digits, scheme, fraction, seed):
  import hashlib  # pylint: disable=g-import-not-at-top

  cfg = data_cfg(partition=scheme, train_fraction=fraction, partition_seed=seed)
  parts = data_lib.client_split(digits, cfg)
  sizes = [len(p) for p in parts]
  digest = hashlib.sha256(np.concatenate(parts).tobytes() + str(sizes).encode()).hexdigest()
  assert (sizes, digest[:16]) == SPLITS[(scheme, fraction, seed)]
  if seed == 0:  # the default
    del cfg["partition_seed"]
    assert [p.tolist() for p in data_lib.client_split(digits, cfg)] == [p.tolist() for p in parts]


def test_released_client_sizes_come_from_the_public_partition_seed_not_the_secret_seed():
  """Dirichlet client sizes are released (run_info.json, and a DP client's epsilon depends on
  its size). Drawn from the secret seed they would let anyone test seed guesses offline, and
  the seed determines every noise draw."""
  from fedlap_runs import calibration  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  cfg = quickstart.dp_config()
  cfg.data.partition = "dirichlet"
  sizes = calibration.client_sizes(cfg)
  cfg.seed = 7
  assert calibration.client_sizes(cfg) == sizes == SPLITS[("dirichlet", 1.0, 0)][0]
  cfg.data.partition_seed = 1
  assert calibration.client_sizes(cfg) == SPLITS[("dirichlet", 1.0, 1)][0]


def _write_npz(path, n=60, shape=(6, 6, 3), dtype=np.uint8, classes=4, **override):
  rng = np.random.default_rng(0)
  arrays = dict(
    x_train=rng.integers(0, 256, (n, *shape)).astype(dtype),
    y_train=np.arange(n) % classes,
    x_test=rng.integers(0, 256, (n // 2, *shape)).astype(dtype),
    y_test=np.arange(n // 2) % classes,
  )
  arrays.update(override)
  np.savez(path, **arrays)
  return arrays


def test_a_partition_the_loaded_classes_do_not_allow_names_its_own_field(tmp_path):
  """A custom data set's classes are known once it is loaded: 3 clients of the paper's
  partition over its 4 classes are refused naming ``data.num_clients`` (not ``data.source``:
  the data loaded well)."""
  path = tmp_path / "mine.npz"
  _write_npz(path, classes=4)
  cfg = data_cfg(name="custom", source=f"npz:{path}", partition="paper", num_clients=3)
  with raises_field("data.num_clients") as err:
    data_lib.load_split(cfg)
  assert err.value.value == 3 and "a divisor of 4" in err.value.allowed
  cfg.num_clients = 2
  assert [len(i) for i in data_lib.load_split(cfg)[1]] == [30, 30]


def test_npz_custom_is_standardised_per_channel(tmp_path):
  path = tmp_path / "mine.npz"
  raw = _write_npz(path)
  ds = data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}"))
  assert ds.num_classes == 4 and ds.image_shape == (6, 6, 3)
  # Pixels stay uint8 (a quarter of float32's memory); the model sees them normalised.
  assert ds.x_train.dtype == np.uint8 and ds.x_test.dtype == np.uint8
  np.testing.assert_array_equal(ds.x_train, raw["x_train"])
  x = ds.normalise(ds.x_train)
  assert x.dtype == np.float32
  np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
  np.testing.assert_allclose(x.std(axis=(0, 1, 2)), 1.0, atol=1e-4)
  np.testing.assert_allclose(
    ds.normalise(ds.x_test) * ds.std + ds.mean, raw["x_test"] / 255.0, atol=1e-5
  )
  # Float images in any scale are standardised in their own units.
  path_f = tmp_path / "float.npz"
  raw_f = _write_npz(path_f, dtype=np.float32)
  ds_f = data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path_f}"))
  assert ds_f.x_train.dtype == np.float32
  np.testing.assert_allclose(ds_f.normalise(ds_f.x_train).mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
  np.testing.assert_allclose(
    ds_f.normalise(raw_f["x_test"]), ds.normalise(raw["x_test"]), atol=1e-4
  )


def test_npz_mixed_dtypes_are_refused(tmp_path):
  path = tmp_path / "mixed.npz"
  _write_npz(path, x_test=np.zeros((30, 6, 6, 3), np.float32))
  with raises_field("x_test"):
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}"))


def test_npz_known_dataset_uses_the_paper_constants(tmp_path):
  path = tmp_path / "c.npz"
  raw = _write_npz(path, shape=(32, 32, 3), classes=10)
  ds = data_lib.load_dataset(data_cfg(name="cifar10", source=f"npz:{path}"))
  mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2023, 0.1994, 0.2010])
  np.testing.assert_allclose(
    ds.normalise(ds.x_train), (raw["x_train"] / 255.0 - mean) / std, rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize(
  "override, field",
  [
    (dict(x_train=np.zeros((60, 6, 6), np.uint8)), "x_train"),
    (dict(y_train=np.zeros(59, np.int64)), "y_train"),
    (dict(y_test=np.zeros(30, np.float32)), "y_test"),
    (dict(x_test=np.zeros((30, 5, 6, 3), np.uint8)), "x_test"),
  ],
)
def test_npz_bad_arrays_are_rejected(tmp_path, override, field):
  path = tmp_path / "bad.npz"
  _write_npz(path, **override)
  with raises_field(field):
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}"))


def test_npz_missing_array_and_wrong_channels(tmp_path):
  path = tmp_path / "m.npz"
  np.savez(path, x_train=np.zeros((4, 28, 28, 1), np.uint8), y_train=np.zeros(4, np.int64))
  with pytest.raises(ValueError, match=r"missing arrays \['x_test', 'y_test'\]"):
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}"))
  path = tmp_path / "rgb.npz"
  _write_npz(path, shape=(28, 28, 3), classes=10)
  with raises_field("data.name"):
    data_lib.load_dataset(data_cfg(name="mnist", source=f"npz:{path}"))


# ----------------------------------------------------------------- tfds


def test_tfds_mock_load_caches_numpy(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=40):
    ds = data_lib.load_dataset(data_cfg(name="mnist", source="tfds", cache_dir=str(tmp_path)))
  assert ds.x_train.shape == (40, 28, 28, 1) and ds.x_test.shape == (40, 28, 28, 1)
  assert ds.x_train.dtype == np.uint8  # kept as stored; normalised as batches are read
  assert (tmp_path / "tfds_mnist.npz").exists()
  with np.load(tmp_path / "tfds_mnist.npz") as f:
    np.testing.assert_allclose(
      ds.normalise(ds.x_train), (f["x_train"] / 255.0 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-5
    )
  # Later loads come from the cache, without tfds (outside the mock).
  again = data_lib.load_dataset(data_cfg(name="mnist", source="tfds", cache_dir=str(tmp_path)))
  np.testing.assert_array_equal(again.x_train, ds.x_train)


def test_tfds_offline_fails_fast_and_points_to_npz(tmp_path, monkeypatch):
  pytest.importorskip("tensorflow_datasets")
  probed = []
  monkeypatch.setattr(
    data_lib, "_reachable", lambda host, port, timeout: probed.append((host, port)) or False
  )
  t0 = time.time()
  with pytest.raises(data_lib.DataUnavailableError) as err:
    data_lib.load_tfds("cifar10", data_dir=str(tmp_path / "empty"), cache_dir="none")
  assert time.time() - t0 < 30
  assert probed == [("www.cs.toronto.edu", 443)]
  msg = str(err.value)
  assert "offline" in msg and "--config.data.source=npz:" in msg and "cifar10" in msg


def test_reachable_probe_is_quick_and_false_for_a_closed_port():
  t0 = time.time()
  assert data_lib._reachable("127.0.0.1", 1, timeout=1.0) is False
  assert time.time() - t0 < 3


def test_tfds_mock_one_tiny_round(tmp_path):
  """The tfds path end to end: load, partition, one non-DP round with a tiny model."""
  tfds = pytest.importorskip("tensorflow_datasets")
  from experiments import train  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  cfg = quickstart.nondp_config()
  cfg.data.name, cfg.data.source, cfg.data.cache_dir = "mnist", "tfds", str(tmp_path / "cache")
  cfg.model.width, cfg.model.depth = 8, 1
  c = cfg.client
  c.ipc, c.max_outer, c.batch_loop, c.boost_loop, c.batch_size = 1, 1, 1, 1, 4
  c.calibration_epochs, c.dsa_strategy, cfg.server.dsa_strategy = 2, "", ""
  cfg.server.max_epochs, cfg.rounds, cfg.progress_bar, cfg.plots = 2, 1, False, False
  library_configs.validate_config(cfg)
  with tfds.testing.mock_data(num_examples=100):
    out = train.train_and_evaluate(cfg, tmp_path / "run")
  (rec,) = out["records"]
  assert rec["round"] == 1 and 0.0 <= rec["test_accuracy"] <= 1.0 and rec["epsilon"] is None
  assert len(rec["client_radius"]) == 5 and all(0 < r <= 5.0 for r in rec["client_radius"])
  assert (tmp_path / "run" / "checkpoints" / "1").is_dir()


# --------------------------------------------------------------------- what reaches a DP run


def test_normalisation_sources(tmp_path, digits):
  """``published`` / ``given`` / ``test_split`` read no training record; ``train_split`` does."""
  x_tr, x_te = digits.x_train, digits.x_test
  test = data_lib.load_dataset(data_cfg(normalisation="test_split"))
  np.testing.assert_allclose(test.mean, [x_te.mean()], rtol=1e-5)
  np.testing.assert_allclose(test.std, [x_te.std()], rtol=1e-5)
  assert test.normalisation == "test_split"
  assert digits.normalisation == "train_split"  # auto, digits, as before
  np.testing.assert_allclose(digits.mean, [x_tr.mean()], rtol=1e-5)
  given = data_lib.load_dataset(data_cfg(normalisation="given", mean=(0.25,), std=(0.5,)))
  assert given.normalisation == "given"
  np.testing.assert_allclose(given.normalise(np.full((1, 1, 1, 1), 0.75, np.float32)), 1.0)
  # The training split's records do not move a DP-safe normalisation.
  path = tmp_path / "d.npz"
  np.savez(path, x_train=x_tr[:-1], y_train=digits.y_train[:-1], x_test=x_te, y_test=digits.y_test)
  fewer = data_lib.load_dataset(
    data_cfg(name="custom", source=f"npz:{path}", normalisation="test_split")
  )
  np.testing.assert_array_equal(fewer.mean, test.mean)
  np.testing.assert_array_equal(fewer.std, test.std)
  assert data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}")).mean != digits.mean
  path = tmp_path / "c.npz"
  _write_npz(path, shape=(32, 32, 3), classes=10)
  assert (
    data_lib.load_dataset(data_cfg(name="cifar10", source=f"npz:{path}")).normalisation
    == "published"
  )
  with raises_field("data.mean"):
    data_lib.load_dataset(
      data_cfg(
        name="cifar10", source=f"npz:{path}", normalisation="given", mean=(0.25,), std=(0.5,)
      )
    )


@pytest.mark.parametrize(
  "array,value,records", [("x_train", np.nan, 2), ("x_test", np.inf, 1), ("x_test", -np.inf, 3)]
)
@pytest.mark.parametrize("name", ["custom", "digits"])
def test_non_finite_pixels_are_rejected_naming_the_array_and_count(
  tmp_path, digits, name, array, value, records
):
  arrays = dict(
    x_train=digits.x_train.copy(),
    y_train=digits.y_train,
    x_test=digits.x_test.copy(),
    y_test=digits.y_test,
  )
  arrays[array][:records, 1, 2, 0] = value
  arrays[array][0, 3, 3, 0] = value
  path = tmp_path / "bad.npz"
  np.savez(path, **arrays)
  with raises_field(array) as err:
    data_lib.load_dataset(data_cfg(name=name, source=f"npz:{path}"))
  assert err.value.value == (records + 1, records)  # non-finite values, records holding them


@pytest.mark.parametrize("empty", ["x_train", "x_test"])
def test_empty_arrays_are_rejected(tmp_path, empty):
  arrays = _write_npz(tmp_path / "ok.npz")
  split = empty[2:]
  arrays[f"x_{split}"], arrays[f"y_{split}"] = arrays[f"x_{split}"][:0], arrays[f"y_{split}"][:0]
  np.savez(tmp_path / "e.npz", **arrays)
  with raises_field(f"x_{split}") as err:
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{tmp_path / 'e.npz'}"))
  assert err.value.value == (0, 6, 6, 3)


@pytest.mark.parametrize("content", [b"hello, not an npz\n", b"PK\x03\x04broken zip", b""])
def test_a_file_that_is_no_npz_is_one_clear_error(tmp_path, content):
  path = tmp_path / "text.npz"
  path.write_bytes(content)
  with pytest.raises(ValueError) as err:
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{path}"))
  msg = str(err.value)
  assert msg.startswith(f"data.source='npz:{path}' is invalid: ") and "\n" not in msg
  assert "allowed: an .npz written by numpy.savez" in msg and "allow_pickle" not in msg
  np.save(tmp_path / "one.npy", np.zeros(3))
  (tmp_path / "one.npy").rename(tmp_path / "one.npz")
  with pytest.raises(ValueError, match="is invalid: it holds a single .npy array"):
    data_lib.load_dataset(data_cfg(name="custom", source=f"npz:{tmp_path / 'one.npz'}"))
