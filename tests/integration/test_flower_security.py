"""The Flower app against a hostile client, a local account and an oversized or trickled
reply: each check in process, on the function that holds it."""

from __future__ import annotations

import os
import stat

from fedlap_flower import signed_runs


def test_the_record_of_signed_runs_is_the_owners_alone(tmp_path):
  old = os.umask(0o022)
  try:
    signed_runs.admit(tmp_path / "state", "nonce-1", 7, check_new=lambda: None)
  finally:
    os.umask(old)
  path = tmp_path / "state" / signed_runs.RECORD_FILE
  assert stat.S_IMODE(path.stat().st_mode) == 0o600
