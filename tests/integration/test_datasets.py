"""``python -m fedlap_runs.datasets``: the subset rule, the npz bytes, the checksum file, offline.

tfds runs under ``tfds.testing.mock_data`` (random records, the same on every load) with
the subsets shrunk to a few records; nothing reaches the network.
"""

import numpy as np
import pytest

from fedlap_runs import data as data_lib
from fedlap_runs import datasets
from conftest import raises_field

tfds = pytest.importorskip("tensorflow_datasets")

SMALL = {
  "mnist10k": datasets.Subset("mnist10k", "mnist", 30, 12, "MNIST (shrunk)"),
  "fmnist10k": datasets.Subset("fmnist10k", "fashion_mnist", 30, 12, "Fashion (shrunk)"),
}


@pytest.fixture
def small_subsets(monkeypatch):
  for name, subset in SMALL.items():
    monkeypatch.setitem(datasets.SUBSETS, name, subset)


def test_subsets_are_the_documented_sizes():
  assert {n: (s.tfds_name, s.train, s.test) for n, s in datasets.SUBSETS.items()} == {
    "mnist10k": ("mnist", 8000, 2000),
    "fmnist10k": ("fashion_mnist", 8000, 2000),
  }
  for name in datasets.SUBSETS:
    assert len(datasets.PINNED_SHA256[name]) == 64
    int(datasets.PINNED_SHA256[name], 16)


@pytest.mark.parametrize("name", ["mnist10k", "fmnist10k"])
def test_build_takes_the_first_records_of_each_split(tmp_path, small_subsets, name):
  subset = datasets.SUBSETS[name]
  with tfds.testing.mock_data(num_examples=50):
    full = data_lib.load_tfds(subset.tfds_name, cache_dir="none")
    result = datasets.build(name, tmp_path, cache_dir="none")
  assert result["path"] == tmp_path / f"{name}.npz"
  with np.load(result["path"], allow_pickle=False) as f:
    assert f.files == ["x_train", "y_train", "x_test", "y_test"]
    got = {k: f[k] for k in f.files}
  assert got["x_train"].shape == (30, 28, 28, 1) and got["x_train"].dtype == np.uint8
  assert got["x_test"].shape == (12, 28, 28, 1) and got["x_test"].dtype == np.uint8
  assert got["y_train"].shape == (30,) and got["y_train"].dtype == np.int64
  assert got["y_test"].shape == (12,) and got["y_test"].dtype == np.int64
  np.testing.assert_array_equal(got["x_train"], full[0][:30])
  np.testing.assert_array_equal(got["y_train"], full[1][:30])
  np.testing.assert_array_equal(got["x_test"], full[2][:12])
  np.testing.assert_array_equal(got["y_test"], full[3][:12])
  # What experiments.run reads with --config.data.source=npz:PATH.
  loaded = data_lib.load_npz(str(result["path"]))
  np.testing.assert_array_equal(loaded[0], got["x_train"])
  sizes = [
    int(np.isin(got["y_train"], pair).sum()) for pair in ((5, 6), (1, 2), (0, 8), (9, 3), (4, 7))
  ]
  assert result["client_sizes"] == tuple(sizes) and sum(sizes) == 30


def test_build_is_deterministic_and_writes_its_checksum(tmp_path, small_subsets):
  with tfds.testing.mock_data(num_examples=50):
    first = datasets.build("mnist10k", tmp_path / "a", cache_dir="none")
    second = datasets.build("mnist10k", tmp_path / "b", cache_dir="none")
  assert (tmp_path / "a" / "mnist10k.npz").read_bytes() == (
    tmp_path / "b" / "mnist10k.npz"
  ).read_bytes()
  assert first["sha256"] == second["sha256"] == datasets.sha256_file(first["path"])
  line = (tmp_path / "a" / "mnist10k.npz.sha256").read_text()
  assert line == f"{first['sha256']}  mnist10k.npz\n"  # sha256sum -c format
  assert first["pinned"] == datasets.PINNED_SHA256["mnist10k"] != first["sha256"]


