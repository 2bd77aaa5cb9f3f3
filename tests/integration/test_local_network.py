"""The tests' local network: the ports they give their servers (below the kernel's ephemeral
range, free, never handed out twice by one process) and the loopback check."""

from __future__ import annotations

import socket

import pytest
from local_network import PORTS, free_port, loopback_up


def _ephemeral_range() -> range | None:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = map(int, f.read().split())
  except OSError:
    return None
  return range(low, high + 1)


def test_ports_are_free_distinct_and_outside_the_ephemeral_range():
  ports = [free_port() for _ in range(50)]
  assert len(set(ports)) == len(ports)
  assert all(p in PORTS for p in ports)
  ephemeral = _ephemeral_range()
  if ephemeral is not None:  # this machine's range, where the kernel reports it
    assert not set(ports) & set(ephemeral), (ephemeral, PORTS)
  for port in ports[:5]:  # each was free: a listener takes it
    with socket.socket() as s:
      s.bind(("127.0.0.1", port))
      s.listen()


def test_a_port_taken_now_is_not_handed_out(monkeypatch):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    taken.listen()
    monkeypatch.setattr("local_network.PORTS", range(port, port + 1))
    with pytest.raises(RuntimeError, match="no free TCP port"):
      free_port()


def test_loopback_is_down_on_an_address_this_machine_does_not_have():
  assert not loopback_up("192.0.2.1")  # TEST-NET-1 (RFC 5737): assigned to no machine
