r"""The operator's signature over a run: the app bundle (FAB) and its whole run config.

A client computes only runs that a key it trusts signed, each run once and only
soon after it was signed. Flower 1.42's own check (``flower-supernode
--trusted-entities``) accepts only bundles whose signatures the SuperLink
fetched from Flower Hub (``flwr app review``); a bundle submitted from disk
with ``flwr run`` reaches the SuperNodes with no signature, so that check
refuses every run of a self-hosted federation. This module signs what the
clients execute instead, with keys of the same kind and the same message
layout (Ed25519, as Flower signs a bundle):

* the digest: ``sha256(fab_sha256_hex + "\n" + JSON(run config))``, the run
  config being the fused one every ClientApp sees (the bundle's defaults with
  the submitted overrides), without the three signature keys, as JSON with
  sorted keys and no spaces. It includes ``run-nonce``: 128 random bits drawn
  for each signing (:func:`signed_overrides`), so that each signature names one
  run;
* the signature: Ed25519 over the signing time (8-byte big-endian Unix
  seconds) followed by the digest;
* it travels in the run config: ``signer`` (the key's ``SHA256:...``
  fingerprint, as ``ssh-keygen -lf KEY.pub`` prints it), ``signature``
  (base64url), ``signed-at`` (Unix seconds) and ``run-nonce`` (32 hex digits).

A node (:mod:`fedlap_flower.runtime.warm_clientapp`) checks the signature on
every task, and on the first task of a run also its age
(:func:`check_age`: at most the node's ``--max-run-age`` seconds old, give or
take ``--clock-skew``) and that it has not computed this ``run-nonce`` under
another Flower run (:mod:`fedlap_flower.signed_runs`): a signed run config
submitted again, byte for byte, is refused by every client and charges no
ledger. To resume a run, sign it again (a new nonce).

Trusted keys are a YAML file in the format of Flower's ``--trusted-entities``
(``{label: 'ssh-ed25519 AAAA... comment'}``).

Sign a run (the operator, with the key made by ``ssh-keygen -t ed25519``)::

  python -m fedlap_flower.runtime.run_signature --key keys/operator \
      --app fedlap_flower/app --run-config "config='cifar_dp' min-clients=4" --out run.toml
  flwr run fedlap_flower/app server --run-config run.toml --stream

The bundle ``flwr run`` submits is the one signed: Flower builds it
deterministically from the app directory (fixed file dates), so any change to
``fedlap_flower/app`` after signing makes every client refuse the run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fedlap_flower.refusal import Refusal

SIGNATURE_KEYS = ("signer", "signature", "signed-at")
NONCE_KEY = "run-nonce"
# Set by signed_overrides, never by hand.
SIGNED_BY_TOOL = (*SIGNATURE_KEYS, NONCE_KEY)
NONCE_PATTERN = re.compile(r"[0-9a-f]{32}")
# A node's defaults: a run is admitted within an hour of its signing, give or take 5 minutes.
DEFAULT_MAX_RUN_AGE = 3600.0
DEFAULT_CLOCK_SKEW = 300.0


class UntrustedRun(Refusal):
  """A run without a valid signature by a trusted key (or signed too long ago, or already
  computed under another run).

  Attributes:
    field: what is refused: the run config's ``signer``, ``signature``, ``signed-at`` or
      ``run-nonce``, the bundle's ``clientapp``, or the node config's ``state-dir``.
  """


def _message(digest_bytes: bytes, signed_at: int) -> bytes:
  """What is signed: ``signed_at`` as 8 bytes big-endian, then the digest (Flower's layout)."""
  return int(signed_at).to_bytes(8, byteorder="big") + digest_bytes


def _b64url_decode(text: str) -> bytes:
  return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_private_key(path: str | Path) -> ed25519.Ed25519PrivateKey:
  """An OpenSSH Ed25519 private key (``ssh-keygen -t ed25519``, no passphrase)."""
  key = serialization.load_ssh_private_key(Path(path).expanduser().read_bytes(), password=None)
  if not isinstance(key, ed25519.Ed25519PrivateKey):
    raise ValueError(f"{path}: not an Ed25519 key; allowed: ssh-keygen -t ed25519")
  return key


def fingerprint(public_key: ed25519.Ed25519PublicKey) -> str:
  """``SHA256:<base64, unpadded>`` of the key's SSH wire form (as ``ssh-keygen -l``)."""
  line = public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
  blob = base64.b64decode(line.split()[1])
  return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def load_trusted(path: str | Path) -> dict[str, ed25519.Ed25519PublicKey]:
  """The Ed25519 keys of a trusted-entities YAML file, by fingerprint."""
  path = Path(path).expanduser()
  try:
    entries = yaml.safe_load(path.read_text())
  except (OSError, yaml.YAMLError) as e:
    raise ValueError(f"trusted entities {str(path)!r} cannot be read: {e}") from e
  if not isinstance(entries, dict) or not entries:
    raise ValueError(
      f"trusted entities {str(path)!r}: expected a mapping "
      "{label: 'ssh-ed25519 AAAA...'} with at least one key"
    )
  keys = {}
  for label, text in entries.items():
    try:
      key = serialization.load_ssh_public_key(str(text).encode())
    except (ValueError, TypeError) as e:
      raise ValueError(f"trusted entity {label!r} is not an SSH public key: {e}") from e
    if not isinstance(key, ed25519.Ed25519PublicKey):
      raise ValueError(
        f"trusted entity {label!r} is not an Ed25519 key; allowed: "
        "'ssh-ed25519 ...' (ssh-keygen -t ed25519)"
      )
    keys[fingerprint(key)] = key
  return keys


def digest(fab_sha256_hex: str, run_config: Mapping[str, Any]) -> bytes:
  """What a signature covers: the bundle's hash and the run config (see the module docstring)."""
  body = {k: v for k, v in run_config.items() if k not in SIGNATURE_KEYS}
  text = json.dumps(body, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(f"{fab_sha256_hex}\n{text}".encode()).digest()


def sign(
  private_key: ed25519.Ed25519PrivateKey,
  fab_sha256_hex: str,
  run_config: Mapping[str, Any],
  signed_at: int | None = None,
) -> dict[str, Any]:
  """The three run-config entries that sign ``run_config`` with ``fab_sha256_hex``.

  ``run_config`` must hold its ``run-nonce`` (:func:`new_nonce`; :func:`signed_overrides`
  draws it): a node refuses a signed run without one.
  """
  signed_at = int(time.time()) if signed_at is None else int(signed_at)
  sig = private_key.sign(_message(digest(fab_sha256_hex, run_config), signed_at))
  return {
    "signer": fingerprint(private_key.public_key()),
    "signature": base64.urlsafe_b64encode(sig).decode().rstrip("="),
    "signed-at": signed_at,
  }


def new_nonce() -> str:
  """128 bits of the operating system's entropy, as 32 hex digits (a run's ``run-nonce``)."""
  return secrets.token_hex(16)


def verify(
  trusted: Mapping[str, ed25519.Ed25519PublicKey],
  fab_sha256_hex: str,
  run_config: Mapping[str, Any],
) -> str:
  """Returns the signer's fingerprint; raises :class:`UntrustedRun` saying why not.

  Checks the signature and the nonce's form, not the age (:func:`check_age`): a run's later
  rounds carry its first round's signature.
  """
  signer = run_config.get("signer", "")
  if not signer or not run_config.get("signature"):
    raise UntrustedRun(
      "signer",
      "the run is not signed (run config 'signer'/'signature' empty); this "
      "client computes only runs signed by a key in its trusted entities",
    )
  key = trusted.get(signer)
  if key is None:
    raise UntrustedRun(
      "signer",
      f"the run is signed by {signer}, which is not among this client's "
      f"trusted entities {sorted(trusted)}",
    )
  try:
    sig = _b64url_decode(str(run_config["signature"]))
    message = _message(digest(fab_sha256_hex, run_config), int(run_config.get("signed-at", 0)))
  except (ValueError, TypeError, OverflowError) as e:
    raise UntrustedRun("signature", f"the run's signature cannot be read: {e}") from e
  try:
    key.verify(sig, message)
  except InvalidSignature:
    raise UntrustedRun(
      "signature",
      f"the signature by {signer} does not match this bundle "
      f"({fab_sha256_hex[:12]}...) and run config",
    ) from None
  if not NONCE_PATTERN.fullmatch(str(run_config.get(NONCE_KEY, ""))):
    raise UntrustedRun(
      NONCE_KEY,
      f"the signed run config's {NONCE_KEY} is {run_config.get(NONCE_KEY)!r}; allowed: 32 "
      "hex digits, drawn by python -m fedlap_flower.runtime.run_signature for each run",
    )
  return signer


def check_age(
  signed_at: int,
  now: float,
  max_age: float = DEFAULT_MAX_RUN_AGE,
  clock_skew: float = DEFAULT_CLOCK_SKEW,
) -> None:
  """Raises :class:`UntrustedRun` unless ``signed_at`` (Unix seconds) lies in
  ``[now - max_age - clock_skew, now + clock_skew]``."""
  age = float(now) - float(signed_at)
  if age < -clock_skew:
    raise UntrustedRun(
      "signed-at",
      f"the run was signed {-age:.0f} s in the future (signed-at={signed_at}); allowed: "
      f"at most the node's --clock-skew={clock_skew:g} s ahead of its clock",
    )
  if age > max_age + clock_skew:
    raise UntrustedRun(
      "signed-at",
      f"the run was signed {age:.0f} s ago (signed-at={signed_at}); allowed: at most the "
      f"node's --max-run-age={max_age:g} s (+ --clock-skew={clock_skew:g} s) before its first "
      "round reaches this client: sign the run again",
    )


def signed_overrides(
  key_path: str | Path, app: str | Path, run_config: list[str]
) -> dict[str, Any]:
  """``run_config`` (``flwr run --run-config`` strings) plus a fresh ``run-nonce`` and the
  signature over the bundle ``flwr run`` builds from ``app`` and the run config the clients
  will see."""
  from flwr.cli.build import build_fab_from_disk  # pylint: disable=g-import-not-at-top
  from flwr.common.config import (  # pylint: disable=g-import-not-at-top
    flatten_dict,
    fuse_dicts,
    get_fab_config,
    parse_config_args,
  )

  fab = build_fab_from_disk(Path(app))
  overrides = parse_config_args(run_config or None)
  clash = sorted(set(overrides) & set(SIGNED_BY_TOOL))
  if clash:
    raise ValueError(f"run config {clash}: set by the signature, not by hand")
  overrides[NONCE_KEY] = new_nonce()
  defaults = flatten_dict(get_fab_config(fab)["tool"]["flwr"]["app"].get("config", {}))
  fused = fuse_dicts(defaults, overrides)
  private = load_private_key(key_path)
  return {**overrides, **sign(private, hashlib.sha256(fab).hexdigest(), fused)}


def _toml_value(v) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, float) and v == float("inf"):
    return "inf"
  if isinstance(v, (int, float)):
    return repr(v)
  return json.dumps(str(v))  # a TOML basic string


def write_toml(path: Path, values: Mapping[str, Any]) -> Path:
  """Flat ``key = value`` TOML (keys may hold '-')."""
  path.write_text("".join(f'"{k}" = {_toml_value(v)}\n' for k, v in values.items()))
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description="Signs a run of the fedlap_flower app: writes a "
    "run-config TOML for `flwr run APP SUPERLINK --run-config FILE`."
  )
  p.add_argument("--key", required=True, help="the operator's Ed25519 private key (OpenSSH)")
  p.add_argument("--app", default=str(Path(__file__).resolve().parent.parent / "app"))
  p.add_argument(
    "--run-config",
    action="append",
    default=[],
    help="as flwr run's --run-config (\"key=value ...\")",
  )
  p.add_argument("--out", required=True, type=Path)
  args = p.parse_args(argv)
  values = signed_overrides(args.key, args.app, args.run_config)
  write_toml(args.out, values)
  print(f"signed by {values['signer']}: {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
