r"""The operator's signature over a run: the app bundle (FAB) and its whole run config.

A client computes only runs that a key it trusts signed. Flower 1.42's own
check (``flower-supernode --trusted-entities``) accepts only bundles whose
signatures the SuperLink fetched from Flower Hub (``flwr app review``); a
bundle submitted from disk with ``flwr run`` reaches the SuperNodes with no
signature, so that check refuses every run of a self-hosted federation. This
module signs what the clients execute instead, with the same keys and the same
primitives (Ed25519, ``flwr.supercore.primitives.asymmetric_ed25519``):

* the digest: ``sha256(fab_sha256_hex + "\n" + JSON(run config))``, the run
  config being the fused one every ClientApp sees (the bundle's defaults with
  the submitted overrides), without the three signature keys, as JSON with
  sorted keys and no spaces;
* the signature: Ed25519 over ``create_message_to_sign(digest, signed_at)``
  (8-byte big-endian seconds, then the digest), as Flower signs a bundle;
* it travels in the run config: ``signer`` (the key's ``SHA256:...``
  fingerprint, as ``ssh-keygen -lf KEY.pub`` prints it), ``signature``
  (base64url) and ``signed-at`` (Unix seconds).

Trusted keys are a YAML file in the format of Flower's ``--trusted-entities``
(``{label: 'ssh-ed25519 AAAA... comment'}``).

Sign a run (the operator, with the key made by ``ssh-keygen -t ed25519``)::

  python -m fedlap_flower.run_signature --key keys/operator --app fedlap_flower/app \
      --run-config "config='cifar_dp' min-clients=4" --out run.toml
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
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.supercore.primitives.asymmetric_ed25519 import (
  create_message_to_sign,
  decode_base64url,
  load_private_key,
  sign_message,
  verify_signature,
)

SIGNATURE_KEYS = ("signer", "signature", "signed-at")


class UntrustedRun(ValueError):
  """A run without a valid signature by a trusted key."""


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
  """The three run-config entries that sign ``run_config`` with ``fab_sha256_hex``."""
  signed_at = int(time.time()) if signed_at is None else int(signed_at)
  sig = sign_message(
    private_key, create_message_to_sign(digest(fab_sha256_hex, run_config), signed_at)
  )
  return {
    "signer": fingerprint(private_key.public_key()),
    "signature": base64.urlsafe_b64encode(sig).decode().rstrip("="),
    "signed-at": signed_at,
  }


def verify(
  trusted: Mapping[str, ed25519.Ed25519PublicKey],
  fab_sha256_hex: str,
  run_config: Mapping[str, Any],
) -> str:
  """Returns the signer's fingerprint; raises :class:`UntrustedRun` saying why not."""
  signer = run_config.get("signer", "")
  if not signer or not run_config.get("signature"):
    raise UntrustedRun(
      "the run is not signed (run config 'signer'/'signature' empty); this "
      "client computes only runs signed by a key in its trusted entities"
    )
  key = trusted.get(signer)
  if key is None:
    raise UntrustedRun(
      f"the run is signed by {signer}, which is not among this client's "
      f"trusted entities {sorted(trusted)}"
    )
  try:
    sig = decode_base64url(str(run_config["signature"]))
    message = create_message_to_sign(
      digest(fab_sha256_hex, run_config), int(run_config.get("signed-at", 0))
    )
  except (ValueError, TypeError, OverflowError) as e:
    raise UntrustedRun(f"the run's signature cannot be read: {e}") from e
  if not verify_signature(key, message, sig):
    raise UntrustedRun(
      f"the signature by {signer} does not match this bundle "
      f"({fab_sha256_hex[:12]}...) and run config"
    )
  return signer


def signed_overrides(
  key_path: str | Path, app: str | Path, run_config: list[str]
) -> dict[str, Any]:
  """``run_config`` (``flwr run --run-config`` strings) plus the signature over the bundle
  ``flwr run`` builds from ``app`` and the run config the clients will see."""
  from flwr.cli.build import build_fab_from_disk  # pylint: disable=g-import-not-at-top
  from flwr.common.config import (  # pylint: disable=g-import-not-at-top
    flatten_dict,
    fuse_dicts,
    get_fab_config,
    parse_config_args,
  )

  fab = build_fab_from_disk(Path(app))
  overrides = parse_config_args(run_config or None)
  clash = sorted(set(overrides) & set(SIGNATURE_KEYS))
  if clash:
    raise ValueError(f"run config {clash}: set by the signature, not by hand")
  defaults = flatten_dict(get_fab_config(fab)["tool"]["flwr"]["app"].get("config", {}))
  fused = fuse_dicts(defaults, overrides)
  private = load_private_key(Path(key_path).expanduser())
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
  p.add_argument("--app", default=str(Path(__file__).resolve().parent / "app"))
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
