"""What a client's reply may hold: checks against what the round expects (no ``flwr``).

The server handles every reply as untrusted input. Each check raises
:class:`InvalidReply` naming the field (``x``, ``y``, ``mask``, ``radius``,
``num-examples``, ``epsilon``, ``partition-id``, ``model_delta``, ...), the
value and what is allowed; the strategy drops that reply with the reason and
the round goes on with the others.

The bounds, and why an honest client stays inside them:

* **Synthetic set** (:func:`check_synthetic`): ``x`` float32
  ``(S, *image_shape)``, ``y`` int32 ``(S,)``, ``mask`` bool ``(S,)``, the shapes of the
  method's wire (``S = ipc *`` the most classes a client holds; padding fills a set up to
  them), checked by name before any value is read, and ``S <= ipc * num_classes``. The
  labels are :func:`fedlap_jax.synthetic.synthetic_labels`'s layout: the
  valid slots first, ``ipc`` per class the client owns, classes in
  increasing order in ``[0, num_classes)``, padding labelled 0. They are
  fixed for a run, so the strategy pins each partition's labels at its first
  accepted reply.
* **Image range**: ``|x| <= max_image_abs``, by default
  :data:`IMAGE_RANGE_FACTOR` times the largest ``|pixel|`` of the normalised
  test split (:func:`image_bound`). Honest synthetic images start as N(0, 1)
  draws and are moved by the matching loss towards images whose gradients
  look like the real data's; the synthetic sets of the project's test runs
  stay within 5 times the real pixel range. The bound leaves a factor of 200
  above that; a reply beyond it is refused with a reason naming the bound,
  never clamped, and the run config's ``max-image-abs`` sets another bound.
* **Model delta** (FedLAP's ``model_delta.*`` with ``client.model_steps='noisy_real'``,
  ``server.start='fedavg_delta'``): at most
  :func:`fedlap_jax.update_bounds.matching_delta_bound` under DP (why an honest client stays
  inside it: :mod:`fedlap_jax.update_bounds`); without DP no bound follows from the config,
  and the delta is checked for shape and finiteness only.
* **Model of a FedAvg-wire method** (:func:`update_norm_rule`, the run config's
  ``max-update-norm``): ``||w_k - w_g||`` at most the round's bound, by default (and with
  ``'auto'``) the method's own (:attr:`fedlap_jax.method.Method.update_bound`; DP-FedAvg /
  DP-FedProx with SGD clients (momentum, Nesterov, weight decay):
  :func:`fedlap_jax.update_bounds.local_sgd_update_bound` at the round's ``eta_m``, exceeded
  by an honest reply with probability below :data:`fedlap_jax.update_bounds.FALSE_REFUSAL`;
  with Adam, Yogi or Adagrad clients, :func:`fedlap_jax.update_bounds.normalised_update_bound`,
  which no reply of theirs exceeds). A reply above it is refused (never clipped) with its
  norm and the bound in its report. Without DP there is no bound unless the run config gives
  a number; a DP config whose client optimiser bounds no step (``b2 = 0``) is refused unless
  the run config gives a number or ``'none'``.
* **FedLAP's r_k** (its update's ``radius``; :attr:`~fedlap_jax.method.Method.check_update`)
  in ``[radius_floor(eta_m), r]`` (:func:`fedlap_jax.update_bounds.radius_floor`; why honest
  clients stay inside: :mod:`fedlap_jax.update_bounds`). The floor stops degenerate values
  only: with ``server.radius_strategy='min'`` one client still sets ``r_g`` anywhere in
  ``[floor, r]`` (docs/flower.md).
* **Metrics** (:func:`scalar`): one int or float each (no lists, strings,
  bools), finite, every one bounded above and below:

  - ``num-examples`` an int in ``[1, MAX_NUM_EXAMPLES]`` (2^24: every count
    up to it is exact in the library's float32 client weights and fits the
    int32 the server passes the counts in). The strategy also pins each
    partition's ``N_k`` at its first accepted reply
    (:meth:`fedlap_flower.binding.PartitionBinding.pin`): a reply that
    changes it is refused.
  - ``epsilon`` (the client's ledger: every run it ever answered, composed) in
    ``[0, max-epsilon]`` (the run config's cap, which every client keeps; without one
    unbounded above: the server never saw the earlier runs). It is the client's own report:
    the server publishes it labelled so.
  - ``run-epsilon`` (the epsilon of the rounds charged in this Flower run alone) at most what
    this run's rounds so far of its mechanism can give any client, whatever its ``N_k``
    (:meth:`fedlap_jax.accounting.DpMechanism.epsilon_bound`), with or without a cap.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from fedlap_jax import update_bounds
from fedlap_jax.checks import ConfigError

from fedlap_flower.refusal import Refusal

# |x| of an accepted synthetic image is at most this times the largest |pixel| of the
# normalised test split (at least 1).
IMAGE_RANGE_FACTOR = 1000.0
# The largest num-examples accepted (module docstring): float32 counts are exact up to 2^24.
MAX_NUM_EXAMPLES = 2**24


class InvalidReply(Refusal):
  """A reply that does not fit the round; ``field`` names what is wrong."""


def short(value: Any, limit: int = 80) -> str:
  """``repr(value)``, cut to ``limit`` characters (a reply's values can be huge)."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _fail(field: str, value: Any, allowed: str):
  raise InvalidReply(field, f"{field}={short(value)} is invalid; allowed: {allowed}")


# ----------------------------------------------------------------------------
# Scalars.
# ----------------------------------------------------------------------------


def scalar(metrics: Mapping[str, Any], key: str, *, integer: bool = False, required: bool = True):
  """``metrics[key]`` as one finite number (``None`` if absent and not ``required``).

  Raises:
    InvalidReply: missing (when ``required``), a list, string or bool, a
      float where an int is needed, or NaN / Inf.
  """
  if key not in metrics:
    if required:
      raise InvalidReply(key, f"{key} is missing; allowed: one {'int' if integer else 'number'}")
    return None
  v = metrics[key]
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, kinds):
    _fail(key, v, f"one {'int' if integer else 'finite number'}")
  if not integer:
    try:
      v = float(v)
    except OverflowError:  # a Python int beyond float64
      _fail(key, v, "a finite number")
    if not math.isfinite(v):
      _fail(key, v, "a finite number")
  return int(v) if integer else v


