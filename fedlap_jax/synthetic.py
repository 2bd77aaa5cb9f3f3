"""Synthetic sets: their layout, their first images, and class-wise access to them.

Every method that sends a synthetic set (FedLAP, FedDM, DSC, PSG) builds it
here, below all of them:

* :func:`synthetic_labels`: the balanced layout, ``ipc`` slots per class a
  client owns, in blocks of ``ipc`` (padded and masked across clients);
* :func:`initial_synthetic`: labels and ``N(0, 1)`` images before round 1
  (:func:`client_synthetic` for one client alone, :func:`synthetic_slot` for one client's
  row of a federation's);
  :func:`noise_images` and :func:`real_images` draw images for a layout;
* :func:`class_blocks` and :func:`class_batch`: the class-wise view of a set
  and a Poisson batch of one class of real records (DSC's gradient matching,
  FedDM's distribution matching).

Labels are host-side NumPy (they are fixed for a run); images are drawn with
explicit PRNG keys and are jit-compatible.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import dsa, optim, privacy
from fedlap_jax.checks import ConfigError, is_real, positive_float, require
from fedlap_jax.dp_config import DPConfig, check_poisson_capacity
from fedlap_jax.optim import check_other_than_sgd
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.setup_jit import setup_jit


SYNTHETIC_INITS = ("real", "noise")


def check_synthetic_learner(cfg) -> None:
  """The checks every synthetic-set learner shares
  (:class:`~fedlap_jax.methods.fedlap.config.ClientConfig`, ``CondensationConfig``,
  ``FedDMConfig``): ``image_lr`` > 0, ``image_momentum`` in [0, 1), ``image_optimizer`` None
  or a spec other than heavy-ball SGD with ``image_momentum`` 0
  (:func:`fedlap_jax.optim.check_other_than_sgd`), ``poisson_capacity`` for ``batch_size``,
  ``dsa_strategy``, and ``dp`` (where the config has one) a
  :class:`~fedlap_jax.dp_config.DPConfig` or None.
  """
  positive_float("image_lr", cfg.image_lr)
  require(
    is_real(cfg.image_momentum) and 0 <= cfg.image_momentum < 1,
    "image_momentum",
    cfg.image_momentum,
    "a number in [0, 1)",
  )
  check_other_than_sgd(
    cfg.image_optimizer,
    "image_optimizer",
    (("image_momentum", cfg.image_momentum),),
    "image_momentum is its spec",
  )
  check_poisson_capacity(cfg.poisson_capacity, cfg.batch_size)
  dsa.check_strategy("dsa_strategy", cfg.dsa_strategy)
  dp = getattr(cfg, "dp", None)
  require(dp is None or isinstance(dp, DPConfig), "dp", dp, "a DPConfig or None")


def image_optimizer(cfg) -> optax.GradientTransformation:
  """The synthetic images' optimiser of a synthetic-set learner's config
  (:class:`~fedlap_jax.methods.fedlap.config.ClientConfig`, ``FedDMConfig``,
  ``CondensationConfig``), rate included: the paper's SGD of ``image_lr`` and
  ``image_momentum`` (:func:`fedlap_jax.optim.image_sgd`), or the direction of
  ``cfg.image_optimizer`` at ``image_lr`` where one is set."""
  if cfg.image_optimizer is None:
    return optim.image_sgd(cfg.image_lr, cfg.image_momentum)
  return cfg.image_optimizer.with_rate(cfg.image_lr)


def synthetic_labels(
  client_labels: Sequence[np.ndarray], ipc: int
) -> tuple[np.ndarray, np.ndarray]:
  """Balanced synthetic labels: ``ipc`` per class each client owns (host side).

  Args:
    client_labels: K label arrays (only the real records, no padding).
    ipc: images per class.

  Returns:
    ``(labels, mask)`` of shape ``(K, S)`` with ``S = ipc * max_k classes_k``;
    each row holds the client's classes in increasing order, ``ipc`` slots each,
    then padding.
  """
  if ipc < 1:
    raise ConfigError("ipc", ipc, "an integer >= 1")
  classes = [np.unique(np.asarray(y)) for y in client_labels]
  s = ipc * max(len(c) for c in classes)
  labels = np.zeros((len(classes), s), np.int32)
  mask = np.zeros((len(classes), s), bool)
  for k, cls in enumerate(classes):
    row = np.repeat(cls, ipc)
    labels[k, : len(row)] = row
    mask[k, : len(row)] = True
  return labels, mask


def initial_synthetic(
  key: jax.Array, clients: ClientData, ipc: int, synthetic_init: str
) -> tuple[SyntheticSet, jax.Array]:
  """Round-1 synthetic sets: balanced labels and ``N(0, 1)`` images (host side).

  Labels are :func:`synthetic_labels` of each client's real records, images
  :func:`noise_images` (under ``synthetic_init="real"`` the caller draws real
  images later; this checks that it can).

  Args:
    key: PRNG key, split into the images' key and the one returned.
    clients: :class:`ClientData` with ``(K, N, ...)`` leaves.
    ipc: images per class.
    synthetic_init: ``"noise"`` or ``"real"``.

  Returns:
    ``(synthetic, key)``: ``(K, S, ...)`` :class:`SyntheticSet` and the
    remaining key for the state.

  Raises:
    ConfigError: under ``"real"``, a client has fewer than ``ipc`` records of
      one of its classes; ``ipc < 1``.
  """
  ys = [np.asarray(y)[np.asarray(m)] for y, m in zip(clients.y, clients.mask)]
  labels, mask = _checked_labels(ys, ipc, synthetic_init)
  images, k_state = _first_images(key, mask, tuple(clients.x.shape[2:]))
  return SyntheticSet(images, jax.device_put(labels), jax.device_put(mask)), k_state


def _checked_labels(
  ys: Sequence[np.ndarray], ipc: int, synthetic_init: str
) -> tuple[np.ndarray, np.ndarray]:
  """:func:`synthetic_labels` of the clients' real labels ``ys``, after the ``"real"`` check."""
  if synthetic_init == "real":
    for k, y in enumerate(ys):
      cls, counts = np.unique(y, return_counts=True)
      if counts.min() < ipc:
        raise ConfigError(
          "ipc",
          ipc,
          "ipc <= the smallest class count of every client",
          message=f"ipc={ipc} is invalid with synthetic_init='real': client {k} has only "
          f"{counts.min()} records of class {cls[np.argmin(counts)]}; allowed: ipc <= the "
          "smallest class count of every client (or synthetic_init='noise')",
        )
  return synthetic_labels(ys, ipc)


