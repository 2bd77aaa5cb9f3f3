"""Which node holds which partition: ``partition-id`` bound to the node the SuperLink authenticated.

A client says which partition it holds (its node config's ``partition-id``);
the server cannot read that config. What it can trust is what the SuperLink
tells it about a node (``Grid.get_nodes()``: the node id the SuperLink
assigned, the node's public key and when it connected). With
``--enable-supernode-auth`` a node id belongs to one public key the operator
registered (``flwr supernode register``), and every request of the node is
signed with that key; without it a SuperNode registers itself with a key it
makes up at start.

:class:`PartitionBinding` binds each partition to one node for the run:

* ``partition-keys`` given (run config, ``"0=SHA256:... 1=SHA256:..."``, the
  fingerprints ``ssh-keygen -l -f KEY.pub`` prints for the keys the operator
  registered): a node holds the partition its key maps to, nothing else; a
  node whose key is not listed takes no part. With
  ``--enable-supernode-auth`` this is enforced by the SuperLink's signature
  checks: a client can only ever answer for its own partition.
* no ``partition-keys``: first come. A node not yet bound is asked for its
  ``partition-id`` (:meth:`PartitionBinding.claim`); it gets the partition if
  no connected node holds it. Claims for one free partition in the same
  round go to the node that connected first (``last_activated_at`` as the
  SuperLink records it); equal or unknown times bind none of them. A bound
  node keeps its partition while it stays connected
  (:meth:`PartitionBinding.release_absent` frees it when the SuperLink no
  longer lists the node).

What a partition's replies say about its data is pinned for the run at its
first accepted reply (:meth:`PartitionBinding.pin`: ``num-examples``, the
client's ``N_k``, which weights it under ``server.weighting='size'``): a
later reply for the partition that says otherwise is refused, whichever node
holds the partition then (a pin outlives the node's binding: the records are
the partition's). With ``partition-keys`` the pinned value is that of the
authenticated node; a value a client states from its first reply on is not
verified (docs/flower.md says what it can still do).

Residual risk without ``partition-keys``: a node that claims a partition
before its owner connects, or while its owner is disconnected, holds it
(the owner's replies are then refused, and the intruder's reply counts as
that partition's; every reply is still checked as any other client's). Two
nodes claiming one partition at the same moment deny it to both. The
deployment that removes this names every node's key in ``partition-keys``.

No ``flwr`` here; :func:`key_fingerprint` needs ``cryptography`` (a
dependency of ``flwr``).
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from fedlap_jax.checks import ConfigError

FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")


def key_fingerprint(public_key: bytes) -> str:
  """``SHA256:...`` of a node's public key, as ``ssh-keygen -l -f KEY.pub`` prints it.

  Args:
    public_key: the key as the SuperLink stores it (PEM SubjectPublicKeyInfo,
      ``NodeInfo.public_key``).

  Raises:
    ValueError: not a PEM public key.
  """
  from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top

  key = serialization.load_pem_public_key(public_key)
  openssh = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
  blob = base64.b64decode(openssh.split()[1])
  return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_partition_keys(text: str, num_partitions: int) -> dict[str, int]:
  """``"0=SHA256:... 1=SHA256:..."`` as ``{fingerprint: partition}`` (``{}`` for ``""``).

  Raises:
    ValueError: a token that is not ``K=SHA256:...``, a partition outside
      ``[0, num_partitions)``, or a partition or key named twice.
  """
  out: dict[str, int] = {}
  seen: set[int] = set()
  for token in str(text).split():
    pid, sep, fingerprint = token.partition("=")
    if not sep or not pid.isdigit() or not FINGERPRINT.match(fingerprint):
      raise ValueError(
        f"partition-keys: {token!r} is invalid; allowed: PARTITION=SHA256:... "
        "(the fingerprint ssh-keygen -l -f KEY.pub prints), separated by spaces"
      )
    k = int(pid)
    if not 0 <= k < num_partitions:
      raise ValueError(
        f"partition-keys: partition {k} is invalid; allowed: 0..{num_partitions - 1}"
      )
    if k in seen or fingerprint in out:
      raise ValueError(
        f"partition-keys: {token!r} names a partition or key a second time; "
        "allowed: each partition and each key once"
      )
    seen.add(k)
    out[fingerprint] = k
  return out


class NodeFacts(NamedTuple):
  """What the SuperLink says about a connected node.

  Attributes:
    node_id: the id the SuperLink assigned.
    fingerprint: :func:`key_fingerprint` of its public key (``""``: unknown).
    activated: when it last connected, ISO time as the SuperLink records it
      (``""``: unknown).
  """

  node_id: int
  fingerprint: str = ""
  activated: str = ""


class PartitionBinding:
  """Partition <-> node for one run (see the module docstring).

  Refusals are returned as ``{node_id: reason}``; the reasons name
  ``partition-id`` or ``partition-keys``.
  """

  def __init__(self, num_partitions: int, keys: Mapping[str, int] | None = None):
    self.num_partitions = int(num_partitions)
    self.keys = dict(keys or {})
    self._node_of: dict[int, int] = {}  # partition -> node
    self._partition_of: dict[int, int] = {}  # node -> partition
    self._pins: dict[tuple[int, str], Any] = {}  # (partition, name) -> value

  @property
  def by_key(self) -> bool:
    """True when ``partition-keys`` decides (no claims are taken)."""
    return bool(self.keys)

  def partition_of(self, node: int) -> int | None:
    return self._partition_of.get(int(node))

  def node_of(self, partition: int) -> int | None:
    return self._node_of.get(int(partition))

  def _bind(self, node: int, partition: int) -> None:
    self._node_of[partition] = node
    self._partition_of[node] = partition

  def check_pinned(self, partition: int, name: str, value) -> None:
    """Raises :class:`~fedlap_jax.checks.ConfigError` (``field``: ``name``) if ``name`` of
    ``partition`` is pinned to another value."""
    key = (int(partition), name)
    if key in self._pins and self._pins[key] != value:
      raise ConfigError(
        name,
        value,
        f"{self._pins[key]!r}, what partition {partition}'s first accepted reply said (fixed "
        "for the run)",
      )

  def pin(self, partition: int, name: str, value) -> None:
    """Pins ``name`` of ``partition`` to ``value`` for the run (a first value stays).

    Raises:
      ValueError: it is pinned to another value (:meth:`check_pinned`).
    """
    self.check_pinned(partition, name, value)
    self._pins.setdefault((int(partition), name), value)

  @property
  def pins(self) -> dict[str, dict[str, Any]]:
    """``{name: {partition (str): value}}`` of every pin (JSON-ready, for a checkpoint)."""
    out: dict[str, dict[str, Any]] = {}
    for (partition, name), value in sorted(self._pins.items()):
      out.setdefault(name, {})[str(partition)] = value
    return out

  def restore_pins(self, pins: Mapping[str, Mapping[str, Any]]) -> None:
    """Pins what :attr:`pins` returned (a resumed run)."""
    for name, values in pins.items():
      for partition, value in values.items():
        self.pin(int(partition), name, value)

  def release_absent(self, connected: Iterable[int]) -> list[int]:
    """Frees the partitions of nodes not in ``connected``; returns the freed nodes."""
    connected = {int(n) for n in connected}
    gone = [n for n in self._partition_of if n not in connected]
    for n in gone:
      del self._node_of[self._partition_of.pop(n)]
    return gone

  def bind_by_key(self, nodes: Sequence[NodeFacts]) -> dict[int, str]:
    """With ``partition-keys``: binds every listed node to its key's partition."""
    refused = {}
    for facts in nodes:
      node = int(facts.node_id)
      if node in self._partition_of:
        continue
      partition = self.keys.get(facts.fingerprint)
      if partition is None:
        refused[node] = (
          f"partition-keys: the node's public key "
          f"{facts.fingerprint or '(none reported)'} is not listed; allowed: the "
          "keys of partition-keys"
        )
        continue
      holder = self._node_of.get(partition)
      if holder is not None:  # a second node with one key: the SuperLink refuses that
        refused[node] = (
          f"partition-keys: partition {partition} is held by node {holder} with the same key"
        )
        continue
      self._bind(node, partition)
    return refused

  def claim(self, claims: Sequence[tuple[NodeFacts, int]]) -> dict[int, str]:
    """First come: binds claimed free partitions; returns the refused claims' reasons.

    Args:
      claims: ``(node, partition-id it reported)`` of nodes not bound yet
        (``partition-id`` already checked to be an int in range).
    """
    if self.by_key:
      raise ValueError("partition-keys decides the binding; claims are not taken")
    refused = {}
    by_partition: dict[int, list[NodeFacts]] = {}
    for facts, partition in claims:
      by_partition.setdefault(int(partition), []).append(facts)
    for partition, facts in sorted(by_partition.items()):
      holder = self._node_of.get(partition)
      if holder is not None:
        for f in facts:
          refused[int(f.node_id)] = (
            f"partition-id={partition} is held by node {holder} for "
            "this run (first come); allowed: a partition no connected "
            "node holds"
          )
        continue
      ordered = sorted(facts, key=lambda f: f.activated)
      first = ordered[0]
      if len(ordered) > 1 and (not first.activated or first.activated == ordered[1].activated):
        nodes = sorted(int(f.node_id) for f in facts)
        for f in facts:
          refused[int(f.node_id)] = (
            f"partition-id={partition} is claimed at once by nodes "
            f"{nodes}, none connected first; none is bound (name each "
            "node's key in partition-keys)"
          )
        continue
      self._bind(int(first.node_id), partition)
      for f in ordered[1:]:
        refused[int(f.node_id)] = (
          f"partition-id={partition} is held by node {first.node_id}, "
          "which connected first; allowed: a partition no connected "
          "node holds"
        )
    return refused
