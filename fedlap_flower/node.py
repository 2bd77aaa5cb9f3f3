"""One client's node: Flower's ``flower-supernode`` and its long-lived ClientApp.

``python -m fedlap_flower.node --trusted-entities FILE [flower-supernode flags]``

* runs Flower's ``flower-supernode`` in this process, with its flags (TLS,
  SuperNode key, node config, Runtime API ``--host``/``--port``) and
  ``--isolation process``, so the SuperNode starts no executor of its own, and
  with a SuperExec secret only this node's worker holds;
* starts :mod:`fedlap_flower.runtime.warm_clientapp` as a child process (it
  exits when this process does) that runs every ClientApp task of this
  SuperNode in one long-lived process, only for runs signed by a key of
  ``--trusted-entities`` (:mod:`fedlap_flower.runtime.run_signature`), signed
  at most ``--max-run-age`` seconds before their first round reaches the node,
  and not computed before under another run; ``--allow-unsigned-runs`` (tests
  on one machine only) skips the signature;
* makes the SuperNode ask the SuperLink for messages every ``--poll`` seconds
  and wake the worker as soon as a message is stored
  (:mod:`fedlap_flower.runtime.supernode`).

The Runtime API serves this node's tasks: ``--host`` must resolve to loopback
addresses only (default ``127.0.0.1``); the SuperNode is given the address it
resolved to.

All of this rests on parts of Flower that are not its public API, checked at
start-up (:mod:`fedlap_flower.runtime.support`): on a Flower version it was not
tested with, or when a name it uses changed, the node says so and runs Flower's
own ``flower-supernode`` instead (subprocess isolation, Flower's polling, and
with ``--trusted-entities`` Flower's own check, which refuses every run not
signed through Flower Hub).

``--trusted-entities``, ``--max-run-age`` and ``--clock-skew`` are this
wrapper's and are not passed to Flower: Flower's own check would refuse every
bundle submitted with ``flwr run`` (:mod:`fedlap_flower.runtime.run_signature`
says why).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from fedlap_flower.runtime import run_signature, supernode, support

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = "9094"


def loopback_address(host: str) -> str:
  """The address ``host`` resolves to, if every address it resolves to is a loopback one.

  Raises:
    SystemExit: naming the host, what it resolved to and what is allowed.
  """
  allowed = "an address or name that resolves to loopback only: 127.0.0.1 (the default), ::1"
  try:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except (socket.gaierror, UnicodeError) as e:
    raise SystemExit(f"--host {host}: cannot be resolved ({e}); allowed: {allowed}") from None
  addresses = [info[4][0] for info in infos]
  outside = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
  if not addresses or outside:
    raise SystemExit(
      f"--host {host} resolves to {sorted(set(addresses))}, not loopback only: the Runtime "
      "API serves this node's tasks and must stay on this machine; allowed: " + allowed
    )
  return addresses[0]


def _flag(args: list[str], name: str) -> str | None:
  value = None
  for i, a in enumerate(args):
    if a == name and i + 1 < len(args):
      value = args[i + 1]
    elif a.startswith(name + "="):
      value = a.split("=", 1)[1]
  return value


def _without(args: list[str], name: str) -> list[str]:
  out, skip = [], False
  for a in args:
    if skip:
      skip = False
    elif a == name:
      skip = True
    elif not a.startswith(name + "="):
      out.append(a)
  return out


def runtime_api(rest: list[str]) -> tuple[list[str], str, list[str]]:
  """``(flower-supernode flags with --host resolved, the Runtime API address, the worker's TLS
  flags for it)``."""
  host = loopback_address(_flag(rest, "--host") or DEFAULT_HOST)
  port = _flag(rest, "--port") or DEFAULT_PORT
  certfile, ca = _flag(rest, "--ssl-certfile"), _flag(rest, "--ssl-ca-certfile")
  if certfile and not ca:
    raise SystemExit("--ssl-certfile needs --ssl-ca-certfile (the worker verifies the Runtime API)")
  tls = ["--root-certificates", ca] if certfile else []
  flower = [*_without(rest, "--host"), "--host", host]
  return flower, (f"[{host}]" if ":" in host else host) + f":{port}", tls


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(
    usage="python -m fedlap_flower.node --trusted-entities FILE [flower-supernode flags]",
    description=__doc__.split("\n\n")[0],
    epilog=(
      "Every other flag goes to Flower's flower-supernode (flower-supernode --help), e.g.\n"
      "  --superlink HOST:PORT  --root-certificates FILE  --auth-supernode-private-key FILE\n"
      "  --node-config \"partition-id=K data-path='...' state-dir='...' max-epsilon=E\"\n"
      "  --host ADDRESS (loopback only)  --port PORT\n"
      f"--isolation and {supernode.SECRET_FLAG} are set by this command."
    ),
    formatter_class=argparse.RawDescriptionHelpFormatter,
    add_help=True,
  )
  p.add_argument(
    "--trusted-entities",
    default=None,
    help="YAML {label: 'ssh-ed25519 ...'}: keys whose signed runs this node computes",
  )
  p.add_argument(
    "--allow-unsigned-runs",
    action="store_true",
    help="compute unsigned runs too (tests on one machine only)",
  )
  p.add_argument(
    "--max-run-age",
    type=float,
    default=run_signature.DEFAULT_MAX_RUN_AGE,
    help="seconds a signed run may be old when its first round reaches this node "
    f"(default {run_signature.DEFAULT_MAX_RUN_AGE:g})",
  )
  p.add_argument(
    "--clock-skew",
    type=float,
    default=run_signature.DEFAULT_CLOCK_SKEW,
    help="seconds the signer's clock may differ from this node's "
    f"(default {run_signature.DEFAULT_CLOCK_SKEW:g})",
  )
  p.add_argument(
    "--poll",
    type=float,
    default=0.5,
    help="seconds between two pulls from the SuperLink (Flower's: 3)",
  )
  ours, rest = p.parse_known_args(argv)
  for flag in ("--isolation", supernode.SECRET_FLAG):
    if any(a == flag or a.startswith(flag + "=") for a in rest):
      p.error(f"{flag} is set by this command")
  if not ours.allow_unsigned_runs:
    if not ours.trusted_entities:
      p.error(
        "--trusted-entities FILE is required: the node computes only runs signed by a "
        "key it trusts (--allow-unsigned-runs: tests on one machine only)"
      )
    run_signature.load_trusted(ours.trusted_entities)  # fail now, not at the first run
  if not ours.poll > 0:
    p.error(f"--poll {ours.poll}: allowed: seconds > 0")
  if not ours.max_run_age > 0:
    p.error(f"--max-run-age {ours.max_run_age}: allowed: seconds > 0")
  if not ours.clock_skew >= 0:
    p.error(f"--clock-skew {ours.clock_skew}: allowed: seconds >= 0")
  flower, address, tls = runtime_api(rest)
  found = support.problems("supernode") + support.problems("worker")
  if found:
    supernode.run_stock(flower, ours.trusted_entities, dict.fromkeys(found))
  worker = [
    *tls,
    "--max-run-age",
    str(ours.max_run_age),
    "--clock-skew",
    str(ours.clock_skew),
    *(
      ["--allow-unsigned-runs"]
      if ours.allow_unsigned_runs
      else ["--trusted-entities", ours.trusted_entities]
    ),
  ]
  return supernode.run_warm(flower, worker, runtime_api=address, poll=ours.poll)


if __name__ == "__main__":
  sys.exit(main())