def check_num_examples(metrics: Mapping[str, Any], required: bool) -> int | None:
  """``num-examples``: an int in ``[1, MAX_NUM_EXAMPLES]`` (``None`` if absent and not
  ``required``)."""
  n = scalar(metrics, "num-examples", integer=True, required=required)
  if n is not None and not 1 <= n <= MAX_NUM_EXAMPLES:
    _fail("num-examples", n, f"an int in [1, {MAX_NUM_EXAMPLES}] (the client's records)")
  return n


def check_epsilon(
  metrics: Mapping[str, Any],
  required: bool,
  max_epsilon: float = math.inf,
  bound: str = "the run's max-epsilon",
  key: str = "epsilon",
) -> float | None:
  """``metrics[key]``: a finite number in ``[0, max_epsilon]`` (``None`` if absent and not
  ``required``); ``max_epsilon`` is what ``bound`` says: the run config's cap, which every
  client keeps (of ``epsilon``), or the most the run's rounds so far of its mechanism can give
  a client (of ``run-epsilon``)."""
  eps = scalar(metrics, key, required=required)
  if eps is not None and not 0 <= eps <= max_epsilon:
    _fail(
      key,
      eps,
      "a finite number >= 0"
      + (f" and <= {bound}={max_epsilon:g}" if math.isfinite(max_epsilon) else ""),
    )
  return eps


def check_partition(
  metrics: Mapping[str, Any], num_partitions: int, bound: int | None = None
) -> int:
  """``partition-id``: an int in ``[0, K)``, equal to ``bound`` (the node's partition) if given."""
  pid = scalar(metrics, "partition-id", integer=True)
  if not 0 <= pid < num_partitions:
    _fail("partition-id", pid, f"an int in [0, {num_partitions - 1}]")
  if bound is not None and pid != bound:
    raise InvalidReply(
      "partition-id",
      f"partition-id={pid} is invalid; allowed: {bound}, the "
      "partition this node is bound to for the run",
    )
  return pid