@setup_jit(static_argnames=("image_shape",))
def _first_images(
  key: jax.Array, mask: jax.Array, image_shape: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
  """``split(key)``: :func:`noise_images` of ``mask`` ``(K, S)`` from the first half, and the
  second half (the state's key); one compiled program."""
  k_init, k_state = jax.random.split(key)
  return noise_images(k_init, mask, image_shape), k_state


@setup_jit(static_argnames=("image_shape", "pad"))
def _client_images(
  key: jax.Array, mask: jax.Array, image_shape: tuple[int, ...], pad: int
) -> jax.Array:
  """One client's :func:`_first_images` for ``mask`` ``(S,)``, then ``pad`` zero images:
  ``(S + pad, *image_shape)``; one compiled program."""
  x = _first_images(key, mask[None], image_shape)[0][0]
  if not pad:
    return x
  return jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])


def client_synthetic(
  key: jax.Array,
  data: ClientData,
  ipc: int,
  *,
  synthetic_init: str = "noise",
  max_classes: int | None = None,
) -> SyntheticSet:
  """One client's round-1 synthetic set: :func:`initial_synthetic` of one client.

  Labels and mask are laid out on the host; the images are one compiled program (one per
  image shape and slot count), also when called outside ``jit``.

  For a loop over single clients (the Flower client, a user's own loop):
  ``data`` holds one client's records without a client axis (e.g.
  :func:`~fedlap_jax.client_data.pad_client`).

  Args:
    key: PRNG key of the images.
    data: :class:`ClientData` with ``(N, ...)`` leaves.
    ipc: images per class.
    synthetic_init: ``"noise"`` or ``"real"`` (as :func:`initial_synthetic`).
    max_classes: pad the set to ``ipc * max_classes`` slots (masked), e.g.
      the most classes any client owns, so that every client's set has one
      shape and a jitted step compiles once; ``None``: ``data.max_classes``
      (set by :func:`~fedlap_jax.client_data.pad_client`), else ``ipc`` times this
      client's classes.

  Returns:
    A :class:`SyntheticSet` with ``(S, ...)`` leaves.

  Raises:
    ConfigError: as :func:`initial_synthetic`, or ``max_classes`` below this
      client's classes.
  """
  labels, mask = _checked_labels([np.asarray(data.y)[np.asarray(data.mask)]], ipc, synthetic_init)
  labels, mask = labels[0], mask[0]
  pad = 0
  if max_classes is None:
    max_classes = data.max_classes
  if max_classes is not None:
    classes = int(np.sum(mask)) // ipc
    if not (isinstance(max_classes, int) and max_classes >= classes):
      raise ConfigError(
        "max_classes", max_classes, f"an integer >= {classes}, the classes this client owns"
      )
    pad = ipc * max_classes - labels.shape[0]
  # Labels and mask are laid out on the host; the images (key split, N(0, 1) draw, padding)
  # are one compiled program, the same numbers as the draw for a one-client stack.
  images = _client_images(key, mask, tuple(data.x.shape[1:]), pad)
  labels = np.concatenate([labels, np.zeros(pad, labels.dtype)])
  mask = np.concatenate([mask, np.zeros(pad, bool)])
  return SyntheticSet(images, jax.device_put(labels), jax.device_put(mask))


