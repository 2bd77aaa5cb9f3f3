"""The app's messages as Flower records.

Train message (server -> client), ``RecordDict``:

* ``"arrays"``: the global parameters (:func:`params_to_record`: one float32
  Array, the leaves concatenated in sorted ``a/b/c`` path order);
* ``"config"``: ``server-round``, ``num-clients``, ``keys = "server"`` without DP (or in the
  test-only unsafe mode), else ``"client"``; ``federated-run``: the federated run's identity,
  the same across its resumes, under which a client keeps its carried state, and
  ``delivered-round`` (:mod:`fedlap_flower.federated_runs`);
* ``"message"``: the round plan's message without the model (FedLAP: the round's learning
  rates and DSA family key), its arrays by name (:func:`arrays_record`); ``"own"``: this
  client's own inputs (its keys; never under DP, where each client draws its own).

Train reply (client -> server):

* A model update (FedSGD, FedAvg, FedProx, FedAdam, DP-FedAvg, DP-FedProx): ``"arrays"``
  (the client's parameters, packed), as Flower's FedAvg expects. Another method's update
  (FedLAP's synthetic set, ``r_k`` and, with ``client.model_steps='noisy_real'``, its model
  delta; SCAFFOLD's model and ``delta c_k``; FedDM's / DSC's / PSG's synthetic set) travels
  as ``"update"``: its arrays by the names of the method's :class:`~fedlap_jax.method.Wire`
  (checked by :func:`record_to_wire`).
* ``"metrics"``: ``partition-id`` and ``num-examples``, or under DP ``epsilon``,
  ``run-epsilon`` (this Flower run's part of it), ``max-epsilon`` and ``dp-steps``;
  ``"status"`` (``status`` = ``ok`` | ``refused``, ``reason``, ``keys``). A refused round
  carries no arrays.

Query message (server -> client): ``"config"`` (``server-round``, ``ask =
"partition-id"``); the reply holds ``"metrics"`` with the client's
``partition-id`` only (:mod:`fedlap_flower.binding`).

The server reads a reply's arrays through :func:`record_to_wire` and :func:`record_to_like`,
which refuse anything but the dtypes and shapes above before using a value
(:mod:`fedlap_flower.replies`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flwr.app import Array, ArrayRecord

import fedlap_jax as fl
from fedlap_flower import replies
from fedlap_jax.method import NON_FINITE, Wire


PACKED = "params"
"""The key of the one Array a packed parameter pytree travels as."""


def _flat(params) -> dict:
  """``{"a/b/c": leaf}`` of a Flax parameter pytree, in sorted path order (the packing order)."""
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  return {k: flat[k] for k in sorted(flat)}


def params_to_record(params) -> ArrayRecord:
  """A Flax parameter pytree (nested dicts of float32 leaves) as ONE float32 Array.

  The record holds ``PACKED``: every leaf raveled (C order) and concatenated in
  sorted ``a/b/c`` path order, shape ``(P,)`` with ``P`` the parameter count.
  Flower transfers each Array (and each of its chunks) of a message as separate
  requests on every hop (ServerApp, SuperLink, SuperNode, ClientApp), so one
  Array per model instead of one per leaf cuts a round's requests; the receiver
  holds the model's layout already (:func:`record_to_params`, :func:`record_to_like`).

  Raises:
    ValueError: a leaf that is not float32 (packing would change its values).
  """
  flat = _flat(params)
  other = {
    k: str(np.asarray(v).dtype) for k, v in flat.items() if np.asarray(v).dtype != np.float32
  }
  if other:
    raise ValueError(
      f"parameters {other} are not float32; allowed: float32 leaves only "
      "(they travel packed into one float32 array)"
    )
  packed = (
    np.concatenate([np.ravel(np.asarray(v)) for v in flat.values()])
    if flat
    else np.zeros((0,), np.float32)
  )
  return ArrayRecord({PACKED: Array(packed)})


def _unpack(packed: np.ndarray, template) -> dict:
  """``{"a/b/c": leaf}`` of ``packed`` (shape ``(P,)``) in ``template``'s layout."""
  flat, start = {}, 0
  for k, ref in _flat(template).items():
    shape = np.shape(ref)
    size = int(np.prod(shape, dtype=np.int64))
    flat[k] = packed[start : start + size].reshape(shape)
    start += size
  return flat


