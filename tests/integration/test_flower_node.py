"""The client node's checks and the ServerApp's reply collection, without processes.

:mod:`fedlap_flower.run_signature` (what a client accepts), the node worker's
task check (:func:`fedlap_flower.warm_clientapp.check_task`) and
:class:`fedlap_flower.prompt_grid.PromptGrid`. The same paths with real
processes: ``tests/integration/test_flower_deployment.py`` (``-m flower``).
"""

from __future__ import annotations

import hashlib
import time
import zipfile
from io import BytesIO

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import flatten_dict, fuse_dicts, get_fab_config
from flwr.supercore.primitives.asymmetric_ed25519 import load_private_key

from fedlap_flower import run_signature, warm_clientapp
from fedlap_flower.federation import APP_DIR, ssh_key_pair
from fedlap_flower.prompt_grid import PromptGrid


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
  d = tmp_path_factory.mktemp("keys")
  operator, other = ssh_key_pair(d / "operator", "ed25519"), ssh_key_pair(d / "other", "ed25519")
  trusted = d / "trusted.yaml"
  trusted.write_text(f"operator: '{(d / 'operator.pub').read_text().strip()}'\n")
  return {"operator": operator, "other": other, "trusted": run_signature.load_trusted(trusted)}


def _fused(fab: bytes, overrides: dict) -> dict:
  """The run config a SuperNode gives the ClientApp (Flower's own fusion)."""
  defaults = flatten_dict(get_fab_config(fab)["tool"]["flwr"]["app"]["config"])
  return fuse_dicts(defaults, overrides)


def test_signed_run_verifies_and_any_change_is_refused(keys, tmp_path):
  fab = build_fab_from_disk(APP_DIR)
  assert build_fab_from_disk(APP_DIR) == fab  # deterministic: what the operator signs is sent
  fab_hash = hashlib.sha256(fab).hexdigest()
  toml = tmp_path / "run.toml"
  toml.write_text("config = 'quickstart:dp'\nmin-clients = 4\n")
  overrides = run_signature.signed_overrides(keys["operator"], APP_DIR, [str(toml)])
  assert overrides["signer"] == run_signature.fingerprint(
    load_private_key(keys["operator"]).public_key()
  )
  seen = _fused(fab, overrides)
  assert run_signature.verify(keys["trusted"], fab_hash, seen) == overrides["signer"]

  def refused(run_config, fab_sha=fab_hash, match=""):
    with pytest.raises(run_signature.UntrustedRun, match=match):
      run_signature.verify(keys["trusted"], fab_sha, run_config)

  refused({**seen, "min-clients": 3}, match="does not match")  # the server changed a value
  refused({**seen, "unsafe-dp-keys-from-server": True}, match="does not match")
  refused({**seen, "signed-at": seen["signed-at"] + 1}, match="does not match")
  refused(seen, fab_sha=hashlib.sha256(fab + b"x").hexdigest(), match="does not match")
  refused({**seen, "signer": "", "signature": ""}, match="not signed")
  other = run_signature.sign(load_private_key(keys["other"]), fab_hash, seen)
  refused({**seen, **other}, match="not among this client's trusted entities")
  with pytest.raises(ValueError, match="set by the signature"):
    run_signature.signed_overrides(keys["operator"], APP_DIR, ["signer='x'"])


def test_trusted_entities_must_be_ed25519(tmp_path):
  ecdsa = ssh_key_pair(tmp_path / "node", "ecdsa")
  bad = tmp_path / "bad.yaml"
  bad.write_text(f"node: '{(tmp_path / 'node.pub').read_text().strip()}'\n")
  with pytest.raises(ValueError, match="not an Ed25519 key"):
    run_signature.load_trusted(bad)
  bad.write_text("{}\n")
  with pytest.raises(ValueError, match="at least one key"):
    run_signature.load_trusted(bad)
  assert ecdsa.exists()


def _with_clientapp(fab: bytes, ref: str) -> bytes:
  out = BytesIO()
  with zipfile.ZipFile(BytesIO(fab)) as src, zipfile.ZipFile(out, "w") as dst:
    for item in src.infolist():
      data = src.read(item)
      if item.filename == "pyproject.toml":
        data = data.replace(
          b'clientapp = "fedlap_flower.client_app:app"', f'clientapp = "{ref}"'.encode()
        )
      dst.writestr(item, data)
  return out.getvalue()