@setup_jit(static_argnames=("image_shape", "index", "num_clients"))
def _slot_images(
  key: jax.Array, mask: jax.Array, image_shape: tuple[int, ...], index: int, num_clients: int
) -> jax.Array:
  """Row ``index`` of :func:`_first_images` of ``num_clients`` clients, masked by this
  client's ``mask`` ``(S,)`` (the other rows' masks touch no value of this row)."""
  k_init, _ = jax.random.split(key)
  x = jax.random.normal(k_init, (num_clients, *mask.shape, *image_shape), jnp.float32)[index]
  return x * mask.reshape(*mask.shape, *([1] * len(image_shape)))


def synthetic_slot(
  key: jax.Array,
  data: ClientData,
  ipc: int,
  synthetic_init: str,
  *,
  index: int,
  num_clients: int,
  max_classes: int,
) -> SyntheticSet:
  """Client ``index``'s row of :func:`initial_synthetic` over ``num_clients`` clients, from its
  own records alone (a client computing its round-1 set itself, the federation's facts public).

  The same numbers as ``initial_synthetic(key, clients, ...).synthetic[index]`` when the
  clients' most classes are ``max_classes``: labels and mask of this client's classes padded
  to ``S = ipc * max_classes`` slots, images row ``index`` of the ``(K, S, ...)`` N(0, 1) draw.

  Args:
    key: the key :func:`initial_synthetic` is given.
    data: :class:`ClientData` with ``(N, ...)`` leaves (this client's records).
    ipc, synthetic_init: as :func:`initial_synthetic`.
    index, num_clients: this client's ``k`` of ``K``.
    max_classes: the most classes any client owns (a public fact of the run).

  Raises:
    ConfigError: as :func:`initial_synthetic`; ``max_classes`` below this client's classes.
  """
  labels, mask = _checked_labels([np.asarray(data.y)[np.asarray(data.mask)]], ipc, synthetic_init)
  labels, mask = labels[0], mask[0]
  classes = int(np.sum(mask)) // ipc
  if not (isinstance(max_classes, int) and max_classes >= classes):
    raise ConfigError(
      "max_classes", max_classes, f"an integer >= {classes}, the classes this client owns"
    )
  pad = ipc * max_classes - labels.shape[0]
  labels = np.concatenate([labels, np.zeros(pad, labels.dtype)])
  mask = np.concatenate([mask, np.zeros(pad, bool)])
  images = _slot_images(key, jnp.asarray(mask), tuple(data.x.shape[1:]), index, num_clients)
  return SyntheticSet(images, jax.device_put(labels), jax.device_put(mask))


