"""``python -m fedlap_runs.datasets NAME --idx DIR``: the IDX reader and the research sets'
validation / test carve, on tiny IDX files written here (nothing is downloaded)."""

import gzip
import struct

import numpy as np
import pytest

from fedlap_runs import data as data_lib
from fedlap_runs import datasets


def idx_bytes(array: np.ndarray) -> bytes:
  """An IDX file of a uint8 array: zero, zero, type 0x08, ndim, big-endian sizes, data."""
  return (
    bytes([0, 0, 0x08, array.ndim])
    + struct.pack(f">{array.ndim}I", *array.shape)
    + (array.astype(np.uint8).tobytes())
  )


def write_idx_dir(path, n_train=40, n_test=7, compress=False):
  """IDX files whose image i has pixel (0, 0) = i, so records can be traced."""
  path.mkdir()
  arrays = {}
  for split, n in (("train", n_train), ("t10k", n_test)):
    images = np.zeros((n, 28, 28), np.uint8)
    images[:, 0, 0] = np.arange(n) + (100 if split == "t10k" else 0)
    arrays[f"{split}-images"] = images
    arrays[f"{split}-labels"] = (np.arange(n) % 10).astype(np.uint8)
  for stem, array in arrays.items():
    name = f"{stem}-idx{3 if array.ndim == 3 else 1}-ubyte"
    raw = idx_bytes(array)
    if compress:
      (path / f"{name}.gz").write_bytes(gzip.compress(raw))
    else:
      (path / name).write_bytes(raw)
  return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_gives_the_arrays_written(compress):
  images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  raw = idx_bytes(images)
  got = datasets.read_idx(gzip.compress(raw) if compress else raw)
  assert got.shape == (2, 3, 4) and got.dtype == np.uint8
  np.testing.assert_array_equal(got, images)
  labels = np.array([7, 0, 3], np.uint8)
  np.testing.assert_array_equal(datasets.read_idx(idx_bytes(labels)), labels)


def test_read_idx_refuses_a_bad_header_and_a_short_body():
  with pytest.raises(ValueError, match="labels.gz"):
    datasets.read_idx(b"\x50\x4b\x03\x04rest", "labels.gz")
  with pytest.raises(ValueError, match="images-file"):
    datasets.read_idx(idx_bytes(np.zeros((2, 3), np.uint8))[:-1], "images-file")


@pytest.mark.parametrize("compress", [False, True])
def test_research_set_carves_validation_from_train_and_keeps_test_apart(
  tmp_path, monkeypatch, compress
):
  arrays = write_idx_dir(tmp_path / "idx", compress=compress)
  monkeypatch.setattr(datasets, "VALIDATION_RECORDS", 10)
  monkeypatch.setitem(
    datasets.RESEARCH_SETS, "mnist_small", datasets.ResearchSet("mnist_small", "mnist", 20, "")
  )
  out = tmp_path / "out"
  assert datasets.main(["mnist_small", "--idx", str(tmp_path / "idx"), "--out", str(out)]) == 0
  val = data_lib.load_npz(str(out / "mnist_small_val.npz"))
  test = data_lib.load_npz(str(out / "mnist_small.npz"))
  # The same 20 training records in both files; 10 other training records as validation.
  np.testing.assert_array_equal(val[0], test[0])
  np.testing.assert_array_equal(val[1], test[1])
  train_ids, val_ids = val[0][:, 0, 0, 0], val[2][:, 0, 0, 0]
  assert val[0].shape == (20, 28, 28, 1) and val[2].shape == (10, 28, 28, 1)
  assert len(set(train_ids) | set(val_ids)) == 30 and max(train_ids.max(), val_ids.max()) < 40
  np.testing.assert_array_equal(val[1], arrays["train-labels"][train_ids])
  np.testing.assert_array_equal(val[3], arrays["train-labels"][val_ids])
  # The test file's held-out split is the t10k files, whole and in order.
  np.testing.assert_array_equal(test[2][..., 0], arrays["t10k-images"])
  np.testing.assert_array_equal(test[3], arrays["t10k-labels"])
  assert val[1].dtype == np.int64 and val[0].dtype == np.uint8
  # Deterministic: a second build writes the same bytes.
  first = (out / "mnist_small_val.npz").read_bytes()
  datasets.main(["mnist_small", "--idx", str(tmp_path / "idx"), "--out", str(out)])
  assert (out / "mnist_small_val.npz").read_bytes() == first
  assert (
    datasets.sha256_file(out / "mnist_small.npz") in (out / "mnist_small.npz.sha256").read_text()
  )


def test_research_set_refuses_too_few_records_and_missing_files(tmp_path, monkeypatch, capsys):
  write_idx_dir(tmp_path / "idx", n_train=12)
  monkeypatch.setattr(datasets, "VALIDATION_RECORDS", 10)
  assert datasets.main(["mnist_small", "--idx", str(tmp_path / "idx"), "--out", str(tmp_path)]) == 2
  assert "8010" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert datasets.main(["fmnist_small", "--idx", str(tmp_path / "empty")]) == 2
  assert "train-images" in capsys.readouterr().err
  assert not list(tmp_path.glob("*.npz"))
