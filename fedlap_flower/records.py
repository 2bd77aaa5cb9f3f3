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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flwr.app import Array, ArrayRecord

import fedlap_jax as fl


def params_to_record(params) -> ArrayRecord:
  """A Flax parameter pytree (nested dicts) as an ``ArrayRecord`` keyed by ``a/b/c`` paths."""
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  return ArrayRecord({k: Array(np.asarray(v)) for k, v in flat.items()})


def record_to_params(record: ArrayRecord):
  """Inverse of :func:`params_to_record` (arrays on the default device, dtypes kept)."""
  return traverse_util.unflatten_dict({k: jnp.asarray(v.numpy()) for k, v in record.items()},
                                      sep="/")


def record_to_delta(record: ArrayRecord, params):
  """A received model delta as a pytree like ``params`` (NumPy, the parameters' dtypes), checked.

  Args:
    record: the reply's ``"delta"`` (:func:`params_to_record` of the delta).
    params: the round's global parameters (what the delta must match).

  Raises:
    ValueError: other parameter paths, a leaf of another shape, or NaN / Inf.
  """
  want = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  if set(record.keys()) != set(want):
    missing, extra = sorted(set(want) - set(record.keys())), sorted(set(record.keys()) - set(want))
    raise ValueError(f"model delta has other parameters (missing {missing}, unknown {extra}); "
                     "allowed: exactly the global model's parameter paths")
  flat = {}
  for k, ref in want.items():
    d = record[k].numpy()
    if d.shape != np.shape(ref):
      raise ValueError(f"model delta {k!r} has shape {d.shape}; allowed: {np.shape(ref)}")
    if not np.isfinite(d).all():
      raise ValueError(f"model delta {k!r} holds NaN or Inf")
    flat[k] = d.astype(np.asarray(ref).dtype)
  return traverse_util.unflatten_dict(flat, sep="/")


def synthetic_to_record(synthetic) -> ArrayRecord:
  return ArrayRecord({"x": Array(np.asarray(synthetic.x, np.float32)),
                      "y": Array(np.asarray(synthetic.y, np.int32)),
                      "mask": Array(np.asarray(synthetic.mask, bool))})


def record_to_synthetic(record: ArrayRecord) -> fl.SyntheticSet:
  """A received synthetic set (NumPy), checked for consistent shapes and finite images.

  Raises:
    ValueError: missing arrays, shapes that do not agree, or NaN / Inf images.
  """
  missing = [k for k in ("x", "y", "mask") if k not in record]
  if missing:
    raise ValueError(f"synthetic set lacks arrays {missing}")
  x, y, mask = (record[k].numpy() for k in ("x", "y", "mask"))
  if x.ndim != 4 or y.shape != (len(x),) or mask.shape != (len(x),):
    raise ValueError(f"synthetic set has shapes x {x.shape}, y {y.shape}, mask {mask.shape}; "
                     "allowed: (S, H, W, C), (S,), (S,)")
  if not np.isfinite(x).all():
    raise ValueError("synthetic images hold NaN or Inf")
  return fl.SyntheticSet(x.astype(np.float32), y.astype(np.int32), mask.astype(bool))


def raw_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays' values (``prod(shape) * itemsize``), without headers."""
  return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in record.values()))


def wire_bytes(record: ArrayRecord) -> int:
  """Bytes of the arrays as Flower serialises them (values plus ``.npy`` headers)."""
  return int(sum(len(a.data) for a in record.values()))