# ----------------------------------------------------------------------------
# Arrays.
# ----------------------------------------------------------------------------


def check_array(name: str, array: np.ndarray, dtype, shape: tuple | None = None) -> np.ndarray:
  """``array`` of exactly ``dtype`` (and ``shape`` if given), every value finite if floating."""
  if not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype):
    got = getattr(array, "dtype", type(array).__name__)
    raise InvalidReply(name, f"{name} has dtype {got}; allowed: {np.dtype(dtype).name}")
  if shape is not None and array.shape != tuple(shape):
    raise InvalidReply(name, f"{name} has shape {array.shape}; allowed: {tuple(shape)}")
  if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
    raise InvalidReply(name, f"{name} holds NaN or Inf; allowed: finite values")
  return array


class SyntheticLimits(NamedTuple):
  """What a synthetic set of this run may be (see the module docstring).

  Attributes:
    image_shape: ``(H, W, C)`` of the model's input.
    num_classes: of the dataset.
    ipc: ``client.ipc``.
    max_image_abs: the largest ``|x|`` accepted.
  """

  image_shape: tuple
  num_classes: int
  ipc: int
  max_image_abs: float

  @property
  def max_slots(self) -> int:
    return self.ipc * self.num_classes


def check_slot_count(shape: tuple, limits: SyntheticLimits) -> int:
  """``S`` of an ``x`` of ``shape``: ``(S, *image_shape)`` with ``1 <= S <= ipc * num_classes``."""
  shape = tuple(shape)
  if len(shape) != 1 + len(limits.image_shape) or shape[1:] != tuple(limits.image_shape):
    raise InvalidReply(
      "x",
      f"x has shape {shape}; allowed: (S, {', '.join(map(str, limits.image_shape))}), "
      "the model's input shape",
    )
  s = shape[0]
  if not 1 <= s <= limits.max_slots:
    raise InvalidReply(
      "x",
      f"x has {s} slots; allowed: 1..{limits.max_slots} (client.ipc="
      f"{limits.ipc} x {limits.num_classes} classes)",
    )
  return s


def check_labels(y: np.ndarray, mask: np.ndarray, limits: SyntheticLimits) -> None:
  """``y``, ``mask`` in :func:`fedlap_jax.synthetic.synthetic_labels`'s layout."""
  if y.size and (y.min() < 0 or y.max() >= limits.num_classes):
    bad = int(y.min()) if y.min() < 0 else int(y.max())
    raise InvalidReply("y", f"y holds label {bad}; allowed: labels in [0, {limits.num_classes})")
  n = int(mask.sum())
  if not mask[:n].all():
    raise InvalidReply(
      "mask",
      "mask has padding before valid slots; allowed: the valid slots "
      "first (True ... then False ...)",
    )
  if n == 0 or n % limits.ipc:
    raise InvalidReply(
      "mask", f"mask has {n} valid slots; allowed: a positive multiple of client.ipc={limits.ipc}"
    )
  rows = y[:n].reshape(-1, limits.ipc)
  if not (rows == rows[:, :1]).all() or not (np.diff(rows[:, 0]) > 0).all():
    raise InvalidReply(
      "y",
      f"y={short(y[:n].tolist())} is invalid; allowed: client.ipc="
      f"{limits.ipc} slots per class the client owns, classes in increasing "
      "order (fixed for the run)",
    )
  if (y[n:] != 0).any():
    raise InvalidReply("y", "y labels a padding slot; allowed: label 0 where mask is False")


def check_synthetic(x: np.ndarray, y: np.ndarray, mask: np.ndarray, limits: SyntheticLimits):
  """Checks a synthetic set's arrays; returns them (as given)."""
  s = check_slot_count(getattr(x, "shape", ()), limits)
  check_array("x", x, np.float32)
  check_array("y", y, np.int32, (s,))
  check_array("mask", mask, np.bool_, (s,))
  biggest = float(np.abs(x).max())
  if biggest > limits.max_image_abs:
    raise InvalidReply(
      "x", f"x holds |value| {biggest:.4g}; allowed: at most max-image-abs={limits.max_image_abs:g}"
    )
  check_labels(y, mask, limits)
  return x, y, mask


