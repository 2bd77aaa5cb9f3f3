"""``python -m experiments.release``: a DP run's releasable files, and nothing of its timing.

One tiny FedLAP-DP run (digits, ConvNet-8x1, 1 round, its seed drawn, plots on) is packed:
the archive's members are the files ``summary.md`` calls releasable, every member's time,
owner and zip date is the same constant, ``config.json`` holds no seed, and a run whose seed
was given is refused by name unless ``--allow-not-private``.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
import zipfile

import pytest

from conftest import TINY_FEDLAP_FLAGS
from experiments import outputs, release, run

FLAGS = {**TINY_FEDLAP_FLAGS, "rounds": 1, "snapshot_rounds": "(1,)"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("runs") / "dp"
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    *(f"--config.{k}={v}" for k, v in FLAGS.items()),
    f"--workdir={workdir}",
  ]
  assert run.main(argv) == 0
  return workdir


def test_the_archive_holds_the_releasable_files_and_no_time(finished, tmp_path):
  out = tmp_path / "dp.tar.gz"
  assert release.main([str(finished), str(out)]) == 0
  with tarfile.open(out) as tar:
    members = tar.getmembers()
    data = {m.name: tar.extractfile(m).read() for m in members}
  pngs = sorted(p.name for p in finished.glob("*.png"))
  assert pngs and (finished / "timing.jsonl").exists() and (finished / "checkpoints").is_dir()
  expected = [
    "config.json",
    "metrics.jsonl",
    "privacy_ledger.json",
    "run_info.json",
    "summary.md",
    "synthetic/round_0001.npz",
    "train.log",
    *pngs,
  ]
  assert sorted(m.name for m in members) == sorted(f"dp/{n}" for n in expected)
  assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {
    (0, 0, 0, "", "", 0o644)
  }
  assert all(m.isfile() for m in members)
  summary = (finished / "summary.md").read_text()
  assert ", ".join(outputs.RELEASABLE) in summary  # the list the archive follows
  config = json.loads(data["dp/config.json"])
  assert "seed" not in config and config["dp"]["enabled"] is True
  assert json.loads((finished / "config.json").read_text())["seed"] >= 2**64  # drawn, kept
  npz = data["dp/synthetic/round_0001.npz"]
  assert npz == (finished / "synthetic" / "round_0001.npz").read_bytes()
  with zipfile.ZipFile(io.BytesIO(npz)) as z:
    assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}  # no write time
  for name, content in data.items():
    if name.endswith(".png"):
      assert b"tIME" not in content, name
  raw = out.read_bytes()
  assert raw[4:8] == b"\0\0\0\0" and not raw[3] & 0x08  # gzip: no time, no file name
  assert gzip.decompress(raw)  # and it is a gzip stream
  again = tmp_path / "again.tar.gz"
  assert release.main([str(finished), str(again)]) == 0
  assert again.read_bytes() == raw


def test_a_run_with_a_given_seed_is_refused_unless_allowed(finished, tmp_path, capsys):
  given = tmp_path / "given"
  shutil.copytree(finished, given)
  info = json.loads((given / "run_info.json").read_text())
  (given / "run_info.json").write_text(json.dumps({**info, "seed_origin": "given"}))
  out = tmp_path / "given.tar.gz"
  with pytest.raises(release.ReleaseError) as e:
    release.pack(given, out)
  assert e.value.field == "seed_origin" and not out.exists()
  assert release.main([str(given), str(out)]) == 2
  assert "--allow-not-private" in capsys.readouterr().err and not out.exists()
  assert release.main([str(given), str(out), "--allow-not-private"]) == 0 and out.exists()