@functools.partial(jax.jit, static_argnames=("image_shape",))
def noise_images(key: jax.Array, mask: jax.Array, image_shape: tuple[int, ...]) -> jax.Array:
  """``N(0, 1)`` images for every valid slot, zeros for padding: ``(*mask.shape, *image_shape)``.

  One compiled program (``image_shape`` static), also when called outside ``jit``: the
  sampler run operation by operation would compile each of its operations on its own.
  """
  x = jax.random.normal(key, (*mask.shape, *image_shape), jnp.float32)
  return x * mask.reshape(*mask.shape, *([1] * len(image_shape)))


def real_images(
  key: jax.Array, client: ClientData, labels: jax.Array, mask: jax.Array, ipc: int
) -> jax.Array:
  """Draws ``ipc`` distinct real images per synthetic class of ONE client.

  Slot ``s`` with label ``c`` gets the ``(s mod ipc)``-th record of class ``c``
  in a random order. Non-private: the methods' configs refuse it under DP.
  Every class of the client needs ``>= ipc`` records (:func:`initial_synthetic`
  checks).

  Args:
    key: PRNG key; client: one client's :class:`ClientData` ``(N, ...)``.
    labels, mask: ``(S,)`` synthetic labels and validity.
    ipc: images per class.

  Returns:
    ``(S, H, W, C)`` float32 images (zeros in padding slots).
  """
  scores = jax.random.uniform(key, client.y.shape)

  def pick(label, rank):
    s = jnp.where(jnp.logical_and(client.y == label, client.mask), scores, -1.0)
    _, idx = jax.lax.top_k(s, ipc)
    return idx[rank]

  ranks = jnp.arange(labels.shape[0]) % ipc
  idx = jax.vmap(pick)(labels, ranks)
  x = client.images(idx).astype(jnp.float32)
  return x * mask.reshape(-1, *([1] * (x.ndim - 1)))


def class_blocks(synthetic: SyntheticSet, ipc: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A synthetic set laid out by :func:`synthetic_labels`, per class.

  Slots come in blocks of ``ipc`` with one label each (then padding blocks), so
  ``S = C * ipc``. Returns ``(x, labels, valid)``: images ``(C, ipc, H, W, C_img)``,
  each block's label ``(C,)`` and whether the block holds a class ``(C,)``.
  The class-wise methods (DSC's gradient matching, FedDM's distribution
  matching) match each block against real records of its class.
  """
  s = synthetic.x.shape[0]
  if s % ipc:
    raise ValueError(
      f"synthetic set of {s} slots is not in blocks of ipc={ipc}; allowed: "
      "the layout of fedlap_jax.synthetic.synthetic_labels"
    )
  blocks = s // ipc
  return (
    synthetic.x.reshape(blocks, ipc, *synthetic.x.shape[1:]),
    synthetic.y.reshape(blocks, ipc)[:, 0],
    synthetic.mask.reshape(blocks, ipc)[:, 0],
  )


def class_batch(
  key: jax.Array,
  client_data: ClientData,
  label: jax.Array,
  valid: jax.Array,
  batch_size: int,
  capacity: int,
) -> privacy.PoissonBatch:
  """A Poisson batch of the client's records of class ``label`` (non-private).

  Each record of the class is drawn with probability ``min(1, B / N_c)`` (``N_c``
  its records of the class): ``B`` expected, the whole class when it holds
  fewer than ``B`` records (as the condensation code's ``get_images(c, B)``).
  The rate depends on ``N_c``, so this sampling is for the non-DP class-wise
  methods only. ``valid=False`` gives an empty batch.
  """
  members = jnp.logical_and(jnp.logical_and(client_data.mask, client_data.y == label), valid)
  n_c = jnp.sum(members)
  rate = jnp.minimum(1.0, batch_size / jnp.maximum(n_c, 1).astype(jnp.float32))
  return privacy.poisson_sample(key, members, rate, capacity)
