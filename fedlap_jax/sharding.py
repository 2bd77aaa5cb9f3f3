"""Clients sharded over devices (and hosts) with ``jax.sharding``.

The stacked client axis of a round is split over a one-dimensional device
mesh with axis name ``"clients"``: every device runs ``local_approx`` on its
block of clients, one after another (``jax.shard_map`` around ``lax.map``;
``client_backend="auto"`` does this whenever JAX sees several devices), the synthetic sets
and radii come back as arrays sharded over the same axis, and the server
update runs on the gathered union as before. Results equal the single-device
round up to float reduction order (``tests/integration/test_sharding.py`` checks 1 vs 4
CPU devices).

If the number of clients ``K`` is not a multiple of the number of devices
``D``, the client axis is padded inside the round with *empty* clients (no
records, every synthetic slot masked, keys zero); their outputs are dropped
before the server step, so they change nothing but cost ``ceil(K / D) * D - K``
clients' work.

Use it through the round::

  fedlap, model = REGISTRY["fedlap"], ModelFns(apply_fn)
  round_fn = rounds.make_round_fn(fedlap, config, model, client_backend="shard")  # all devices
  round_fn = rounds.make_round_fn(fedlap, config, model, client_backend="shard",
                                  mesh=client_mesh(jax.devices()[:2]))
  clients = put_clients(clients)       # once: each device keeps its block

A sharded round places its own inputs (:class:`PlacedRound`): the state is
replicated over the mesh and the client data sharded over its client axis,
each only where it is not already, so the state of round 1 (on one device) and
the replicated state later rounds return run the same compiled program, and
client data passed unplaced is placed once (and kept while the same object is
passed again). Placing it yourself with :func:`put_clients` avoids holding a
second copy.

On one host with several GPUs this uses every local GPU. On several hosts, call
:func:`initialize_hosts` (``jax.distributed.initialize`` with CPU hosts set up
and checked) first on every host (same program on every host);
``jax.devices()`` then lists the devices of all hosts and
:func:`client_mesh` spans them. Inputs must then be global arrays: build the
client data on every host and place it with :func:`put_clients` (which uses
``jax.make_array_from_callback``, so each host only materialises the blocks
of its own devices); the state returned by ``init_state`` can be placed with
:func:`replicate`. Read outputs sharded over hosts with
``jax.experimental.multihost_utils.process_allgather``.
``tests/integration/test_sharding.py`` runs this as two processes, on one host and on two
network hosts (namespaces joined by a virtual Ethernet link), and gets the
single-device round. On CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before JAX starts)
splits the host into ``N`` devices for testing.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedlap_jax.types import PyTree

AXIS = "clients"


def client_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh with axis ``"clients"`` over ``devices`` (default: all, all hosts)."""
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("client_mesh needs at least one device")
  return Mesh(np.array(devices), (AXIS,))


def _cpu_only() -> bool:
  """Whether JAX will compute on the CPU, decided without starting a backend.

  ``jax_platforms`` if set (``JAX_PLATFORMS=cpu``); otherwise True when no
  accelerator plugin is installed (GPU plugins live in the ``jax_plugins``
  namespace or its entry points, TPUs need ``libtpu``).
  """
  platforms = (jax.config.jax_platforms or "").strip().lower()  # type: ignore[attr-defined]
  if platforms:
    return platforms == "cpu"
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pkgutil  # pylint: disable=g-import-not-at-top

  if importlib.util.find_spec("libtpu") is not None:
    return False
  if importlib.metadata.entry_points(group="jax_plugins"):
    return False
  try:
    import jax_plugins  # pylint: disable=g-import-not-at-top
  except ImportError:
    return True
  return not any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def _is_loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