def test_node_runs_only_the_installed_clientapp_of_signed_runs(keys):
  fab = build_fab_from_disk(APP_DIR)
  fab_hash = hashlib.sha256(fab).hexdigest()
  seen = _fused(fab, {})
  signed = {**seen, **run_signature.sign(load_private_key(keys["operator"]), fab_hash, seen)}
  warm_clientapp.check_task(fab, signed, keys["trusted"], allow_unsigned=False)
  warm_clientapp.check_task(fab, seen, None, allow_unsigned=True)
  with pytest.raises(run_signature.UntrustedRun, match="not signed"):
    warm_clientapp.check_task(fab, seen, keys["trusted"], allow_unsigned=False)
  evil = _with_clientapp(fab, "evil:app")
  evil_signed = {
    **seen,
    **run_signature.sign(
      load_private_key(keys["operator"]), hashlib.sha256(evil).hexdigest(), seen
    ),
  }
  for run_config, unsigned in ((evil_signed, False), (seen, True)):
    with pytest.raises(run_signature.UntrustedRun, match="this client runs only"):
      warm_clientapp.check_task(evil, run_config, keys["trusted"], allow_unsigned=unsigned)
  with pytest.raises(ValueError, match="no trusted entities"):
    warm_clientapp.serve("127.0.0.1:1", trusted=None, allow_unsigned=False)


class _Meta:
  def __init__(self, reply_to):
    self.reply_to_message_id = reply_to


class _Reply:
  def __init__(self, reply_to):
    self.metadata = _Meta(reply_to)


class _SlowGrid:
  """Replies to message ``i`` become pullable ``delays[i]`` seconds after the push."""

  def __init__(self, delays):
    self.delays = delays
    self.pulls = 0

  def push_messages(self, messages):
    self.t0 = time.time()
    return [str(i) for i, _ in enumerate(messages)]

  def pull_messages(self, ids):
    self.pulls += 1
    now = time.time() - self.t0
    return [_Reply(i) for i in ids if now >= self.delays[int(i)]]


def test_prompt_grid_returns_replies_as_they_arrive_within_the_timeout():
  grid = _SlowGrid([0.0, 0.3, 10.0])
  t0 = time.time()
  got = PromptGrid(grid, poll=0.05).send_and_receive(["a", "b", "c"], timeout=0.6)
  waited = time.time() - t0
  assert sorted(r.metadata.reply_to_message_id for r in got) == ["0", "1"]
  assert 0.6 <= waited < 1.5, waited  # waits for the timeout, not Flower's 3 s steps
  grid = _SlowGrid([0.0, 0.2])
  t0 = time.time()
  got = PromptGrid(grid, poll=0.05).send_and_receive(["a", "b"], timeout=30)
  assert len(got) == 2 and time.time() - t0 < 1.0  # all replies in: returns at once
  with pytest.raises(ValueError, match="poll"):
    PromptGrid(grid, poll=0)


def test_node_cli_help_names_the_flags_it_hands_to_flower_and_refuses_bad_ones(capsys):
  from fedlap_flower import node  # pylint: disable=g-import-not-at-top

  with pytest.raises(SystemExit) as exit_info:
    node.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--trusted-entities", "--allow-unsigned-runs", "--poll", "flower-supernode"):
    assert flag in out, flag
  # The README's node command hands these to flower-supernode; --help says so.
  for flag in (
    "--superlink",
    "--root-certificates",
    "--auth-supernode-private-key",
    "--node-config",
  ):
    assert flag in out.split("Every other flag goes to", 1)[1], flag
  for argv, message in (
    (["--allow-unsigned-runs", "--isolation", "subprocess"], "--isolation is set by this command"),
    ([], "--trusted-entities FILE is required"),
    (["--allow-unsigned-runs", "--poll", "0"], "--poll 0.0: allowed: seconds > 0"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      node.main(argv)
    assert exit_info.value.code == 2, argv
    assert message in capsys.readouterr().err, argv