def test_npz_bytes_depend_on_the_arrays_only(tmp_path):
  rng = np.random.default_rng(0)
  arrays = {
    "x_train": rng.integers(0, 256, (5, 4, 4, 1), dtype=np.uint8),
    "y_train": np.arange(5, dtype=np.int64),
    "x_test": rng.integers(0, 256, (2, 4, 4, 1), dtype=np.uint8),
    "y_test": np.arange(2, dtype=np.int64),
  }
  datasets.write_npz(tmp_path / "one.npz", arrays)
  datasets.write_npz(tmp_path / "two.npz", {k: arrays[k] for k in reversed(list(arrays))})
  assert (tmp_path / "one.npz").read_bytes() == (tmp_path / "two.npz").read_bytes()
  arrays["x_test"][0, 0, 0, 0] ^= 1
  datasets.write_npz(tmp_path / "three.npz", arrays)
  assert datasets.sha256_file(tmp_path / "three.npz") != datasets.sha256_file(tmp_path / "one.npz")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["one.npz", "three.npz", "two.npz"]


def test_command_reports_sizes_and_a_checksum_that_differs_from_the_pinned_one(
  tmp_path, small_subsets, capsys
):
  with tfds.testing.mock_data(num_examples=50):
    rc = datasets.main(["mnist10k", "--out", str(tmp_path), "--cache-dir", "none"])
  out, err = capsys.readouterr()
  assert rc == 1  # random mock records are not the pinned subset
  assert "paper-partition client sizes: " in out and "1513, 1700, 1571, 1570, 1646" in out
  assert "differs from the pinned one" in err and (tmp_path / "mnist10k.npz").exists()
  assert datasets.main(["--list", "--out", str(tmp_path)]) == 0
  listed = capsys.readouterr().out
  assert "mnist10k" in listed and "(differs from the pinned one)" in listed
  assert "fmnist10k" in listed and "not built" in listed


def test_offline_refuses_and_writes_nothing(tmp_path, monkeypatch, capsys):
  probed = []
  monkeypatch.setattr(
    data_lib, "_reachable", lambda host, port, timeout: probed.append((host, port)) or False
  )
  rc = datasets.main(
    [
      "mnist10k",
      "--out",
      str(tmp_path / "out"),
      "--cache-dir",
      "none",
      "--data-dir",
      str(tmp_path / "empty"),
    ]
  )
  err = capsys.readouterr().err
  assert rc == 2 and probed == [("storage.googleapis.com", 443)]
  assert "cannot build mnist10k" in err and "offline" in err and "--data-dir" in err
  assert not (tmp_path / "out").exists()


def test_bad_name_and_short_split_are_refused(tmp_path):
  with pytest.raises(ValueError, match=r"NAME='mnist' is invalid; allowed: one of"):
    datasets.output_path("mnist")
  x, y = np.zeros((10, 28, 28, 1), np.uint8), np.zeros(10, np.int64)
  with pytest.raises(ValueError, match="at least 8000"):
    datasets.take_subset(datasets.SUBSETS["mnist10k"], x, y, x, y)
  with pytest.raises(ValueError, match="allowed: uint8 NHWC"):
    datasets.take_subset(datasets.SUBSETS["mnist10k"], x.astype(np.float32), y, x, y)


def test_default_output_is_the_data_cache():
  assert datasets.output_path("mnist10k") == (
    data_lib._cache_path("", "mnist").parent / "mnist10k.npz"
  )  # pylint: disable=protected-access


def test_a_run_reads_a_built_subset_by_name(tmp_path, monkeypatch, small_subsets):
  """``--config.data.source=subset:NAME`` reads what ``python -m fedlap_runs.datasets NAME``
  wrote into the data cache; before the build it is refused naming the command."""
  from fedlap_runs import library_configs
  from fedlap_runs.configs import default

  monkeypatch.setenv("HOME", str(tmp_path))
  cfg = default.get_config()
  cfg.data.name, cfg.data.source = "mnist", "subset:mnist10k"
  with raises_field("data.source") as err:
    library_configs.validate_config(cfg)
  assert "python -m fedlap_runs.datasets mnist10k" in err.value.allowed
  with tfds.testing.mock_data(num_examples=50):
    result = datasets.build("mnist10k", None, cache_dir="none")
  assert result["path"] == tmp_path / ".cache" / "fedlap_jax" / "mnist10k.npz"
  library_configs.validate_config(cfg)
  ds = data_lib.load_dataset(cfg.data)
  with np.load(result["path"]) as f:
    np.testing.assert_array_equal(ds.x_train, f["x_train"])
    np.testing.assert_array_equal(ds.y_test, f["y_test"])
  cfg.data.name = "fashion_mnist"
  with raises_field("data.name"):
    library_configs.validate_config(cfg)
  cfg.data.source = "subset:cifar5k"
  with raises_field("data.source"):
    library_configs.validate_config(cfg)