def initialize_hosts(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  cpu: bool | None = None,
  **kwargs,
) -> None:
  """``jax.distributed.initialize`` for rounds sharded over hosts; call it first on every host.

  On CPU hosts JAX's cross-process collectives go through gloo (set here). Gloo
  tells the other processes to connect to the address this host's *name*
  resolves to; where that is loopback (``127.0.1.1 myhost`` is a common
  default in ``/etc/hosts``) every connection from another host is refused,
  and the first sharded round fails only after gloo's timeout. So on CPU, with
  a coordinator on another address, a loopback host name is refused here with
  the fix in the message. Hosts joined over a network are checked this way in
  ``tests/integration/test_sharding.py`` (two network namespaces linked by a virtual
  Ethernet pair).

  Args:
    coordinator_address, num_processes, process_id: as for
      ``jax.distributed.initialize`` (None: detected from the cluster, e.g. SLURM).
    cpu: whether the processes compute on CPU; default: ``jax_platforms`` is
      ``"cpu"`` (``JAX_PLATFORMS=cpu``), or it is unset and no accelerator
      plugin is installed.
    **kwargs: passed on (e.g. ``initialization_timeout``, ``local_device_ids``).

  Raises:
    ValueError: on CPU, the host name resolves to loopback (or not at all)
      while the coordinator is on another host.
  """
  if cpu is None:
    cpu = _cpu_only()
  if cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  multi_host = (
    coordinator_address is not None
    and (num_processes or 0) > 1
    and not _is_loopback(coordinator_address.rsplit(":", 1)[0].strip("[]"))
  )
  if cpu and multi_host:
    name = socket.gethostname()
    try:
      address, problem = socket.gethostbyname(name), None
    except OSError as e:
      address, problem = None, f"does not resolve ({e})"
    if address is not None and _is_loopback(address):
      problem = (
        f"resolves to {address}, a loopback address, so the other hosts' connections "
        "would be refused"
      )
    if problem:
      raise ValueError(
        f"host name {name!r} {problem}: gloo, which carries cross-process "
        "collectives on CPU, announces this host by its name. Allowed: a name "
        "that resolves to this host's address on the network of the coordinator "
        f"{coordinator_address!r} (an /etc/hosts or DNS entry), or every process "
        "on this host with the coordinator on localhost"
      )
  jax.distributed.initialize(
    coordinator_address, num_processes=num_processes, process_id=process_id, **kwargs
  )


def padded_size(num_clients: int, num_devices: int) -> int:
  """``ceil(K / D) * D``: the client axis length the sharded round computes."""
  return math.ceil(num_clients / num_devices) * num_devices


def _pad_leading(tree: PyTree, size: int) -> PyTree:
  def pad(a):
    extra = size - a.shape[0]
    if extra == 0:
      return a
    return jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)])

  return jax.tree.map(pad, tree)


def map_clients(
  fn: Callable[..., PyTree], args: PyTree, *, replicated: tuple = (), mesh: Mesh | None = None
) -> PyTree:
  """``fn(block, *replicated)`` on blocks of the leading (client) axis of ``args``, one per device.

  ``fn`` maps a block ``(k, ...)`` to outputs with the same leading axis (e.g.
  ``lambda b: jax.lax.map(one_client, b)``). Zero-padded clients fill the axis up to a
  multiple of the device count and are cut from the outputs. Pass arrays that
  every device needs whole (the global model, the learning rate) as
  ``replicated`` rather than closing over them.

  Args:
    fn: the per-block function.
    args: pytree whose leaves share the leading axis ``K``.
    replicated: extra arguments given whole to every device.
    mesh: a 1-D mesh with axis ``"clients"`` (default :func:`client_mesh`).

  Returns:
    ``fn``'s outputs for the ``K`` real clients.
  """
  mesh = client_mesh() if mesh is None else mesh
  if mesh.axis_names != (AXIS,):
    raise ValueError(f"mesh.axis_names={mesh.axis_names!r} is invalid; allowed: ({AXIS!r},)")
  sizes = {a.shape[0] for a in jax.tree.leaves(args)}
  if len(sizes) != 1:
    raise ValueError(f"map_clients: leaves disagree on the client axis: sizes {sorted(sizes)}")
  (k,) = sizes
  kp = padded_size(k, mesh.size)
  spec = PartitionSpec(AXIS)
  in_specs = (spec,) + (PartitionSpec(),) * len(replicated)
  sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)
  out = sharded(_pad_leading(args, kp), *replicated)
  return jax.tree.map(lambda a: a[:k], out)