def _num_params(template) -> int:
  return int(sum(int(np.size(v)) for v in _flat(template).values()))


def record_to_params(record: ArrayRecord, template):
  """Inverse of :func:`params_to_record`: a pytree like ``template`` (jnp arrays on the
  default device, float32), for a record from a trusted sender (the server's own).

  Args:
    record: :func:`params_to_record` of the parameters.
    template: any pytree with the model's paths and shapes (e.g. the initial parameters).

  Raises:
    ValueError: the record is not one float32 Array of the template's parameter count.
  """
  want = (_num_params(template),)
  if set(record.keys()) != {PACKED} or tuple(record[PACKED].shape) != want:
    held = {k: tuple(a.shape) for k, a in record.items()}
    raise ValueError(
      f"the parameter record holds {held}; allowed: exactly {PACKED!r} of shape {want}"
    )
  packed = record[PACKED].numpy()
  if packed.dtype != np.float32:
    raise ValueError(f"the parameter record holds dtype {packed.dtype}; allowed: float32")
  flat = _unpack(packed, template)
  return traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in flat.items()}, sep="/")


def _numpy(record: ArrayRecord, key: str, name: str, dtype, finite: bool = True) -> np.ndarray:
  """``record[key]`` as NumPy, refused unless the Array declares and holds ``dtype``
  (and, with ``finite``, floating values are finite)."""
  array = record[key]
  try:
    declared = np.dtype(array.dtype)
  except TypeError:
    declared = None
  if declared != np.dtype(dtype):
    raise replies.InvalidReply(
      name, f"{name} has dtype {replies.short(array.dtype)}; allowed: {np.dtype(dtype).name}"
    )
  value = array.numpy()
  if not isinstance(value, np.ndarray) or value.dtype != np.dtype(dtype):
    raise replies.InvalidReply(
      name, f"{name} holds dtype {getattr(value, 'dtype', '?')}; allowed: {np.dtype(dtype).name}"
    )
  return replies.check_array(name, value, dtype) if finite else value


def record_to_like(
  record: ArrayRecord,
  params,
  what: str = "model delta",
  max_norm: float | None = None,
  wire: Wire | None = None,
):
  """A received pytree like ``params`` (a model delta, or a FedAvg client's parameters), checked.

  The packing is checked here (one float32 Array of the model's parameter count, refused from
  its declared shape and dtype before the values are read); the unpacked arrays are then
  checked by ``wire`` (:meth:`fedlap_jax.method.Wire.check`: names, shapes, dtypes, finite
  values), the one check of what a reply's arrays may be.

  Args:
    record: :func:`params_to_record` of the pytree (one float32 Array ``PACKED``).
    params: the round's global parameters (the layout to unpack with).
    what: the name in messages (``"model delta"``; fields ``delta/...``, else ``arrays/...``).
    max_norm: refuse a global L2 norm above it
      (:func:`fedlap_jax.update_bounds.matching_delta_bound`); ``None``: no bound.
    wire: the arrays expected (a method's :class:`~fedlap_jax.method.Wire` of its model
      update); ``None``: ``params``' own (:meth:`Wire.of`).

  Returns:
    A NumPy pytree like ``params`` (float32).

  Raises:
    fedlap_flower.replies.InvalidReply (a ``ValueError``): other arrays than
      ``PACKED``, another length than the model's parameter count or another dtype, what
      ``wire`` refuses (NaN / Inf, naming the parameter path ``delta/a/b``), or a norm above
      ``max_norm``.
  """
  field = "delta" if what == "model delta" else "arrays"
  name = f"{field}/{PACKED}"
  if set(record.keys()) != {PACKED}:
    raise replies.InvalidReply(
      field,
      f"{what} ({field}) holds arrays "
      f"{replies.short(sorted(record.keys()))}; allowed: exactly "
      f"{PACKED!r}, the parameters packed into one array",
    )
  want = (_num_params(params),)
  shape = tuple(record[PACKED].shape)
  if shape != want:
    raise replies.InvalidReply(
      name,
      f"{what} ({name}) has shape {replies.short(shape)}; "
      f"allowed: {want}, the global model's parameter count",
    )
  d = _numpy(record, PACKED, name, np.float32, finite=False)
  if d.shape != want:
    raise replies.InvalidReply(name, f"{what} ({name}) holds shape {d.shape}; allowed: {want}")
  flat = _unpack(d, params)
  tree = traverse_util.unflatten_dict(flat, sep="/")
  _check_unpacked(tree, Wire.of(tree) if wire is None else wire, what, field)
  if max_norm is not None:
    replies.check_delta_norm(flat, max_norm)
  return tree


