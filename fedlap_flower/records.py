"""The app's messages as Flower records.

Train message (server -> client), ``RecordDict``:

* ``"arrays"``: the global parameters (:func:`params_to_record`, keys are the
  Flax parameter paths joined by ``/``);
* ``"config"``: ``server-round``, ``learning-rate`` (the float32 ``eta_m``),
  ``num-clients``; without DP (or in the test-only unsafe mode) the round keys
  ``key-init`` and ``key-clients`` (uint32 words; client ``k`` uses
  ``split(key, K)[k]``) and ``keys = "server"``; under DP ``keys = "client"``.

Train reply (client -> server):

* FedLAP: ``"synthetic"`` (``x`` ``(S, H, W, C)`` float32, ``y`` ``(S,)``
  int32, ``mask`` ``(S,)`` bool); with ``server.start='fedavg_delta'`` (the
  hybrid recipe, ``client.model_steps='noisy_real'``) also ``"delta"``: the
  client's model delta ``w_end - w_g``, one float32 array per parameter leaf,
  keyed like ``"arrays"`` (:func:`params_to_record`; checked by
  :func:`record_to_delta`); with ``server.start='global'`` no ``"delta"``.
  ``"metrics"`` (``partition-id``, ``radius``, ``dp-steps``, and under DP
  ``epsilon`` / ``max-epsilon``; without DP also ``num-examples`` and
  diagnostics); ``"status"`` (``status`` = ``ok`` | ``refused``, ``reason``,
  ``keys``). A refused round carries no arrays.
* FedAvg: ``"arrays"`` (the client's parameters) and ``"metrics"``
  (``num-examples``, ``partition-id``), as Flower's FedAvg expects.

Query message (server -> client): ``"config"`` (``server-round``, ``ask =
"partition-id"``); the reply holds ``"metrics"`` with the client's
``partition-id`` only (:mod:`fedlap_flower.binding`).

The server reads a reply's arrays through :func:`record_to_synthetic`,
:func:`record_to_delta` and :func:`record_to_like`, which refuse anything but
the dtypes and shapes above before using a value
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


def params_to_record(params) -> ArrayRecord:
  """A Flax parameter pytree (nested dicts) as an ``ArrayRecord`` keyed by ``a/b/c`` paths."""
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  return ArrayRecord({k: Array(np.asarray(v)) for k, v in flat.items()})


def record_to_params(record: ArrayRecord):
  """Inverse of :func:`params_to_record` (arrays on the default device, dtypes kept)."""
  return traverse_util.unflatten_dict({k: jnp.asarray(v.numpy()) for k, v in record.items()},
                                      sep="/")


def _numpy(record: ArrayRecord, key: str, name: str, dtype, finite: bool = True) -> np.ndarray:
  """``record[key]`` as NumPy, refused unless the Array declares and holds ``dtype``
  (and, with ``finite``, floating values are finite)."""
  array = record[key]
  try:
    declared = np.dtype(array.dtype)
  except TypeError:
    declared = None
  if declared != np.dtype(dtype):
    raise replies.InvalidReply(name, f"{name} has dtype {replies.short(array.dtype)}; allowed: "
                               f"{np.dtype(dtype).name}")
  value = array.numpy()
  if not isinstance(value, np.ndarray) or value.dtype != np.dtype(dtype):
    raise replies.InvalidReply(name, f"{name} holds dtype {getattr(value, 'dtype', '?')}; "
                               f"allowed: {np.dtype(dtype).name}")
  return replies.check_array(name, value, dtype) if finite else value


def record_to_like(record: ArrayRecord, params, what: str = "model delta",
                   max_norm: float | None = None):
  """A received pytree like ``params`` (a model delta, or a FedAvg client's parameters), checked.

  Args:
    record: :func:`params_to_record` of the pytree.
    params: the round's global parameters (paths, shapes and dtypes to match).
    what: the name in messages (``"model delta"``; field ``delta/<path>``).
    max_norm: refuse a global L2 norm above it
      (:func:`fedlap_flower.replies.max_delta_norm`); ``None``: no bound.

  Returns:
    A NumPy pytree like ``params``.

  Raises:
    fedlap_flower.replies.InvalidReply (a ``ValueError``): other parameter
      paths, a leaf of another shape or dtype, NaN / Inf, or a norm above
      ``max_norm``.
  """
  field = "delta" if what == "model delta" else "arrays"
  want = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  if set(record.keys()) != set(want):
    missing, extra = sorted(set(want) - set(record.keys())), sorted(set(record.keys()) - set(want))
    raise replies.InvalidReply(field, f"{what} has other parameters (missing {missing}, unknown "
                               f"{replies.short(extra)}); allowed: exactly the global model's "
                               "parameter paths")
  flat = {}
  for k, ref in want.items():
    ref = np.asarray(ref)
    shape = tuple(record[k].shape)
    if shape != ref.shape:
      raise replies.InvalidReply(f"{field}/{k}", f"{what} {k!r} has shape {shape}; allowed: "
                                 f"{ref.shape}")
    d = _numpy(record, k, f"{field}/{k}", ref.dtype, finite=False)
    if d.shape != ref.shape:
      raise replies.InvalidReply(f"{field}/{k}", f"{what} {k!r} holds shape {d.shape}; allowed: "
                                 f"{ref.shape}")
    if not np.isfinite(d).all():
      raise replies.InvalidReply(f"{field}/{k}", f"{what} {k!r} holds NaN or Inf")
    flat[k] = d
  if max_norm is not None:
    replies.check_delta_norm(flat, max_norm)
  return traverse_util.unflatten_dict(flat, sep="/")


def record_to_delta(record: ArrayRecord, params, max_norm: float | None = None):
  """A received model delta as a pytree like ``params`` (NumPy, the parameters' dtypes), checked.

  Args:
    record: the reply's ``"delta"`` (:func:`params_to_record` of the delta).
    params: the round's global parameters (what the delta must match).
    max_norm: the largest global L2 norm accepted
      (:func:`fedlap_flower.replies.max_delta_norm`); ``None``: not bounded.

  Raises:
    ValueError: other parameter paths, a leaf of another shape or dtype,
      NaN / Inf, or a norm above ``max_norm``.
  """
  return record_to_like(record, params, "model delta", max_norm)


def synthetic_to_record(synthetic) -> ArrayRecord:
  return ArrayRecord({"x": Array(np.asarray(synthetic.x, np.float32)),
                      "y": Array(np.asarray(synthetic.y, np.int32)),
                      "mask": Array(np.asarray(synthetic.mask, bool))})


def record_to_synthetic(record: ArrayRecord,
                        limits: replies.SyntheticLimits | None = None) -> fl.SyntheticSet:
  """A received synthetic set (NumPy), checked.

  With ``limits`` (what the server does): exactly the arrays ``x`` float32
  ``(S, *image_shape)``, ``y`` int32 ``(S,)``, ``mask`` bool ``(S,)``, at most
  ``ipc * num_classes`` slots (refused from the declared shape, before the
  values are read), finite images within ``max_image_abs``, labels in the
  layout of :func:`fedlap_jax.synthetic.synthetic_labels`
  (:func:`fedlap_flower.replies.check_synthetic`). Without: consistent
  shapes and finite images only.

  Raises:
    ValueError (:class:`fedlap_flower.replies.InvalidReply` naming the
      array): what the checks above refuse.
  """
  missing = [k for k in ("x", "y", "mask") if k not in record]
  if missing:
    raise replies.InvalidReply("synthetic", f"synthetic set lacks arrays {missing}")
  if limits is not None:
    extra = sorted(set(record.keys()) - {"x", "y", "mask"})
    if extra:
      raise replies.InvalidReply("synthetic", f"synthetic set holds other arrays "
                                 f"{replies.short(extra)}; allowed: x, y, mask")
    replies.check_slot_count(record["x"].shape, limits)
    x = _numpy(record, "x", "x", np.float32)
    y = _numpy(record, "y", "y", np.int32)
    mask = _numpy(record, "mask", "mask", np.bool_)
    return fl.SyntheticSet(*replies.check_synthetic(x, y, mask, limits))
  x, y, mask = (record[k].numpy() for k in ("x", "y", "mask"))
  if x.ndim != 4 or y.shape != (len(x),) or mask.shape != (len(x),):
    raise ValueError(f"synthetic set has shapes x {x.shape}, y {y.shape}, mask {mask.shape}; "
                     "allowed: (S, H, W, C), (S,), (S,)")
  if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
    raise ValueError("synthetic images hold NaN or Inf, or are not numbers")
  return fl.SyntheticSet(x.astype(np.float32), y.astype(np.int32), mask.astype(bool))


def raw_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays' values (``prod(shape) * itemsize``), without headers."""
  return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in record.values()))


def wire_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays as Flower serialises them (values plus ``.npy`` headers)."""
  return int(sum(len(a.data) for a in record.values()))