def client_sharding(num_clients: int, mesh: Mesh | None = None) -> NamedSharding:
  """How :func:`put_clients` places arrays with ``num_clients`` on the leading axis.

  Sharded over ``"clients"`` when ``num_clients`` is a multiple of the device
  count (``jax.sharding`` shards evenly), else replicated (the round then pads
  and splits the client axis itself).
  """
  mesh = client_mesh() if mesh is None else mesh
  spec = PartitionSpec(AXIS) if num_clients % mesh.size == 0 else PartitionSpec()
  return NamedSharding(mesh, spec)


def _place(a: Any, target: NamedSharding) -> jax.Array:
  """``a`` on ``target``; ``a`` itself if it is there already (no copy)."""
  if isinstance(a, jax.Array):
    if a.sharding.is_equivalent_to(target, a.ndim):
      return a
    if jax.process_count() == 1 or not a.is_fully_addressable:
      return jax.device_put(a, target)  # device to device, or a global array resharded
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(
        _place(jax.random.key_data(a), target), impl=jax.random.key_impl(a)
      )
  # A host value (or a process-local array on several hosts), taken to be the
  # same on every process: each process builds the blocks of its own devices.
  a = np.asarray(a)
  return jax.make_array_from_callback(a.shape, target, lambda idx: a[idx])


def put_clients(tree: PyTree, mesh: Mesh | None = None) -> PyTree:
  """Places arrays with a leading client axis sharded over ``mesh`` (any number of hosts).

  The client axis must be a multiple of the device count (``jax.sharding``
  shards evenly); otherwise the arrays are replicated and the round pads and
  splits them itself (:func:`client_sharding`). Each host only builds the
  blocks of its own devices; arrays already placed so are returned as they are.
  """
  mesh = client_mesh() if mesh is None else mesh
  return jax.tree.map(lambda a: _place(a, client_sharding(np.shape(a)[0], mesh)), tree)


def replicate(tree: PyTree, mesh: Mesh | None = None) -> PyTree:
  """Places every array of ``tree`` fully on every device of ``mesh`` (no copy where it is)."""
  mesh = client_mesh() if mesh is None else mesh
  sharding = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda a: _place(a, sharding), tree)


class PlacedRound:
  """A jitted ``round(state, clients)`` that first places its inputs on ``mesh``.

  The state is replicated (:func:`replicate`) and the client data sharded over
  the client axis (:func:`put_clients`), each only where it is not placed so
  already. The state a sharded round returns is replicated, so from round 2
  on it passes through; without this, the state of round 1 (on one device) and
  the one round 1 returns (on the mesh) would compile two programs. Client data
  that is not placed yet is placed on the first call and the placed copy is
  kept for as long as the same object comes back (a run passes the same client
  data every round), so it moves to the devices once; placing it yourself with
  :func:`put_clients` avoids holding both copies. Attribute access (``lower``,
  ``_cache_size``, ...) goes to the jitted function.
  """

  def __init__(self, fn: Callable, mesh: Mesh):
    self.fn = fn
    self.mesh = mesh
    self._clients = (None, None)  # (the object passed, its placed copy)

  def __call__(self, state: PyTree, clients: PyTree):
    if clients is not self._clients[0]:
      self._clients = (clients, put_clients(clients, self.mesh))
    return self.fn(replicate(state, self.mesh), self._clients[1])

  def __getattr__(self, name: str):
    if name in ("fn", "mesh", "_clients"):  # not set yet (e.g. during copy): no recursion
      raise AttributeError(name)
    return getattr(self.fn, name)
