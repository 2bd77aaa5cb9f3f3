"""Client data as the library holds it: real records, synthetic sets, pixel normalisation.

The data types every federated algorithm shares, below all of them:

* :class:`ClientData`: one client's real records padded to a fixed size with
  a validity mask, optionally as stored pixels (e.g. ``uint8``) normalised on
  every read; :func:`stack_clients` pads and stacks K clients on a leading
  ``(K,)`` axis.
* :class:`SyntheticSet`: a client's synthetic set ``S_k`` (FedLAP).
* :func:`pixel_normalisation` / :func:`normalise_pixels`: the per-channel
  affine map from stored pixels to model inputs.
* :func:`check_records`, :func:`check_pair`, :func:`check_batch_size`,
  :func:`check_label_dtype`: the static shape and dtype checks every method's
  client update (and the server's :func:`~fedlap_jax.methods.fedlap.server.check_union`) runs when
  it is traced.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.checks import ConfigError, is_int, require


class ClientData(NamedTuple):
  """One client's real data, padded to a fixed size.

  Images can stay on the device as stored pixels (e.g. ``uint8``, a quarter of
  float32's memory) with the normalisation fused into every read: model inputs
  are ``x * pixel_scale + pixel_offset`` per channel, computed on the gathered
  batch only (:meth:`images`). Without ``pixel_scale`` / ``pixel_offset``,
  ``x`` holds the model inputs themselves.

  Attributes:
    x: ``(N, H, W, C)`` images: float model inputs, or stored pixels of any
      dtype read through ``pixel_scale`` and ``pixel_offset``.
    y: ``(N,)`` int32 labels.
    mask: ``(N,)`` bool, True for real records, False for padding.
    pixel_scale, pixel_offset: ``(C,)`` float32 or both None. For uint8 pixels
      and a per-channel ``mean`` / ``std`` of pixels in [0, 1]:
      ``scale = 1 / (255 std)``, ``offset = -mean / std``
      (:func:`pixel_normalisation`).
    max_classes: the most classes a client of this client's federation owns, or None; a
      static fact (no leaf, part of the pytree's structure), set by :func:`pad_client` so
      that :func:`~fedlap_jax.synthetic.client_synthetic` gives every client of the
      federation a synthetic set of one size.
  """

  x: jax.Array
  y: jax.Array
  mask: jax.Array
  pixel_scale: jax.Array | None = None
  pixel_offset: jax.Array | None = None
  max_classes: int | None = None

  def normalise(self, x: jax.Array) -> jax.Array:
    """Stored pixels ``(..., C)`` of this client -> float32 model inputs."""
    if self.pixel_scale is None:
      return x
    return normalise_pixels(x, self.pixel_scale, self.pixel_offset)

  def images(self, indices: jax.Array) -> jax.Array:
    """Model inputs of the records ``indices`` ``(B,)``: ``(B, H, W, C)`` float32.

    The gather, the conversion and the normalisation fuse into one XLA op, so
    only the batch is ever materialised as float32.
    """
    return self.normalise(self.x[indices])


_LEAVES = ("x", "y", "mask", "pixel_scale", "pixel_offset")
# ``max_classes`` is static: jit sees a Python int (not a tracer), and clients of one
# federation share one pytree structure (so they stack), clients of two do not.
jax.tree_util.register_pytree_with_keys(
  ClientData,
  lambda d: (tuple((jax.tree_util.GetAttrKey(f), getattr(d, f)) for f in _LEAVES), d.max_classes),
  lambda max_classes, leaves: ClientData._make((*leaves, max_classes)),
  flatten_func=lambda d: (tuple(getattr(d, f) for f in _LEAVES), d.max_classes),
)


def on_device(*trees: Any) -> Any:
  """``trees`` with every NumPy leaf copied to the device (:func:`jax.device_put`).

  What the library's entry points (``local_approx``, ``client_step``, ``global_update``,
  ``server_step``) run on their array arguments, so that NumPy client data, synthetic sets
  and parameters work outside ``jit`` as inside it: their ``lax`` loops index the records
  with traced indices, which a NumPy array refuses. Jax arrays and tracers are returned as
  they are (bit for bit); the copy compiles nothing (``jnp.asarray`` would build a program
  per shape). Dtypes are canonicalised as ``jnp.asarray`` does (float64 -> float32 without
  x64).

  Returns:
    The converted tree for one argument, a tuple of them for several.
  """

  def put(a):
    return jax.device_put(a) if isinstance(a, (np.ndarray, np.generic)) else a

  out = tuple(jax.tree.map(put, tree) for tree in trees)
  return out[0] if len(trees) == 1 else out


def normalise_pixels(x, pixel_scale, pixel_offset):
  """Stored pixels ``(..., C)`` -> float32 model inputs ``x * pixel_scale + pixel_offset``.

  Works on NumPy (host) and JAX (device, fused into the read) arrays alike.
  """
  return x.astype(np.float32) * pixel_scale + pixel_offset


def pixel_normalisation(mean, std, pixel_max: float = 255.0) -> tuple[np.ndarray, np.ndarray]:
  """``(pixel_scale, pixel_offset)`` for ``(pixel / pixel_max - mean) / std``.

  Args:
    mean, std: ``(C,)`` per-channel statistics of pixels scaled to [0, 1].
    pixel_max: the stored value of a white pixel (255 for uint8, 1 for floats
      already in [0, 1]).

  Returns:
    Two ``(C,)`` float32 NumPy arrays, computed in float64 and rounded once.
  """
  mean = np.asarray(mean, np.float64)
  std = np.asarray(std, np.float64)
  if mean.shape != std.shape or mean.ndim != 1:
    raise ConfigError(
      "std",
      std.shape,
      "a (C,) vector like mean",
      message=f"mean and std must both be (C,) vectors; got shapes {mean.shape} and {std.shape}",
    )
  if np.any(std <= 0) or not np.all(np.isfinite(std)):
    raise ConfigError("std", std.tolist(), "finite values > 0")
  if not (np.isfinite(pixel_max) and pixel_max > 0):
    raise ConfigError("pixel_max", pixel_max, "a finite value > 0")
  scale = 1.0 / (pixel_max * std)
  offset = -mean / std
  return scale.astype(np.float32), offset.astype(np.float32)


class SyntheticSet(NamedTuple):
  """A client's synthetic set ``S_k``.

  Attributes:
    x: ``(S, H, W, C)`` float32 images (in normalised pixel space).
    y: ``(S,)`` int32 labels, fixed for the run.
    mask: ``(S,)`` bool, False for padding slots (clients owning fewer classes).
  """

  x: jax.Array
  y: jax.Array
  mask: jax.Array


def check_label_dtype(field: str, y: jax.Array) -> None:
  """Refuses labels ``y`` whose dtype is not an integer one (class indices).

  Raises:
    ConfigError: ``f"{field}.dtype"`` with the dtype's name.
  """
  if not jnp.issubdtype(jnp.result_type(y), jnp.integer):
    raise ConfigError(f"{field}.dtype", str(jnp.result_type(y)), "an integer dtype (class labels)")


def num_classes_of(
  apply_fn: Callable, params: Any, image_shape: Sequence[int], dtype=jnp.float32
) -> int:
  """``K``, the model's number of output logits, from its output shape (no FLOPs).

  ``jax.eval_shape`` of ``apply_fn(params, x)`` on one input of ``image_shape``
  ``(H, W, C)`` and float ``dtype``; works on traced ``params`` too (under
  ``jit`` it costs one abstract trace of the model).

  Raises:
    ConfigError: ``apply_fn`` does not return ``(1, K)`` logits.
  """
  out = jax.eval_shape(apply_fn, params, jax.ShapeDtypeStruct((1, *image_shape), dtype))
  shape = getattr(out, "shape", None)
  if shape is None or len(shape) != 2 or shape[0] != 1 or shape[1] < 1:
    raise ConfigError(
      "apply_fn",
      getattr(out, "shape", type(out).__name__),
      "a model whose apply_fn(params, x) returns logits (N, K) for x (N, H, W, C)",
    )
  return int(shape[1])


def _is_traced(*arrays) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_labels(num_classes: int, *labelled: tuple[str, Any, Any]) -> Any:
  """Labels of every valid record in ``[0, num_classes)``: refused where the values are known,
  a flag where they are traced.

  ``labelled`` are ``(field, y, mask)`` triples (``y`` and ``mask`` of any
  matching shape; records whose ``mask`` is False are not checked). Outside
  ``jit`` and ``vmap`` the values are concrete and an out-of-range label is
  refused here. Inside a traced program nothing can be raised on a value, so
  the returned flag (a traced bool scalar, False when some label is out of
  range) is what the caller folds into its outputs with :func:`poison_unless`;
  ``True`` when every set was concrete (and checked).

  Raises:
    ConfigError: naming the field (e.g. ``"client_data.y"``), the labels out
      of range and the allowed range, for concrete labels.
  """
  ok: Any = True
  for field, y, mask in labelled:
    if not _is_traced(y, mask):
      y_np, m_np = np.asarray(y), np.asarray(mask, bool)
      bad = np.unique(y_np[m_np & ((y_np < 0) | (y_np >= num_classes))])
      if bad.size:
        raise ConfigError(
          field,
          bad[:5].tolist(),
          f"class indices in [0, {num_classes}) for every valid record (the model has "
          f"{num_classes} output logits)",
          message=f"{field} holds labels {bad[:5].tolist()}{'...' if bad.size > 5 else ''} "
          f"outside [0, {num_classes}); allowed: class indices in [0, {num_classes}) for every "
          f"valid record (the model has {num_classes} output logits)",
        )
    else:
      inside = (y >= 0) & (y < num_classes)
      ok = ok & jnp.all(inside | ~mask.astype(bool))
  return ok


def check_finite(*images: tuple[str, Any]) -> Any:
  """Float images finite in every record: refused where the values are known, a flag where they
  are traced, as :func:`check_labels` does for labels.

  ``images`` are ``(field, x)`` pairs; every record is checked, padding included (a NaN pad
  would still reach a masked sum as ``0 * NaN``). Integer images (stored pixels) are finite by
  their dtype and not read. Under DP a NaN record would not show: its per-example gradient is
  dropped by the clipping, and the step runs on as if it had no such record; the flag (a traced
  bool scalar, False when some value is NaN or infinite) is folded into the outputs with
  :func:`poison_unless` instead. ``True`` when every array was concrete (and checked).

  Raises:
    ConfigError: naming the field (e.g. ``"client_data.x"``), the count of NaN and infinite
      values and the first record holding one, for concrete images.
  """
  ok: Any = True
  for field, x in images:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      continue
    if not _is_traced(x):
      x_np = np.asarray(x)
      bad = ~np.isfinite(x_np)
      if bad.any():
        nan, inf = int(np.isnan(x_np).sum()), int(np.isinf(x_np).sum())
        first = int(np.argmax(bad.reshape(len(x_np), -1).any(axis=1)))
        raise ConfigError(
          field,
          f"{nan} NaN and {inf} infinite values",
          "finite values in every record",
          message=f"{field} holds {nan} NaN and {inf} infinite values (the first in record "
          f"{first}); allowed: finite values in every record",
        )
    else:
      ok = ok & jnp.all(jnp.isfinite(x))
  return ok


def poison_unless(ok: jax.Array, tree: Any) -> Any:
  """``tree`` with every floating leaf NaN unless ``ok`` (a bool scalar, may be traced).

  How a traced program makes bad input impossible to miss: an out-of-range
  label (:func:`check_labels`) or a non-finite image (:func:`check_finite`) turns
  every float output (images, parameters, radii, losses) into NaN, which no later step can turn finite again (not a
  loss alone: DP's clipped sums drop non-finite per-example gradients). With
  ``ok`` True the leaves are returned bit for bit.
  """

  if ok is True:  # checked on concrete values: nothing to fold in
    return tree

  def poison(a):
    if a is None or not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
      return a
    return jnp.where(ok, a, jnp.asarray(jnp.nan, jnp.result_type(a)))

  return jax.tree.map(poison, tree)


def check_records(name: str, data: ClientData | SyntheticSet) -> tuple[int, ...]:
  """Refuses records whose static shapes or dtypes a method cannot use; returns ``x``'s shape.

  ``data.x`` ``(N, ...)`` with ``y`` and ``mask`` ``(N,)``, integer labels, and float model
  inputs, or stored pixels with ``pixel_scale`` / ``pixel_offset`` (a :class:`ClientData`'s
  only). Reads shapes and dtypes only, so it runs at trace time, under ``jit`` and ``vmap``
  (there on one client's shapes).

  Raises:
    ConfigError: naming the leaf (``f"{name}.y.dtype"``, ...), the value and what is allowed.
  """
  shape = jnp.shape(data.x)
  if len(shape) < 2:
    raise ConfigError(f"{name}.x.shape", shape, "(N, ...): one leading axis of records")
  for leaf in ("y", "mask"):
    if jnp.shape(getattr(data, leaf)) != shape[:1]:
      raise ConfigError(
        f"{name}.{leaf}.shape",
        jnp.shape(getattr(data, leaf)),
        f"{shape[:1]}: one entry per record of {name}.x {shape}",
      )
  check_label_dtype(f"{name}.y", data.y)
  if getattr(data, "pixel_scale", None) is None and not jnp.issubdtype(
    jnp.result_type(data.x), jnp.floating
  ):
    raise ConfigError(
      f"{name}.x.dtype",
      str(jnp.result_type(data.x)),
      "a floating dtype"
      if isinstance(data, SyntheticSet)
      else "float model inputs, or stored pixels with pixel_scale and pixel_offset "
      "(stack_clients(..., pixel_scale=, pixel_offset=), pixel_normalisation)",
    )
  return shape


def check_pair(synthetic: SyntheticSet, client_data: ClientData) -> None:
  """Both sets' records (:func:`check_records`), and synthetic images of the client's shape.

  Raises:
    ConfigError: as :func:`check_records`, or ``synthetic.x.shape`` for another image shape.
  """
  check_records("synthetic", synthetic)
  image = check_records("client_data", client_data)[1:]
  if jnp.shape(synthetic.x)[1:] != image:
    raise ConfigError(
      "synthetic.x.shape",
      jnp.shape(synthetic.x),
      f"(S, {', '.join(map(str, image))}): the image shape of client_data.x",
    )


def check_batch_size(field: str, batch_size: int, data: ClientData) -> None:
  """Refuses a batch whose sampling rate ``q = batch_size / N_k`` exceeds 1 for any mask.

  Checks against the client's record slots ``data.x.shape[0]`` (static); the number of
  valid records ``N_k = sum(mask)`` may be traced, and a caller that pads a client to more
  slots than it has records keeps ``batch_size <= N_k`` itself, as the accountant (which
  refuses ``q > 1``) requires.

  Raises:
    ConfigError: ``field`` with ``batch_size``, and the slots allowed.
  """
  slots = jnp.shape(data.x)[0]
  if batch_size > slots:
    raise ConfigError(
      field,
      batch_size,
      f"at most {slots}, the client's record slots (x.shape[0]): the real batch samples "
      "each record with probability q = batch_size / N_k <= 1",
    )


def stack_clients(
  xs: Sequence[np.ndarray],
  ys: Sequence[np.ndarray],
  *,
  pixel_scale=None,
  pixel_offset=None,
  on_host: bool = False,
  num_classes: int | None = None,
  capacity: int | None = None,
) -> ClientData:
  """Pads per-client arrays to the largest client (or ``capacity``) and stacks them.

  Images keep their dtype: pass uint8 pixels with ``pixel_scale`` and
  ``pixel_offset`` (e.g. from :func:`fedlap_jax.client_data.pixel_normalisation`)
  to keep the data on the device at a quarter of float32's size, normalised
  as each batch is read (:meth:`ClientData.images`).

  Args:
    xs: K arrays ``(N_k, H, W, C)``; ys: K label arrays ``(N_k,)``.
    pixel_scale, pixel_offset: ``(C,)`` per-channel normalisation shared by
      all clients, or both None if ``xs`` already hold float model inputs.
    on_host: leaves are host NumPy arrays instead of device arrays (client
      sampling moves only each round's block to the device,
      :func:`fedlap_jax.participation.device_block`).
    num_classes: ``K``, the model's classes: every label must lie in
      ``[0, K)`` (e.g. ``num_classes_of(apply_fn, params, image_shape)``).
      ``None`` checks labels ``>= 0`` only; the library's steps then refuse
      or poison an out-of-range label themselves (:func:`check_labels`).
    capacity: record slots per client, at least the largest client's ``N_k``;
      ``None``: the largest client's. Data of a fixed capacity keeps one
      shape across calls, so a jitted step compiles once for all of them.

  Returns:
    :class:`ClientData` with leaves ``(K, N_max, ...)``, a validity mask and,
    if given, ``(K, C)`` pixel scale and offset.

  Raises:
    ConfigError: (a ``ValueError``) naming the field (``xs[k]``, ``ys[k]``, ...): mismatched
      counts, empty clients, mixed dtypes or shapes, labels that are not class indices
      (fractional or negative values, not ``(N,)``, ``>= num_classes``), float images holding
      NaN or infinite values (:func:`check_finite`), integer images without a normalisation,
      a normalisation whose length is not the channel count, or a ``capacity`` below the
      largest client.
  """
  if num_classes is not None:
    require(is_int(num_classes) and num_classes >= 1, "num_classes", num_classes, "an integer >= 1")
  if len(xs) != len(ys) or not xs:
    raise ConfigError(
      "ys",
      len(ys),
      f"{len(xs)} >= 1, one label array per image array",
      message=f"stack_clients needs the same number (>= 1) of image and label arrays,"
      f" got {len(xs)} and {len(ys)}",
    )
  for k, (x, y) in enumerate(zip(xs, ys)):
    if len(x) == 0:
      raise ConfigError(
        f"xs[{k}]",
        0,
        ">= 1 record",
        message=f"client {k} has no data; allowed: every client holds >= 1 record",
      )
    if len(x) != len(y):
      raise ConfigError(
        f"ys[{k}]",
        len(y),
        f"{len(x)} labels, one per image",
        message=f"client {k}: {len(x)} images but {len(y)} labels",
      )
    labels = np.asarray(y)
    whole = np.issubdtype(labels.dtype, np.integer) or (
      np.issubdtype(labels.dtype, np.floating) and bool(np.all(labels == np.round(labels)))
    )
    if labels.ndim != 1 or not whole or labels.min() < 0:
      values = np.unique(labels)
      shown = f"{values[:5].tolist()}{'...' if len(values) > 5 else ''}"
      allowed = "(N,) class indices >= 0 (integers, or floats with whole values)"
      raise ConfigError(
        f"ys[{k}]",
        shown,
        allowed,
        message=f"client {k}: labels of dtype {labels.dtype}, shape {labels.shape}, values "
        f"{shown}; allowed: {allowed}",
      )
    if num_classes is not None:
      check_labels(num_classes, (f"ys[{k}]", labels, np.ones(labels.shape, bool)))
    check_finite((f"xs[{k}]", x))
  xs = [np.asarray(x) for x in xs]
  if len({(x.dtype, x.shape[1:]) for x in xs}) > 1:
    kinds = sorted({(str(x.dtype), x.shape[1:]) for x in xs})
    raise ConfigError(
      "xs",
      kinds,
      "one dtype and shape",
      message=f"clients' images differ in dtype or shape: {kinds}; allowed: one",
    )
  if (pixel_scale is None) != (pixel_offset is None):
    raise ConfigError(
      "pixel_offset",
      pixel_offset,
      "given with pixel_scale (or neither)",
      message="pixel_scale and pixel_offset must be given together (or neither)",
    )
  if pixel_scale is None and not np.issubdtype(xs[0].dtype, np.floating):
    raise ConfigError(
      "pixel_scale",
      None,
      "float model inputs without it",
      message=f"images of dtype {xs[0].dtype} need pixel_scale and pixel_offset "
      "(fedlap_jax.client_data.pixel_normalisation); allowed without them: float "
      "model inputs",
    )
  norm = {}
  if pixel_scale is not None:
    channels = xs[0].shape[-1]
    for name, v in (("pixel_scale", pixel_scale), ("pixel_offset", pixel_offset)):
      v = np.asarray(v, np.float32)
      if v.shape != (channels,):
        raise ConfigError(
          name,
          v.shape,
          f"({channels},), one value per image channel",
          message=f"{name} has shape {v.shape}; allowed: ({channels},), one value per image "
          "channel",
        )
      norm[name] = np.broadcast_to(v, (len(xs), channels))
  n_max = max(len(x) for x in xs)
  if capacity is not None:
    require(
      is_int(capacity) and capacity >= n_max,
      "capacity",
      capacity,
      f"an integer >= {n_max}, the largest client's records",
    )
    n_max = int(capacity)

  def pad(a):
    return np.concatenate([a, np.zeros((n_max - len(a), *a.shape[1:]), a.dtype)])

  x = np.stack([pad(x) for x in xs])
  y = np.stack([pad(np.asarray(y, np.int32)) for y in ys])
  mask = np.stack([np.arange(n_max) < len(x) for x in xs])
  # jax.device_put copies to the device without compiling anything (jnp.asarray would build a
  # program per shape and dtype).
  put: Callable[[np.ndarray], Any] = np.ascontiguousarray if on_host else jax.device_put
  return ClientData(put(x), put(y), put(mask), **{k: put(v) for k, v in norm.items()})


def pad_client(
  x: np.ndarray,
  y: np.ndarray,
  *,
  capacity: int,
  pixel_scale=None,
  pixel_offset=None,
  num_classes: int | None = None,
  max_classes: int | None = None,
) -> ClientData:
  """One client's records padded to ``capacity`` slots (no client axis).

  A loop over clients that calls a jitted step (``client_step``,
  ``local_approx``, a baseline's ``client_step``) once per client compiles it
  once per distinct shape: clients of 300, 320 and 375 records compile three
  programs. Padded to one ``capacity`` (e.g. the largest client's ``N_k``)
  they share one; the mask keeps the padding out of every batch and ``N_k``. Their
  synthetic sets need one size too: given ``max_classes`` (the most classes a client of the
  federation owns), :func:`~fedlap_jax.synthetic.client_synthetic` gives every client
  ``ipc * max_classes`` slots, so the padding call is the only one that needs the
  federation's facts; without it, clients of 2 and 3 classes get ``2 ipc`` and ``3 ipc``.
  The padding runs on the host (NumPy) and compiles nothing.

  Args:
    x: ``(N_k, H, W, C)`` images; y: ``(N_k,)`` labels.
    capacity: record slots, ``>= N_k``.
    pixel_scale, pixel_offset, num_classes: as :func:`stack_clients`.
    max_classes: synthetic capacity in classes, ``>=`` this client's classes (and
      ``<= num_classes`` when given); kept as :attr:`ClientData.max_classes`.

  Returns:
    :class:`ClientData` with leaves ``(capacity, ...)`` (``(C,)`` scale and offset).

  Raises:
    ValueError: as :func:`stack_clients`.
    ConfigError: ``max_classes`` below this client's classes or above ``num_classes``.
  """
  stacked = stack_clients(
    [x],
    [y],
    pixel_scale=pixel_scale,
    pixel_offset=pixel_offset,
    num_classes=num_classes,
    capacity=capacity,
    on_host=True,
  )
  if max_classes is not None:
    owned = len(np.unique(np.asarray(y)))
    top = f" and <= num_classes={num_classes}" if num_classes is not None else ""
    require(
      is_int(max_classes) and owned <= max_classes <= (num_classes or max_classes),
      "max_classes",
      max_classes,
      f"an integer >= {owned}, the classes this client owns{top}",
    )
    max_classes = int(max_classes)
  # Padded and sliced on the host, then copied to the device: no program is compiled.
  one = jax.tree.map(lambda a: jax.device_put(a[0]), stacked)
  return one._replace(max_classes=max_classes)
