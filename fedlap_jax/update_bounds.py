"""The largest model update an honest client of noisy local SGD sends, with high probability.

A DP-FedAvg / DP-FedProx client (:func:`fedlap_jax.baselines.client_update` on the private
path) starts from the global model ``x`` and takes ``T_k <= T`` steps at the round's rate
``eta``. Step ``s`` uses the noisy Poisson-batch gradient of
:func:`fedlap_jax.privacy.poisson_gradient`::

    g_s = (sum_{i in batch_s} clip_C(grad_i) + sigma C z_s) / B,    z_s ~ N(0, I_d),

the batch drawn with rate ``B / N_k`` (every record drawn counts: the overflow of the buffer is
processed in extra chunks, so the realised batch ``n_s`` is bounded by ``N_k``, not by the
buffer's capacity). The local optimiser is linear in what it is fed: SGD with heavy-ball
momentum ``beta`` (:func:`fedlap_jax.optim.sgd`'s ``t <- d + beta t``; Nesterov's steps along
``u_s = d_s + beta t_s``, else ``u_s = t_s``), weight decay ``lambda`` (``d = g + lambda w``)
and the FedProx term ``2 mu (w - x)``::

    d_s = g_s + (2 mu + lambda) delta_s + lambda x,   t_s = d_s + beta t_{s-1},
    delta_{s+1} = delta_s - eta u_s,                  delta = w - x.

So ``delta_T = sum_j c_j (g_j + lambda x)`` with scalar coefficients ``c_j`` (the impulse
response of that recurrence, computed here in float64; ``c_j = -eta`` for plain SGD), and::

    ||delta_T|| <= (C / B) sum_j |c_j| n_j  +  ||(sigma C / B) sum_j c_j z_j||  +  lambda ||x|| S1,

``S1 = sum_j |c_j|``, ``S2 = sum_j c_j^2``, ``M = max_j |c_j|``. Two tail bounds, each failing
with probability at most ``p / 2`` (``L = log(2 / p)``; ``p`` the false-refusal probability of
one honest reply):

* the batches (Bernstein's inequality; each ``n_j`` is a sum of independent Bernoulli draws of
  mean ``<= B`` and variance ``<= B``): ``sum_j |c_j| n_j <= B S1 + t`` with
  ``t = M L / 3 + sqrt((M L / 3)^2 + 2 B S2 L)``, and never more than ``N_max S1``;
* the noise (Laurent and Massart, 2000: ``P(chi^2_d >= d + 2 sqrt(d L) + 2 L) <= e^-L``):
  ``sum_j c_j z_j`` is ``N(0, S2 I_d)``, so its norm is at most
  ``sqrt(S2) sqrt(d + 2 sqrt(d L) + 2 L)``.

A client of fewer steps (``T_k < T``) has a prefix of the same sums, so the bound of ``T``
covers it. Float32 arithmetic adds a relative :data:`FLOAT_SLACK` and the rounding of each step's
``w - eta t``: at most ``2^-24 ||w||`` per step.

Units: every norm is the L2 norm over all the model's parameters, in the parameters' units;
``eta`` is the step size those units are moved by per unit gradient.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import jax
import numpy as np

from fedlap_jax.checks import ConfigError

# The probability that an honest reply is refused (each of the two tail bounds gets half).
FALSE_REFUSAL = 1e-9
# Relative slack for float32 sums and products.
FLOAT_SLACK = 1e-3
# Unit roundoff of float32 (round to nearest).
FLOAT32_ROUNDOFF = 2.0**-24


def step_coefficients(
  learning_rate: float,
  steps: int,
  *,
  prox_mu: float = 0.0,
  momentum: float = 0.0,
  weight_decay: float = 0.0,
  nesterov: bool = False,
) -> list[float]:
  """``c_j``, ``j = 0..T-1``: the factor of step ``j``'s gradient in ``delta_T`` (float64).

  The impulse response of the module docstring's recurrence: ``c_j = h_{T-1-j}`` with ``h_k``
  the ``delta`` after ``k + 1`` steps of a unit gradient at step 0. Plain SGD: every ``c_j`` is
  ``-eta``; FedProx: ``-eta (1 - 2 eta mu)^(T-1-j)``.
  """
  eta, beta, pull = float(learning_rate), float(momentum), 2.0 * prox_mu + weight_decay
  delta, trace, response = 0.0, 0.0, []
  for s in range(int(steps)):
    d = (1.0 if s == 0 else 0.0) + pull * delta
    trace = d + beta * trace
    delta = delta - eta * (d + beta * trace if nesterov else trace)
    response.append(delta)
  return response[::-1]


def local_sgd_update_bound(
  *,
  learning_rate: float,
  steps: int,
  batch_size: int,
  l2_clip_norm: float,
  noise_multiplier: float,
  num_params: int,
  prox_mu: float = 0.0,
  momentum: float = 0.0,
  weight_decay: float = 0.0,
  nesterov: bool = False,
  params_norm: float = 0.0,
  max_batch: int | None = None,
  false_refusal: float = FALSE_REFUSAL,
) -> float:
  """The largest ``||w_k - x||`` of an honest client, but with probability ``false_refusal``.

  The module docstring's bound, float32 slack included.

  Args:
    learning_rate: the round's ``eta`` (what the client steps with).
    steps: ``T``, the most local steps a client takes (the accountant's static count).
    batch_size: ``B``, the expected Poisson batch (also the divisor of the noisy sum).
    l2_clip_norm: ``C``, the per-example clip.
    noise_multiplier: ``sigma`` (the noise's std is ``sigma C``, before the division by ``B``).
    num_params: ``d``, the model's parameter count.
    prox_mu: FedProx's ``mu`` (0: none).
    momentum: the client optimiser's heavy-ball ``beta`` (0: plain SGD).
    weight_decay: the client optimiser's ``lambda`` (0: none).
    nesterov: the client optimiser steps along Nesterov's ``d + beta t``.
    params_norm: ``||x||``, the global model's norm (weight decay's drift, float rounding).
    max_batch: ``N_max``, the largest client's records: a batch never holds more (``None``: the
      tail bound alone).
    false_refusal: ``p`` in ``(0, 1)``.

  Returns:
    The bound, in the parameters' units (with ``eta = 0`` only the rounding slack: an honest
    client then sends ``x`` itself).
  """
  if not 0.0 < false_refusal < 1.0:
    raise ConfigError("false_refusal", false_refusal, "a number in (0, 1)")
  c = [
    abs(v)
    for v in step_coefficients(
      learning_rate,
      steps,
      prox_mu=prox_mu,
      momentum=momentum,
      weight_decay=weight_decay,
      nesterov=nesterov,
    )
  ]
  if not c:
    return 0.0
  s1, s2, m = math.fsum(c), math.fsum(v * v for v in c), max(c)
  b, clip, d = float(batch_size), float(l2_clip_norm), float(num_params)
  tail = math.log(2.0 / false_refusal)
  third = m * tail / 3.0
  records = b * s1 + third + math.sqrt(third * third + 2.0 * b * s2 * tail)
  if max_batch is not None:
    records = min(records, float(max_batch) * s1)
  clipped = clip / b * records
  noise = (
    noise_multiplier
    * clip
    / b
    * math.sqrt(s2)
    * math.sqrt(d + 2.0 * math.sqrt(d * tail) + 2.0 * tail)
  )
  drift = weight_decay * params_norm * s1
  exact = clipped + noise + drift
  rounding = len(c) * FLOAT32_ROUNDOFF * (params_norm + exact)
  return (1.0 + FLOAT_SLACK) * exact + rounding


# -- Normalised local steps ----------------------------------------------------------------------
#
# Adam, Yogi and Adagrad (:class:`fedlap_jax.optim.Optimizer`, optax's ``scale_by_adam``,
# ``scale_by_yogi``, ``scale_by_rss``; their state fresh each round) step each coordinate by
# ``eta |u_t|`` with ``|u_t| <= A_t`` whatever the gradients (weight decay and FedProx's pull are
# part of the gradient they normalise), so ``||delta_T|| <= eta sqrt(d) sum_t A_t`` holds for
# every reply of an honest client, not only with high probability. Per coordinate, ``eps`` only
# shrinks ``|u_t| = |m_hat| / (sqrt(v_hat) + eps)`` below ``|m_hat| / sqrt(v_hat)``:
#
# * Adam (``m_0 = v_0 = 0``, bias-corrected): by Cauchy-Schwarz ``|m_t| <= (1 - b1)
#   sqrt(sum_{k<t} (b1^2 / b2)^k) sqrt(v_t / (1 - b2))``, so ``A_t = (1 - b1) / (1 - b1^t)
#   sqrt((1 - b2^t) / (1 - b2)) sqrt(sum_{k<t} (b1^2 / b2)^k)`` (``A_1 = 1``).
# * Yogi (``m_0 = v_0 = a``, bias-corrected): ``v_t >= b2 v_{t-1}`` and ``v_t >= c g_t^2``
#   (``c = min(b2, 1 - b2)``), so ``|g_{t-k}| <= sqrt(v_t / (c b2^k))`` and ``A_t =
#   sqrt(1 - b2^t) / (1 - b1^t) (sqrt(a) q^t + (1 - b1) / sqrt(c) sum_{k<t} q^k)``,
#   ``q = b1 / sqrt(b2)``.
# * Adagrad: ``|g_t| / sqrt(a + sum_{i<=t} g_i^2 + eps) <= 1``: ``A_t = 1``.
#
# ``b2 = 0`` gives no bound (Adam with ``b1 > 0``, Yogi: ``v`` forgets what ``m`` remembers).
# Float32: a relative :data:`FLOAT_SLACK` and the rounding of each step's ``w - eta u`` (the
# argument assumes no ``g^2`` underflows float32's normal range, ``|g| > 1e-19``, in all of
# ``v``'s memory: an honest DP client's noise makes that failure far rarer than
# :data:`FALSE_REFUSAL`, and it refuses an honest reply, never admits a hostile one).


def normalised_step_bounds(
  name: str, steps: int, *, b1: float = 0.0, b2: float = 0.0, initial_accumulator: float = 0.0
) -> list[float] | None:
  """``A_1 .. A_T``: the largest ``|u_t|`` per coordinate of the optimiser ``name`` (``adam``,
  ``yogi`` or ``adagrad``, as :class:`fedlap_jax.optim.Optimizer` spells its hyper-parameters)
  in step ``t`` from a fresh state; ``None`` where none holds (``b2 = 0`` with memory, another
  name)."""
  t_all = range(1, int(steps) + 1)
  if name == "adagrad":
    return [1.0 for _ in t_all]
  b1, b2 = float(b1), float(b2)
  if name == "adam":
    if b2 == 0.0:
      return [1.0 for _ in t_all] if b1 == 0.0 else None
    gamma, out = b1 * b1 / b2, []
    for t in t_all:
      memory = math.fsum(gamma**k for k in range(t))
      out.append((1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * memory))
    return out
  if name == "yogi":
    c = min(b2, 1.0 - b2)
    if c <= 0.0:
      return None
    q, a, out = b1 / math.sqrt(b2), float(initial_accumulator), []
    for t in t_all:
      memory = math.fsum(q**k for k in range(t))
      moment = math.sqrt(a) * q**t + (1 - b1) / math.sqrt(c) * memory
      out.append(math.sqrt(1 - b2**t) / (1 - b1**t) * moment)
    return out
  return None


def normalised_update_bound(
  step_bounds: list[float], *, learning_rate: float, num_params: int, params_norm: float = 0.0
) -> float:
  """The largest ``||w_k - x||`` of a client whose step ``t`` moves each of its ``d``
  coordinates by at most ``eta A_t``: ``eta sqrt(d) sum_t A_t``, float32 slack included.

  Args:
    step_bounds: ``A_1 .. A_T`` (:func:`normalised_step_bounds`).
    learning_rate: the round's ``eta``.
    num_params: ``d``.
    params_norm: ``||x||`` (the rounding of ``w - eta u``).
  """
  exact = abs(float(learning_rate)) * math.sqrt(float(num_params)) * math.fsum(step_bounds)
  rounding = len(step_bounds) * FLOAT32_ROUNDOFF * (params_norm + exact)
  return (1.0 + FLOAT_SLACK) * exact + rounding


# -- FedLAP's update -----------------------------------------------------------------------------
#
# A FedLAP client sends its synthetic set, its radius r_k and, with server.start='fedavg_delta',
# its model delta. The bounds below are what an honest client's r_k and delta keep (the Flower
# server refuses a reply outside them: :attr:`fedlap_jax.method.Method.check_update`).
#
# * r_k in [RADIUS_FLOOR_PER_LR * eta_m, r]: r_k is r under DP and without calibration; a
#   calibrated r_k is the distance the global model moved after at least one epoch of SGD at the
#   round's eta_m on the client's synthetic set, capped at r (eta_m times the length of the summed
#   gradient steps). quickstart:nondp (10 rounds on the digits) measures r_k / eta_m from 13.8 to
#   112 every round; the floor, 1e-3 eta_m, leaves a factor above 10^4 for honest clients and
#   refuses what no SGD step gives (1e-30, zero, denormals).
# * ||delta|| (DP, client.model_steps='noisy_real'): the model moves once per while-loop
#   iteration by eta_m g, g the mean of batch_loop noisy clipped gradients (sum of at most n
#   clipped gradients + N(0, sigma^2 C^2 I_d)) / B, and the loop stops once ||w - w_g|| >= r. So
#   ||delta|| <= min(r + eta_m G, max_outer eta_m G) with G = C (B + t) / B + sigma C (sqrt(d) +
#   s) / (B sqrt(batch_loop)), where n <= B + t and ||z|| <= sqrt(d) + s for the standard normal
#   z in d dimensions each fail with probability at most exp(-TAIL_LOG) (Bernstein's inequality
#   for the Poisson batch, Gaussian concentration of the norm): over the T batches of a round an
#   honest reply exceeds the bound with probability below 2 T exp(-80). Without DP nothing bounds
#   an honest client's delta.

# The smallest r_k accepted, in units of the round's learning rate eta_m.
RADIUS_FLOOR_PER_LR = 1e-3
# The delta bound of :func:`matching_delta_bound` fails with probability <= exp(-TAIL_LOG).
TAIL_LOG = 80.0


def radius_floor(learning_rate: float) -> float:
  """The smallest ``r_k`` an honest client sends in a round of client rate ``eta_m``:
  ``1e-3 eta_m``, as the float32 the client computes ``r_k`` in."""
  return float(np.float32(RADIUS_FLOOR_PER_LR * abs(float(learning_rate))))


def check_radius(radius: float, max_radius: float, min_radius: float = 0.0) -> float:
  """``radius`` (a finite number) if it is in ``[min_radius, max_radius]`` and ``> 0``.

  Args:
    radius: a client's ``r_k``.
    max_radius: the config's ``client.radius`` ``r`` (as float32).
    min_radius: :func:`radius_floor` of the round's ``eta_m``.

  Raises:
    ConfigError: naming ``radius``, the value and the range.
  """
  if not (0 < radius and min_radius <= radius <= max_radius):
    low = f"[{min_radius:g}" if min_radius > 0 else "(0"
    raise ConfigError(
      "radius",
      radius,
      f"a number in {low}, {max_radius:g}] (r_k <= the config's client.radius; "
      f"r_k >= {RADIUS_FLOOR_PER_LR:g} x the round's learning rate, less than one SGD step)",
    )
  return radius


def matching_delta_bound(client_config, learning_rate: float, num_params: int) -> float | None:
  """The largest ``||delta||`` an honest FedLAP-DP client sends (the bound above).

  Args:
    client_config: :class:`fedlap_jax.ClientConfig` of the run.
    learning_rate: the round's ``eta_m`` (what the client stepped with).
    num_params: ``d``, the model's parameter count.

  Returns:
    The bound, or ``None`` without DP or without ``model_steps='noisy_real'`` (no clip: nothing
    bounds an honest client's step).
  """
  c = client_config
  if c.dp is None or c.model_steps != "noisy_real":
    return None
  b, clip, sigma = float(c.batch_size), float(c.dp.l2_clip_norm), float(c.dp.noise_multiplier)
  extra = TAIL_LOG / 3 + math.sqrt(TAIL_LOG**2 / 9 + 2 * TAIL_LOG * b)
  norm_tail = math.sqrt(2 * TAIL_LOG)
  g = clip * (b + extra) / b + sigma * clip * (math.sqrt(num_params) + norm_tail) / (
    b * math.sqrt(c.batch_loop)
  )
  step = abs(float(learning_rate)) * g
  return (1 + FLOAT_SLACK) * min(float(c.radius) + step, c.max_outer * step)


def tree_norm(tree) -> float:
  """``||tree||`` over every leaf, in float64 (a bound is compared with it on the host)."""
  return math.sqrt(
    math.fsum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in jax.tree.leaves(tree))
  )


def check_delta_norm(leaves: Iterable[Any], max_norm: float | None) -> float:
  """``||delta||`` over every leaf (:func:`tree_norm`); refuses it above ``max_norm``
  (``None``: none).

  Raises:
    ConfigError: naming ``delta``, its norm and the bound.
  """
  norm = tree_norm(list(leaves))
  if max_norm is not None and not norm <= max_norm:
    raise ConfigError(
      "delta",
      norm,
      f"at most {max_norm:.4g}",
      message=f"delta has norm {norm:.4g}; allowed: at most {max_norm:.4g}, what an honest "
      "client's eta_m, clip, noise and radius allow",
    )
  return norm
