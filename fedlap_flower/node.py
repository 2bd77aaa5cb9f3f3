"""One client's node: ``flower-supernode --isolation process`` and its long-lived ClientApp.

``python -m fedlap_flower.node --trusted-entities FILE [flower-supernode flags]``

* runs Flower's ``flower-supernode`` in this process, with its flags (TLS,
  SuperNode key, node config, Runtime API ``--host``/``--port``) and
  ``--isolation process``, so the SuperNode starts no executor of its own;
* starts :mod:`fedlap_flower.warm_clientapp` as a child process (it exits
  when this process does) that runs every ClientApp task of this SuperNode in
  one long-lived process, only for runs signed by a key of
  ``--trusted-entities`` (:mod:`fedlap_flower.run_signature`);
  ``--allow-unsigned-runs`` (tests on one machine only) skips the signature.
  The SuperNode wakes it through a pipe as soon as a message and its arrays
  are stored, so it asks for tasks only then (and once a second);
* makes the SuperNode ask the SuperLink for messages every ``--poll`` seconds
  (Flower 1.42 waits 3 s between two pulls while idle and 0.5 s while a reply
  is pending; a round would wait for the slowest of those waits), and retry a
  message's arrays not yet on the SuperLink after 50 ms (Flower: 1, 2, 4 s).

``--trusted-entities`` is this wrapper's and is not passed to Flower: Flower's
own check would refuse every bundle submitted with ``flwr run``
(:mod:`fedlap_flower.run_signature` says why).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time as _time

from fedlap_flower import run_signature
from fedlap_flower.prompt_grid import quick_object_pulls


class _CappedSleep:
  """The ``time`` module with ``sleep`` capped at ``cap`` seconds."""

  def __init__(self, cap: float):
    self.cap = cap

  def sleep(self, seconds: float) -> None:
    _time.sleep(min(seconds, self.cap))

  def __getattr__(self, name):
    return getattr(_time, name)


def _waking(pull_and_store, wake_fd: int):
  """``pull_and_store`` that, once a message and its arrays are stored (a task exists),
  wakes the ClientApp process by writing one byte to ``wake_fd``."""

  def wrapped(*args, **kwargs):
    run_id = pull_and_store(*args, **kwargs)
    if run_id is not None:
      try:
        os.write(wake_fd, b"!")
      except (BlockingIOError, BrokenPipeError):  # already woken, or the worker is gone
        pass
    return run_id

  return wrapped


def _runtime_api(rest: list[str]) -> tuple[str, list[str]]:
  """The SuperNode's Runtime API address and the worker's TLS flags for it."""
  p = argparse.ArgumentParser(add_help=False)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", default="9094")
  p.add_argument("--ssl-certfile")
  p.add_argument("--ssl-ca-certfile")
  args, _ = p.parse_known_args(rest)
  host = f"[{args.host}]" if ":" in args.host else args.host
  if host in ("0.0.0.0", "[::]"):
    raise SystemExit(
      f"--host {args.host}: the Runtime API serves this node's tasks and "
      "must stay on this machine; allowed: 127.0.0.1 (the default) or ::1"
    )
  tls = ["--root-certificates", args.ssl_ca_certfile] if args.ssl_certfile else []
  if args.ssl_certfile and not args.ssl_ca_certfile:
    raise SystemExit("--ssl-certfile needs --ssl-ca-certfile (the worker verifies the Runtime API)")
  return f"{host}:{args.port}", tls


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(
    usage="python -m fedlap_flower.node --trusted-entities FILE [flower-supernode flags]",
    description=__doc__.split("\n\n")[0],
    epilog=(
      "Every other flag goes to Flower's flower-supernode (flower-supernode --help), e.g.\n"
      "  --superlink HOST:PORT  --root-certificates FILE  --auth-supernode-private-key FILE\n"
      "  --node-config \"partition-id=K data-path='...' state-dir='...' max-epsilon=E\"\n"
      "--isolation is set by this command (process)."
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
    "--poll",
    type=float,
    default=0.5,
    help="seconds between two pulls from the SuperLink (Flower's: 3)",
  )
  ours, rest = p.parse_known_args(argv)
  if any(a == "--isolation" or a.startswith("--isolation=") for a in rest):
    p.error("--isolation is set by this command (process)")
  if not ours.allow_unsigned_runs:
    if not ours.trusted_entities:
      p.error(
        "--trusted-entities FILE is required: the node computes only runs signed by a "
        "key it trusts (--allow-unsigned-runs: tests on one machine only)"
      )
    run_signature.load_trusted(ours.trusted_entities)  # fail now, not at the first run
  if not ours.poll > 0:
    p.error(f"--poll {ours.poll}: allowed: seconds > 0")
  address, tls = _runtime_api(rest)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  worker = [
    sys.executable,
    "-m",
    "fedlap_flower.warm_clientapp",
    "--runtime-api-address",
    address,
    "--parent-pid",
    str(os.getpid()),
    "--wake-fd",
    str(wake_r),
    *tls,
  ]
  worker += (
    ["--allow-unsigned-runs"]
    if ours.allow_unsigned_runs
    else ["--trusted-entities", ours.trusted_entities]
  )
  # pylint: disable-next=consider-using-with  (it ends with this process)
  subprocess.Popen(worker, pass_fds=(wake_r,))
  os.close(wake_r)

  from flwr.supernode.cli.flower_supernode import flower_supernode  # pylint: disable=g-import-not-at-top

  sci = importlib.import_module("flwr.supernode.start_client_internal")
  sci.time = _CappedSleep(ours.poll)
  sci._pull_and_store_message = _waking(sci._pull_and_store_message, wake_w)  # pylint: disable=protected-access
  quick_object_pulls(sci)  # arrays not yet on the SuperLink: retry after 50 ms, not 1 s
  sys.argv = ["flower-supernode", *rest, "--isolation", "process"]
  flower_supernode()
  return 0


if __name__ == "__main__":
  sys.exit(main())
