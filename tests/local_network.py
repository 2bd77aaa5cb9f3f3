"""The tests' local network: whether loopback is up, and free TCP ports for the processes the
tests start (SuperLink, SuperNodes, JAX's coordinator).

Ports come from below the kernel's ephemeral range (Linux: 32768-60999 by default). A port
the kernel hands out for ``bind(0)`` is one it may hand to the next outbound connection too (a
SuperNode's to the SuperLink, Ray's, a worker's to JAX's coordinator), and one such connection
took a port between the check and a SuperNode's bind ("address already in use"). Below that
range only an explicit bind takes a port.
"""

from __future__ import annotations

import random
import socket

PORTS = range(20_000, 32_768)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` in :data:`PORTS` that was free a moment ago and that this process
  has not handed out before."""
  rng = random.Random()  # seeded from the system's entropy: the xdist workers draw apart
  for _ in range(200):
    port = rng.choice(PORTS)
    if port in _handed_out:
      continue
    with socket.socket() as s:
      try:
        s.bind((host, port))
      except OSError:
        continue
    _handed_out.add(port)
    return port
  raise RuntimeError(f"no free TCP port on {host} in {PORTS.start}-{PORTS.stop - 1}")


def loopback_up(host: str = "127.0.0.1") -> bool:
  """Whether this process can listen on ``host`` and connect to itself there (not in a bare
  network namespace, ``unshare -n`` without ``ip link set lo up``)."""
  try:
    with socket.socket() as s:
      s.bind((host, 0))
      s.listen(1)
      with socket.create_connection(s.getsockname(), timeout=2):
        return True
  except OSError:
    return False