def image_bound(max_abs_pixel: float) -> float:
  """The default ``max_image_abs``: :data:`IMAGE_RANGE_FACTOR` x ``max(1, max_abs_pixel)``.

  ``max_abs_pixel``: the largest ``|pixel|`` of the normalised test split.
  """
  return IMAGE_RANGE_FACTOR * max(1.0, float(max_abs_pixel))


# ----------------------------------------------------------------------------
# Model deltas.
# ----------------------------------------------------------------------------


def check_delta_norm(flat: Mapping[str, np.ndarray], max_norm: float | None) -> float:
  """``||delta||`` over every leaf (float64); refuses it above ``max_norm``
  (:func:`fedlap_jax.update_bounds.check_delta_norm`)."""
  try:
    return update_bounds.check_delta_norm(flat.values(), max_norm)
  except ConfigError as e:
    raise InvalidReply(e.field, str(e)) from None


# ----------------------------------------------------------------------------
# The model of a FedAvg-wire reply.
# ----------------------------------------------------------------------------


def update_norm_rule(setting, method, config, facts) -> Callable[[Any], float | None]:
  """``message -> bound`` (``None``: no bound) of ``max-update-norm`` for ``method``'s rounds.

  Args:
    setting: the checked run-config value: a float, ``'auto'``, ``''`` (the default) or
      ``None`` (``'none'``).
    method: the :class:`fedlap_jax.method.Method` (its :attr:`update_bound`).
    config, facts: its library config and :class:`~fedlap_jax.method.RunFacts`.

  Raises:
    ConfigError: naming ``max-update-norm``: ``'auto'`` where the method derives no bound from
      ``config`` (no DP, or a client optimiser whose steps have none), and ``''`` for a DP
      config of a bounded method that derives none (a hostile client's reply would go
      unchecked under a mechanism whose honest replies are bounded).
  """
  if setting is None:
    return lambda message: None
  if not isinstance(setting, str):
    return lambda message: float(setting)
  derived = None if method.update_bound is None else method.update_bound(config, facts)
  if derived is not None:
    return derived
  private = method.update_bound is not None and method.mechanism(config) is not None
  if setting == "auto" or private:
    none = "'none' (no bound: one client moves the mean anywhere)"
    if private:
      why = (
        "its client optimiser bounds no step: Adam or Yogi with b2=0; SGD, Nesterov, Adagrad, "
        "and Adam or Yogi with b2 > 0 do"
      )
      allowed = f"a number > 0 (the largest ||w_k - w_g|| accepted) or {none}"
    else:
      why = "it needs DP's clipped, noised local steps: dp_fedavg, dp_fedprox"
      allowed = f"a number > 0, {none} or '' (the default)"
    raise ConfigError(
      "max-update-norm",
      setting,
      allowed,
      message=f"max-update-norm={setting!r} is invalid for method={method.name!r}: no bound on "
      f"an honest client's update follows from its config ({why}); allowed: {allowed}",
    )
  return lambda message: None


def update_norm(update, params) -> float:
  """``||update - params||`` over every leaf (:func:`fedlap_jax.update_bounds.tree_norm`)."""
  pairs = zip(jax.tree.leaves(update), jax.tree.leaves(params))
  return update_bounds.tree_norm(
    [np.asarray(u, np.float64) - np.asarray(p, np.float64) for u, p in pairs]
  )


def check_update_norm(norm: float, bound: float | None) -> None:
  """Refuses a reply whose ``||w_k - w_g||`` is ``norm`` above ``bound`` (``None``: none)."""
  if bound is not None and not norm <= bound:
    raise InvalidReply(
      "update-norm",
      f"update-norm={norm:.6g} (||w_k - w_g||) is invalid; allowed: at most max-update-norm="
      f"{bound:.6g}, what an honest client's learning rate, steps, clip and noise allow",
    )