def _check_unpacked(tree, wire: Wire, what: str, field: str) -> None:
  """``wire``'s check of an unpacked parameter pytree, its refusal named by the parameter's
  ``a/b/c`` path under ``field``."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = Wire.of(tree).names()
  path = {n: "/".join(str(getattr(k, "key", k)) for k in p) for n, (p, _) in zip(names, leaves)}
  try:
    wire.check({n: leaf for n, (_, leaf) in zip(names, leaves)})
  except fl.ConfigError as e:
    at = path.get(e.field, e.field)
    if e.value == NON_FINITE:
      raise replies.InvalidReply(
        f"{field}/{at}", f"{what} {at!r} ({field}/{at}) holds NaN or Inf"
      ) from None
    raise replies.InvalidReply(f"{field}/{at}", f"{what} ({field}/{at}): {e}") from None


def raw_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays' values (``prod(shape) * itemsize``), without headers."""
  return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in record.values()))


def wire_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays as Flower serialises them (values plus ``.npy`` headers)."""
  return int(sum(len(a.data) for a in record.values()))


def arrays_record(arrays) -> ArrayRecord:
  """``{name: NumPy array}`` as an :class:`ArrayRecord` of the same names (a method's message
  or a client's ``own`` inputs, :func:`fedlap_flower.method_work.tree_to_arrays`)."""
  return ArrayRecord({str(k): Array(np.array(v, order="C")) for k, v in arrays.items()})


def record_to_wire(record: ArrayRecord, wire, field: str = "update") -> dict:
  """A received update's ``{name: array}`` in a method's :class:`~fedlap_jax.method.Wire`,
  checked: exactly its names, each refused by its declared shape and dtype before its values
  are read, then by its values (finite: :meth:`Wire.check`).

  Raises:
    fedlap_flower.replies.InvalidReply: naming the array (``field``: a record that holds others).
  """
  want = {f.name: f for f in wire.fields}
  if set(record.keys()) != set(want):
    raise replies.InvalidReply(
      field,
      f"the {field} record holds arrays {replies.short(sorted(record.keys()))}; allowed: "
      f"{replies.short(sorted(want))}",
    )
  out = {}
  for name, f in want.items():
    shape = tuple(record[name].shape)
    if shape != f.shape:
      raise replies.InvalidReply(
        name, f"{name} has shape {replies.short(shape)}; allowed: {f.shape}"
      )
    out[name] = _numpy(record, name, name, np.dtype(f.dtype), finite=False)
  try:
    wire.check(out)
  except fl.ConfigError as e:
    raise replies.InvalidReply(str(e.field), str(e)) from None
  return out


def record_to_arrays(record: ArrayRecord) -> dict:
  """Inverse of :func:`arrays_record` (the values unchecked: the receiver checks them against
  its own structure, :func:`fedlap_flower.method_work.arrays_to_tree`)."""
  return {k: record[k].numpy() for k in record.keys()}
