"""Host-side privacy accounting for FedLAP-DP: the mechanism, its epsilon, the ledgers.

Every DP method of the project (FedLAP-DP, DP-FedAvg, DP-FedProx, PSG) runs the
same mechanism on each client ``k`` in each round: ``T`` noisy steps
(``T = steps_per_round``), each a Poisson sample of the client's ``N_k``
records at rate ``q_k = B / N_k`` whose per-record gradients are clipped and
summed with Gaussian noise of multiplier ``sigma`` (noise std / clip norm).
:class:`DpMechanism` is that declaration, the one value a method hands to
everything that accounts for it (calibration, the experiment's ledgers, a
Flower client's ledger); :meth:`DpMechanism.from_config` reads it from any
method's library config, so ``B`` and ``T`` are never copied by hand.
:class:`PrivacyLedger` composes the rounds of one client (it holds the
mechanism and the client's ``N_k``, nothing else) and :class:`ClientLedgers`
those of many; both record a round with ``record_round(steps, participants=...)``.

Neighbouring datasets (``adjacency``)
-------------------------------------
The guarantee is record-level and per client. Two notions are computed:

* ``"replace_one"`` (the default everywhere in this module): the client's
  data set with one record replaced by another, the size ``N_k`` fixed. This
  is the guarantee that holds when ``N_k`` and the client's classes are
  public, as they are here: the experiments release ``client_sizes`` and
  ``client_classes``, and a client's epsilon determines its ``N_k`` (the rate
  ``q_k = B / N_k`` enters it). Its epsilon is computed with
  ``dp_accounting``'s privacy loss distributions (PLD,
  ``NeighboringRelation.REPLACE_ONE``; RDP does not support it for the
  Poisson-sampled Gaussian), discretised at :data:`PLD_DISCRETIZATION` nats
  with pessimistic rounding, so the figure is an upper bound.
* ``"add_remove"``: one record added or removed (the paper's notion, Renyi DP
  of the Poisson-subsampled Gaussian in one ``RdpAccountant``). It describes
  neighbours of different sizes, which public ``N_k`` rule out; it is
  computed only where asked for by this explicit name, for comparison with
  the paper's numbers (every ledger keeps it beside the headline).

For the same ``q``, ``sigma`` and ``T`` the replace-one epsilon is larger
(``q = 46/274``, ``sigma = 2.92``, ``T = 100``, ``delta = 1e-5``: add/remove
2.78 by RDP, 2.54 by PLD; replace-one 5.12 by PLD).

What is refused before any accounting runs
-------------------------------------------
* ``sigma`` below :data:`MIN_NOISE_MULTIPLIER` (0.3). Below it no setting of
  this library gives a guarantee worth stating (one full-batch step at the
  floor already has a replace-one epsilon of about 50 at ``delta = 1e-5``;
  1,000 steps at ``q = 0.001`` about 18), while the cost of a replace-one PLD
  grows without bound as ``sigma`` shrinks (at ``sigma = 0.001`` one step
  exhausts the memory of a machine). At the floor one evaluation of 20,000
  steps at ``q = 1``, the costliest rate, took about 4 s and 1.5 GB of peak
  memory on a 2-core machine; at ``sigma = 0.1`` 33 s and 3.8 GB
  (benchmarks/results/timings.md, retired scripts).
* ``delta >= 1 / N_k`` for a client of ``N_k`` records: such a ``delta``
  allows a mechanism that publishes one whole record.

A budget that a ledger already exceeds is detected without the full PLD, by the cheap lower
bound :meth:`PrivacyLedger.epsilon_lower_bound_after`.

Participation
-------------
The paper amplifies the first step of each round by the probability ``c``
that a client takes part (``q1 = c * B / min_k N_k``). That is unsound when
who takes part is public (here: every client in every round, or clients
drawn from the public participation seed and released per round), and the
project never uses it: nothing in this module has a participation term, and
a stored ledger that declares one other than 1 is refused.

Units: ``rounds`` ``M`` communication rounds; ``min_client_size`` / ``client_size`` the
``N_k`` accounted for (the smallest client gives the largest rate); ``delta`` a probability in
``(0, 1 / N_k)``; ``epsilon`` in nats (natural log).

Cost: the RDP vector and the PLD of one step are cached per ``(q, sigma)`` and a replace-one
epsilon per ``(q, sigma, steps, delta)`` (``functools.lru_cache``), so ledgers that share a
rate share their compositions, and a setting calibrated or reported again computes no RDP again.

This module needs neither JAX nor NumPy to import; ``dp_accounting`` (and the
NumPy it brings) is imported only inside the functions that use it, so
``import fedlap_jax.accounting`` works where ``dp_accounting`` is missing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from fedlap_jax import checks
from fedlap_jax.checks import ConfigError

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
  import dp_accounting

__all__ = [
  "ADD_REMOVE",
  "REPLACE_ONE",
  "ADJACENCIES",
  "MIN_NOISE_MULTIPLIER",
  "check_accountable_sigma",
  "check_record_delta",
  "PLD_DISCRETIZATION",
  "LOWER_BOUND_DISCRETIZATION",
  "DpMechanism",
  "round_event",
  "epsilon",
  "epsilon_after_rounds",
  "calibrate_noise_multiplier",
  "PrivacyLedger",
  "ClientLedgers",
]

REPLACE_ONE = "replace_one"
ADD_REMOVE = "add_remove"
ADJACENCIES = (REPLACE_ONE, ADD_REMOVE)

# The smallest noise multiplier the accountant accepts (module docstring: below it no
# guarantee is worth stating, and a replace-one PLD grows without bound).
MIN_NOISE_MULTIPLIER = 0.3

# Relative / absolute tolerance used when a stored ledger's epsilons are
# checked against the recomputed ones.
_LEDGER_TOL = 1e-9

# The largest noise multiplier calibrate_noise_multiplier searches.
_MAX_SIGMA = 1e6

# Width (nats) of the privacy-loss grid of the replace-one PLD. dp_accounting
# rounds pessimistically, so a coarser grid only raises epsilon: at q = 46/274,
# sigma = 2.92, T = 100 this grid gives 5.11629 against 5.11625 at 1e-4, 15x
# faster.
PLD_DISCRETIZATION = 1e-3

# Width (nats) of the optimistic PLD whose epsilon bounds the headline from below
# (PrivacyLedger.epsilon_lower_bound_after): at q = 46/274, sigma = 2.92, T = 100 it gives
# 4.62 against the headline's 5.12; at the floor, q = 1 and 20,000 steps it took 0.35 s and
# 0.36 GB peak against the headline's 4.3 s and 1.5 GB (benchmarks/results/timings.md).
LOWER_BOUND_DISCRETIZATION = 1e-2


# --------------------------------------------------------------------------
# Validation: every error is a ConfigError naming the field, the value and
# what is allowed (fedlap_jax.checks).
# --------------------------------------------------------------------------


class _DropRdpOrderWarnings(logging.Filter):
  """Hides dp_accounting's per-order convergence warnings.

  For large sampling rates some low RDP orders do not converge; dp_accounting
  then logs one warning per order and call and leaves that order out of the
  minimum, so the reported epsilon is still a valid upper bound. Only that
  exact message is dropped.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return "_compute_log_a_frac failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropRdpOrderWarnings())


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
  """A noise multiplier > 0 (what a mechanism may declare; accounting needs the floor too)."""
  checks.require(
    checks.is_real(value) and value > 0,
    name,
    value,
    "a finite number > 0 (sigma = 0 adds no noise, so the differential-privacy "
    "guarantee would be void)",
  )
  return float(value)


def check_accountable_sigma(value: Any, name: str = "noise_multiplier") -> float:
  """A noise multiplier the accountant accounts for: finite and >= MIN_NOISE_MULTIPLIER."""
  checks.require(
    checks.is_real(value) and value >= MIN_NOISE_MULTIPLIER,
    name,
    value,
    f"a finite number >= MIN_NOISE_MULTIPLIER = {MIN_NOISE_MULTIPLIER:g} (sigma = 0 adds no "
    "noise, so the differential-privacy guarantee would be void; below the floor no setting "
    "gives a useful guarantee and the accountant's cost grows without bound)",
  )
  return float(value)


def _check_sizes(
  batch_size: Any, min_client_size: Any, name: str = "min_client_size"
) -> tuple[int, int]:
  batch_size = checks.integer("batch_size", batch_size, minimum=1)
  checks.require(
    checks.is_int(min_client_size) and min_client_size >= batch_size,
    name,
    min_client_size,
    f"an integer >= batch_size={batch_size} (records of the "
    "client; the sampling rate batch_size / N_k must be <= 1)",
  )
  return batch_size, int(min_client_size)


def check_record_delta(delta: Any, client_size: int, name: str = "delta") -> float:
  """``delta`` in ``(0, 1 / N_k)``: a larger one allows publishing a whole record."""
  delta = checks.probability(name, delta)
  checks.require(
    delta < 1.0 / client_size,
    name,
    delta,
    f"a delta < 1 / N_k = 1/{client_size} = {1.0 / client_size:.3g} (N_k: the records of "
    "the client accounted for; a delta of 1 / N_k allows releasing a whole record)",
  )
  return delta


def _check_adjacency(value: Any) -> str:
  checks.one_of("adjacency", value, ADJACENCIES)
  return value


def _rate(batch_size: int, min_client_size: int) -> float:
  """``q = B / N_k`` (validated)."""
  batch_size, min_client_size = _check_sizes(batch_size, min_client_size)
  return batch_size / min_client_size


# --------------------------------------------------------------------------
# The two epsilons of n steps at rate q (cached).
# --------------------------------------------------------------------------


def _orders():
  from dp_accounting.rdp import rdp_privacy_accountant  # pylint: disable=g-import-not-at-top

  return rdp_privacy_accountant.DEFAULT_RDP_ORDERS


@functools.lru_cache(maxsize=4096)
def _step_rdp(q: float, sigma: float):
  """RDP (add/remove) of one Poisson-sampled Gaussian step at the default orders.

  The vector ``RdpAccountant`` adds ``count`` times per composed
  ``PoissonSampledDpEvent`` (the same function on the same orders), so sums
  of it reproduce the accountant's numbers bit for bit. Read-only.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dp_accounting.rdp import rdp_privacy_accountant  # pylint: disable=g-import-not-at-top

  vec = np.asarray(
    rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(  # pylint: disable=protected-access
      q=q, noise_multiplier=sigma, orders=np.array(_orders())
    ),
    dtype=np.float64,
  )
  vec.flags.writeable = False
  return vec


def _rdp_epsilon(rdp, delta: float) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dp_accounting.rdp import rdp_privacy_accountant  # pylint: disable=g-import-not-at-top

  return float(rdp_privacy_accountant.compute_epsilon(np.array(_orders()), rdp, delta)[0])


def _add_remove(q: float, steps: int, sigma: float, delta: float) -> float:
  """Add/remove epsilon (RDP) of ``steps`` steps at rate ``q``: what ``RdpAccountant`` gives
  for them as one self-composed event (it adds ``steps * rdp(step)`` to zeros), bit for bit."""
  return _rdp_epsilon(steps * _step_rdp(q, sigma), delta)


@functools.lru_cache(maxsize=512)
def _step_pld(q: float, sigma: float, pessimistic: bool = True):
  """PLD (replace-one) of one Poisson-sampled Gaussian step.

  ``pessimistic``: losses rounded up on a grid of :data:`PLD_DISCRETIZATION`
  (an upper bound, the headline); otherwise rounded down on the coarser
  :data:`LOWER_BOUND_DISCRETIZATION` with the tails dropped (a lower bound).
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top
  from dp_accounting.pld import privacy_loss_distribution  # pylint: disable=g-import-not-at-top

  return privacy_loss_distribution.from_gaussian_mechanism(
    standard_deviation=sigma,
    sampling_prob=q,
    value_discretization_interval=PLD_DISCRETIZATION if pessimistic else LOWER_BOUND_DISCRETIZATION,
    neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
    **({} if pessimistic else {"pessimistic_estimate": False, "use_connect_dots": False}),
  )


@functools.lru_cache(maxsize=65536)
def _replace_one(q: float, steps: int, sigma: float, delta: float) -> float:
  """Replace-one epsilon (upper bound) of ``steps`` steps at rate ``q``; 0.0 for none."""
  if not steps:
    return 0.0
  pld = _step_pld(q, sigma)
  pld = pld.self_compose(steps) if steps > 1 else pld
  return float(pld.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=4096)
def _replace_one_lower(q: float, steps: int, sigma: float, delta: float) -> float:
  """A lower bound of :func:`_replace_one` (optimistic PLD on a coarse grid).

  ``dp_accounting``'s optimistic evaluation can overflow ``exp`` on losses far
  below zero; ``0.0`` (a valid lower bound) is returned then.
  """
  if not steps:
    return 0.0
  pld = _step_pld(q, sigma, pessimistic=False)
  pld = pld.self_compose(steps) if steps > 1 else pld
  try:
    return max(0.0, float(pld.get_epsilon_for_delta(delta)))
  except OverflowError:
    return 0.0


def _check_events_accountable(event) -> None:
  """Refuses a Gaussian of noise multiplier below the floor anywhere in ``event``."""
  import dp_accounting  # pylint: disable=g-import-not-at-top

  if isinstance(event, dp_accounting.GaussianDpEvent):
    check_accountable_sigma(event.noise_multiplier, "events_or_event[].noise_multiplier")
  elif isinstance(event, dp_accounting.ComposedDpEvent):
    for e in event.events:
      _check_events_accountable(e)
  elif isinstance(event, (dp_accounting.SelfComposedDpEvent, dp_accounting.PoissonSampledDpEvent)):
    _check_events_accountable(event.event)


# --------------------------------------------------------------------------
# Events and epsilon.
# --------------------------------------------------------------------------


def round_event(
  *, noise_multiplier: float, batch_size: int, min_client_size: int, steps_per_round: int
) -> "dp_accounting.DpEvent":
  """The ``dp_accounting`` event of one round for one client.

  ``ComposedDpEvent([PoissonSampled(q, Gaussian(sigma)),
  SelfComposed(PoissonSampled(q, Gaussian(sigma)), T - 1)])`` with
  ``q = B / N_k``; the second part is left out when ``T == 1``. (The first
  step is its own event, as the ledgers compose it, so that their add/remove
  figures equal ``RdpAccountant``'s bit for bit.)

  Args:
    noise_multiplier: ``sigma`` (noise std / clip norm), >= :data:`MIN_NOISE_MULTIPLIER`.
    batch_size: ``B``, records per step, >= 1.
    min_client_size: ``N_k``, records, >= ``batch_size``.
    steps_per_round: ``T``, noisy local steps in the round, >= 1.

  Returns:
    A ``dp_accounting.DpEvent``.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  sigma = check_accountable_sigma(noise_multiplier)
  steps = checks.integer("steps_per_round", steps_per_round, minimum=1)
  q = _rate(batch_size, min_client_size)
  gaussian = dp_accounting.GaussianDpEvent(sigma)
  events = [dp_accounting.PoissonSampledDpEvent(q, gaussian)]
  if steps > 1:
    events.append(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, gaussian), steps - 1)
    )
  return dp_accounting.ComposedDpEvent(events)


def _new_accountant(orders: Sequence[float] | None = None):
  from dp_accounting import rdp  # pylint: disable=g-import-not-at-top

  if orders is None:
    return rdp.RdpAccountant()
  orders = [float(o) for o in orders]
  checks.require(
    bool(orders) and all(math.isfinite(o) and o > 1.0 for o in orders),
    "orders",
    orders,
    "a non-empty sequence of finite Renyi orders > 1",
  )
  return rdp.RdpAccountant(orders)


def epsilon(
  events_or_event,
  *,
  delta: float,
  orders: Sequence[float] | None = None,
  adjacency: str = REPLACE_ONE,
) -> float:
  """``epsilon`` (nats) of an event, or of several events composed.

  Args:
    events_or_event: a ``dp_accounting.DpEvent`` or an iterable of them; all
      are composed in one accountant (not a sum of epsilons). Every Gaussian
      in them must have a noise multiplier >= :data:`MIN_NOISE_MULTIPLIER`.
    delta: target ``delta``, in ``(0, 1)``.
    orders: Renyi orders (each > 1), only with ``adjacency="add_remove"``;
      ``None`` uses ``dp_accounting``'s default orders.
    adjacency: ``"replace_one"`` (default; PLD, ``PLDAccountant`` on a grid of
      :data:`PLD_DISCRETIZATION`) or ``"add_remove"`` (RDP, ``RdpAccountant``).

  Returns:
    The smallest ``epsilon`` such that the composition is
    ``(epsilon, delta)``-DP; ``0.0`` for an empty iterable.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top
  from dp_accounting.pld import pld_privacy_accountant  # pylint: disable=g-import-not-at-top

  delta = checks.probability("delta", delta)
  adjacency = _check_adjacency(adjacency)
  if isinstance(events_or_event, dp_accounting.DpEvent):
    events = [events_or_event]
  elif isinstance(events_or_event, Iterable):
    events = list(events_or_event)
  else:
    raise ConfigError(
      "events_or_event", events_or_event, "a dp_accounting.DpEvent or an iterable of them"
    )
  for event in events:
    checks.require(
      isinstance(event, dp_accounting.DpEvent),
      "events_or_event[]",
      event,
      "a dp_accounting.DpEvent",
    )
    _check_events_accountable(event)
  if adjacency == REPLACE_ONE:
    checks.require(
      orders is None,
      "orders",
      orders,
      "None with adjacency='replace_one' (PLD accounting has no Renyi orders)",
    )
    accountant = pld_privacy_accountant.PLDAccountant(
      dp_accounting.NeighboringRelation.REPLACE_ONE,
      value_discretization_interval=PLD_DISCRETIZATION,
    )
  else:
    accountant = _new_accountant(orders)
  for event in events:
    accountant.compose(event)
  return float(accountant.get_epsilon(delta)) if events else 0.0


def epsilon_after_rounds(
  *,
  rounds: int,
  noise_multiplier: float,
  batch_size: int,
  min_client_size: int,
  steps_per_round: int,
  delta: float,
  adjacency: str = REPLACE_ONE,
) -> float:
  """``epsilon`` (nats) after ``rounds`` identical rounds of one client.

  Args:
    rounds: ``M``, communication rounds, >= 0 (0 gives ``0.0``).
    noise_multiplier: ``sigma``, >= :data:`MIN_NOISE_MULTIPLIER`.
    batch_size: ``B``, records per step.
    min_client_size: ``N_k``, records.
    steps_per_round: ``T``, noisy steps per round, >= 1.
    delta: in ``(0, 1 / N_k)``.
    adjacency: ``"replace_one"`` (default; PLD, the guarantee when ``N_k`` is
      public) or ``"add_remove"`` (RDP, the paper's figure).
  """
  rounds = checks.integer("rounds", rounds, minimum=0)
  adjacency = _check_adjacency(adjacency)
  round_event(  # checks sigma, B, N_k and T
    noise_multiplier=noise_multiplier,
    batch_size=batch_size,
    min_client_size=min_client_size,
    steps_per_round=steps_per_round,
  )
  delta = check_record_delta(delta, int(min_client_size))
  if rounds == 0:
    return 0.0
  q = _rate(batch_size, min_client_size)
  sigma = float(noise_multiplier)
  figure = _replace_one if adjacency == REPLACE_ONE else _add_remove
  return figure(q, rounds * int(steps_per_round), sigma, delta)


# Stands in for an epsilon of 0 in the calibration's log(epsilon / target).
_TINY_EPSILON = 1e-300


def calibrate_noise_multiplier(
  target_epsilon: float,
  *,
  delta: float,
  rounds: int,
  batch_size: int,
  min_client_size: int,
  steps_per_round: int,
  tol: float = 1e-3,
  max_noise_multiplier: float = _MAX_SIGMA,
  adjacency: str = REPLACE_ONE,
) -> float:
  """Smallest noise multiplier ``sigma`` whose epsilon is <= the target.

  The one calibration of the project (:meth:`DpMechanism.calibrated` calls it
  for ``dp.target_epsilon`` and ``dp.match_epsilon_of``, for every DP method):
  Brent's method, then bisection, on ``sigma`` over
  :func:`epsilon_after_rounds` of ``adjacency``, the figure the ledgers
  compose (``epsilon`` decreases as ``sigma`` grows). The returned ``sigma``
  always satisfies ``epsilon(sigma) <= target_epsilon`` and is within a
  relative ``tol`` of the smallest such ``sigma`` >= :data:`MIN_NOISE_MULTIPLIER`
  (so a larger target never gets a ``sigma`` more than ``tol`` larger).

  Args:
    target_epsilon: target ``epsilon`` in nats, finite and > 0.
    delta: in ``(0, 1 / N_k)``.
    rounds: ``M``, >= 1.
    batch_size: ``B``, records per step.
    min_client_size: ``N_k``, records.
    steps_per_round: ``T``, >= 1.
    tol: relative width of the final bracket on ``sigma``, in ``(0, 1)``.
    max_noise_multiplier: the largest ``sigma`` the caller accepts, in
      ``(MIN_NOISE_MULTIPLIER, 1e6]``; a target that needs more is refused.
    adjacency: the figure calibrated, ``"replace_one"`` (default) or
      ``"add_remove"``.

  Returns:
    ``sigma`` (dimensionless), never below :data:`MIN_NOISE_MULTIPLIER`: a
    target that the floor already meets gets the floor.

  Raises:
    ConfigError: on invalid arguments, or if the target needs
      ``sigma > max_noise_multiplier`` (the message names ``target_epsilon``,
      its value and the bound).
  """
  target = checks.finite("target_epsilon", target_epsilon, above=0.0)
  tol = checks.finite("tol", tol)
  checks.require(0.0 < tol < 1.0, "tol", tol, "a number in (0, 1)")
  rounds = checks.integer("rounds", rounds, minimum=1)
  max_sigma = checks.finite("max_noise_multiplier", max_noise_multiplier)
  floor = MIN_NOISE_MULTIPLIER
  checks.require(
    floor < max_sigma <= _MAX_SIGMA,
    "max_noise_multiplier",
    max_noise_multiplier,
    f"a number in ({floor:g}, {_MAX_SIGMA:g}]",
  )
  adjacency = _check_adjacency(adjacency)
  # Validate the rest once, with a placeholder sigma.
  round_event(
    noise_multiplier=1.0,
    batch_size=batch_size,
    min_client_size=min_client_size,
    steps_per_round=steps_per_round,
  )
  delta = check_record_delta(delta, int(min_client_size))

  def eps(sigma: float) -> float:
    return epsilon_after_rounds(
      rounds=rounds,
      noise_multiplier=sigma,
      batch_size=batch_size,
      min_client_size=min_client_size,
      steps_per_round=steps_per_round,
      delta=delta,
      adjacency=adjacency,
    )

  # Bracket: eps(lo) > target >= eps(hi).
  hi = min(1.0, max_sigma)
  while (eps_hi := eps(hi)) > target:
    if hi >= max_sigma:
      raise ConfigError(
        "target_epsilon",
        target,
        f"a target met by some noise_multiplier <= {max_sigma:g}",
        message=f"target_epsilon={target!r} is unreachable: even noise_multiplier="
        f"{max_sigma:g} gives epsilon {eps_hi:.4g} after {rounds} rounds "
        f"(allowed: a target met by some noise_multiplier <= {max_sigma:g})",
      )
    hi = min(2.0 * hi, max_sigma)
  lo = hi / 2.0
  while lo >= floor and eps(lo) <= target:
    hi = lo
    lo /= 2.0
  if lo < floor:  # the bracket reaches below the floor: the floor, or a root above it
    if hi == floor or eps(floor) <= target:
      return floor
    lo = floor
  # Brent's method on log(epsilon / target) (fewer accountant calls than bisection) to a
  # relative tol / 4; upper = root * (1 + tol / 2) is then above the true root (epsilon <=
  # target) and upper / (1 + tol) below it (so within tol of the smallest sigma).
  from scipy import optimize  # pylint: disable=g-import-not-at-top

  # The accountant reports epsilon 0 where its bound vanishes; the log stays finite there.
  root = optimize.brentq(
    lambda s: math.log(max(eps(s), _TINY_EPSILON) / target), lo, hi, xtol=1e-12, rtol=0.25 * tol
  )
  upper = min(hi, root * (1.0 + 0.5 * tol))
  if eps(upper) <= target:  # guaranteed by Brent's bound; checked, as it is cheap
    return upper
  while hi - lo > tol * hi:
    mid = 0.5 * (lo + hi)
    if eps(mid) <= target:
      hi = mid
    else:
      lo = mid
  return hi


# --------------------------------------------------------------------------
# The mechanism a DP method declares.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DpMechanism:
  """The privacy mechanism of one DP method: the single owner of its ``q``, ``sigma``, ``T``.

  Per round, every client ``k`` runs ``steps_per_round`` noisy steps, each a
  Poisson sample at rate ``q_k = batch_size / N_k`` (:meth:`sampling_rate`)
  with Gaussian noise of multiplier ``noise_multiplier``. A DP method
  declares it once (FedLAP-DP ``T = R_i * max_outer * batch_loop``, PSG
  ``T = networks * outer_loop * batch_loop``, DP-FedAvg / DP-FedProx their
  scheduled local steps), and :meth:`from_config` reads it from the method's
  library config; calibration (:meth:`calibrated`), the ledgers
  (:meth:`ledger`, :meth:`client_ledgers`) and the planned epsilon
  (:meth:`epsilon_after`) are derived from this value only.

  A mechanism may declare any ``noise_multiplier > 0`` (a test of the
  mechanism's arithmetic may use a negligible one); everything that accounts
  for it refuses one below :data:`MIN_NOISE_MULTIPLIER`, and a ``delta`` of
  at least ``1 / N_k`` for the client accounted for, before computing anything.

  Attributes:
    noise_multiplier: ``sigma`` (noise std / clip norm), > 0.
    batch_size: ``B``, expected records per Poisson batch, >= 1.
    steps_per_round: ``T``, the data-independent worst-case number of noisy
      accesses to a client's records per round, >= 1.
    delta: ``delta`` of the reported ``(epsilon, delta)``, in ``(0, 1)``.
    adjacency: the neighbouring relation of the headline epsilon:
      ``"replace_one"`` (default; the guarantee that holds with public
      ``N_k`` and class sets) or ``"add_remove"`` (the paper's notion). Both
      figures are always computed (module docstring).
  """

  noise_multiplier: float
  batch_size: int
  steps_per_round: int
  delta: float
  adjacency: str = REPLACE_ONE

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    set_("noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
    set_("batch_size", checks.integer("batch_size", self.batch_size, minimum=1))
    set_("steps_per_round", checks.integer("steps_per_round", self.steps_per_round, minimum=1))
    set_("delta", checks.probability("delta", self.delta))
    set_("adjacency", _check_adjacency(self.adjacency))

  @classmethod
  def from_config(cls, config, *, adjacency: str = REPLACE_ONE) -> "DpMechanism | None":
    """The mechanism a method's library config declares; ``None`` without DP.

    ``config`` is any library config of a method:
    :class:`~fedlap_jax.methods.fedlap.config.FedLAPConfig`
    or its :class:`~fedlap_jax.methods.fedlap.config.ClientConfig` (FedLAP-DP),
    :class:`~fedlap_jax.baselines.BaselineConfig` (DP-FedAvg, DP-FedProx),
    :class:`~fedlap_jax.methods.condensation.one_shot.OneShotConfig` or its
    :class:`~fedlap_jax.methods.condensation.one_shot.CondensationConfig` (PSG),
    :class:`~fedlap_jax.methods.feddm.distribution_matching.FedDMConfig` (no DP). Each says through
    its ``dp_accesses()`` which ``DPConfig`` noises how many accesses (``T``) to
    batches of which expected size (``B``) per round, or ``None``; this
    classmethod is the only place those become a mechanism.

    Raises:
      ConfigError: ``config`` declares no privacy accesses (not a library config).
    """
    declare = getattr(type(config), "dp_accesses", None)
    checks.require(
      callable(declare),
      "config",
      type(config).__name__,
      "a library config of a method (FedLAPConfig, ClientConfig, BaselineConfig, "
      "OneShotConfig, CondensationConfig, FedDMConfig): one with dp_accesses()",
    )
    accesses = config.dp_accesses()
    if accesses is None:
      return None
    dp, batch_size, steps_per_round = accesses
    return cls(
      noise_multiplier=dp.noise_multiplier,
      batch_size=batch_size,
      steps_per_round=steps_per_round,
      delta=dp.delta,
      adjacency=adjacency,
    )

  def sampling_rate(self, client_size: int) -> float:
    """``q_k = B / N_k`` of a client with ``client_size`` records (``N_k >= B``)."""
    batch, n = _check_sizes(self.batch_size, client_size, "client_size")
    return batch / n

  def with_noise_multiplier(self, noise_multiplier: float) -> "DpMechanism":
    return dataclasses.replace(self, noise_multiplier=noise_multiplier)

  def check_delta(self, client_size: int, *, field: str = "dp.delta") -> None:
    """Refuses ``delta >= 1 / N_k``: such a ``delta`` allows releasing a whole record.

    Raises:
      ConfigError: naming ``field``, the value and the bound.
    """
    n = checks.integer("client_size", client_size, minimum=1)
    check_record_delta(self.delta, n, field)

  def check_accountable(self, client_size: int) -> None:
    """What every accounting of a client of ``client_size`` records checks first.

    Raises:
      ConfigError: ``noise_multiplier`` below :data:`MIN_NOISE_MULTIPLIER`,
        ``client_size`` below ``batch_size``, or ``delta >= 1 / N_k``.
    """
    check_accountable_sigma(self.noise_multiplier)
    _, n = _check_sizes(self.batch_size, client_size, "client_size")
    check_record_delta(self.delta, n)

  def ledger(self, client_size: int) -> "PrivacyLedger":
    """An empty ledger of a client with ``client_size`` records (or of the smallest client).

    Raises:
      ConfigError: as :meth:`check_accountable`.
    """
    return PrivacyLedger(self, client_size)

  def client_ledgers(self, client_sizes: Sequence[int]) -> "ClientLedgers":
    """Empty per-client ledgers (client sampling: each charged for its own rounds).

    Clients of equal ``N_k`` share one ledger object until one of them is
    charged (recording never mutates a shared ledger in place).

    Raises:
      ConfigError: as :meth:`check_accountable`, for any of the sizes.
    """
    shared: dict[int, PrivacyLedger] = {}
    ledgers = []
    for n in client_sizes:
      if n not in shared:
        shared[n] = self.ledger(n)
      ledgers.append(shared[n])
    return ClientLedgers(ledgers)

  def epsilon_after(self, rounds: int, client_size: int, *, adjacency: str | None = None) -> float:
    """Epsilon (nats) after ``rounds`` rounds of a client with ``client_size`` records.

    ``adjacency`` defaults to the mechanism's; the figure equals what a
    ledger of :meth:`ledger` shows after ``rounds`` rounds of ``T`` steps.
    """
    self.check_accountable(client_size)
    return epsilon_after_rounds(
      rounds=rounds,
      noise_multiplier=self.noise_multiplier,
      batch_size=self.batch_size,
      min_client_size=client_size,
      steps_per_round=self.steps_per_round,
      delta=self.delta,
      adjacency=self.adjacency if adjacency is None else adjacency,
    )

  def epsilon_bound(self, rounds: int) -> float:
    """An upper bound of the epsilon (nats) of any client after ``rounds`` rounds of ``T`` steps,
    whatever its ``N_k`` and of either neighbouring relation: every record in every step
    (``q = 1``), one record replaced moving the clipped sum by ``2 C``, i.e. the add/remove RDP
    figure at ``sigma / 2`` (RDP bounds the PLD figure from above). What a party that does not
    know ``N_k`` can still bound a client's report by.
    """
    steps = checks.integer("rounds", rounds, minimum=0) * self.steps_per_round
    return _add_remove(1.0, steps, self.noise_multiplier / 2, self.delta) if steps else 0.0

  def calibrated(
    self,
    target_epsilon: float,
    *,
    rounds: int,
    client_size: int,
    adjacency: str | None = None,
    tol: float = 1e-3,
    max_noise_multiplier: float = _MAX_SIGMA,
  ) -> "DpMechanism":
    """This mechanism with the smallest ``sigma`` whose epsilon is <= ``target_epsilon``.

    The epsilon is that of ``adjacency`` (default: the mechanism's) after
    ``rounds`` rounds for a client of ``client_size`` records
    (:func:`calibrate_noise_multiplier`, relative tolerance ``tol``).
    """
    sigma = calibrate_noise_multiplier(
      target_epsilon,
      delta=self.delta,
      rounds=rounds,
      batch_size=self.batch_size,
      min_client_size=client_size,
      steps_per_round=self.steps_per_round,
      tol=tol,
      max_noise_multiplier=max_noise_multiplier,
      adjacency=self.adjacency if adjacency is None else adjacency,
    )
    return self.with_noise_multiplier(sigma)


# --------------------------------------------------------------------------
# Ledger.
# --------------------------------------------------------------------------

# The mechanism's fields as a stored ledger names them (min_client_size: the client's N_k).
_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "min_client_size", "steps_per_round", "delta")
_DICT_FIELDS = _PRIVACY_FIELDS + ("rounds", "steps", "epsilons")
# Written by ledgers whose headline is replace-one; a dict without them is an add/remove ledger.
_REPLACE_ONE_FIELDS = ("adjacency", "epsilons_add_remove")
# Written by ledgers of earlier versions (always 1.0: no front end amplified by participation).
_LEGACY_FIELDS = ("participation",)


def _participants(participants: Iterable[int], limit: int | None = None) -> list[int]:
  """Distinct client indices (sorted), at least one, each in ``0..limit - 1`` when given."""
  ids = list(participants)
  allowed = "distinct client indices" + (f" in 0..{limit - 1}" if limit else " >= 0")
  ok = bool(ids) and all(checks.is_int(i) and i >= 0 for i in ids)
  ok = ok and len(set(ids)) == len(ids) and (limit is None or max(ids) < limit)
  checks.require(ok, "participants", ids, allowed + ", at least one")
  return sorted(int(i) for i in ids)


class PrivacyLedger:
  """Host-side record of the privacy spent by one client (or the worst client).

  It holds the :class:`DpMechanism` and the client's ``N_k`` (``client_size``)
  and the rounds recorded. Each recorded round of ``T`` steps is composed, and
  the ``epsilon`` after it is stored: ``epsilons`` holds the figure of the
  mechanism's ``adjacency`` (the headline), ``epsilons_add_remove`` the
  add/remove figure (RDP, the paper's notion) after every round, computed for
  every ledger (equal to ``epsilons`` when ``adjacency`` is ``"add_remove"``).
  A run keeps ``to_dict()`` with its checkpoints and restores it with
  :meth:`from_dict`, which recomputes every epsilon and refuses a ledger whose
  stored values do not match.

  Add/remove rounds add the cached RDP vector in the order ``RdpAccountant`` adds it, so
  they equal its numbers bit for bit.

  Construction: ``PrivacyLedger(mechanism, client_size)`` (what
  :meth:`DpMechanism.ledger` does), or with the stored dict's names as
  keywords, ``PrivacyLedger(noise_multiplier=..., batch_size=...,
  min_client_size=..., steps_per_round=..., delta=..., adjacency=...)``
  (``adjacency`` defaults to ``"replace_one"``), which builds the mechanism.
  Both take ``rounds`` / ``steps`` / ``epsilons`` / ``epsilons_add_remove``
  to restore recorded rounds: ``steps`` empty while ``rounds > 0`` means
  ``steps_per_round`` each; ``epsilons`` empty means recompute, else each is
  checked against the recomputation.

  Raises (on construction):
    ConfigError: an invalid field, ``noise_multiplier`` below
      :data:`MIN_NOISE_MULTIPLIER` or ``delta >= 1 / N_k``.
    ValueError: a stored epsilon differs from the recomputed one by more than
      1e-9 (an inconsistent or tampered ledger).
  """

  def __init__(
    self,
    mechanism: DpMechanism | None = None,
    client_size: int | None = None,
    *,
    rounds: int = 0,
    steps: Sequence[int] = (),
    epsilons: Sequence[float] = (),
    epsilons_add_remove: Sequence[float] = (),
    **fields: Any,
  ):
    size_name = "client_size" if mechanism is not None else "min_client_size"
    if mechanism is None:
      allowed = _PRIVACY_FIELDS + ("adjacency",)
      unknown = sorted(set(fields) - set(allowed))
      missing = [k for k in _PRIVACY_FIELDS if k not in fields]
      checks.require(
        not unknown and not missing and client_size is None,
        "PrivacyLedger",
        sorted(fields),
        f"a DpMechanism and a client_size, or the keywords {list(allowed)} "
        f"(missing={missing}, unknown={unknown})",
      )
      client_size = fields.pop("min_client_size")
      mechanism = DpMechanism(**fields)
    else:
      checks.require(
        isinstance(mechanism, DpMechanism) and not fields,
        "mechanism",
        mechanism,
        "a DpMechanism (with client_size; no other privacy keywords)",
      )
    self._mechanism = mechanism
    self._rdp: Any = None  # the incremental RDP sum of the recorded rounds
    _, self._client_size = _check_sizes(mechanism.batch_size, client_size, size_name)
    mechanism.check_accountable(self._client_size)  # before any accounting
    rounds = checks.integer("rounds", rounds, minimum=0)
    steps = list(steps)
    if not steps and rounds > 0:
      steps = [mechanism.steps_per_round] * rounds
    checks.require(
      len(steps) == rounds, "steps", steps, f"one entry per recorded round (rounds={rounds})"
    )
    self._steps = [checks.integer(f"steps[{i}]", s, minimum=1) for i, s in enumerate(steps)]
    # Empty epsilons (with rounds > 0) ask for a recomputation of both lists.
    stored = {
      "epsilons": list(epsilons),
      "epsilons_add_remove": list(epsilons_add_remove) if epsilons else [],
    }
    self._recompute()
    for name, values in stored.items():
      if not values and (rounds > 0 or name == "epsilons_add_remove"):
        continue
      checks.require(
        len(values) == rounds, name, values, f"one epsilon per recorded round (rounds={rounds})"
      )
      for i, (s, r) in enumerate(zip(values, getattr(self, "_" + name))):
        s_f = checks.finite(f"{name}[{i}]", s)
        if not math.isclose(s_f, r, rel_tol=_LEDGER_TOL, abs_tol=_LEDGER_TOL):
          # Not a bad input but a record that contradicts itself: a plain ValueError.
          raise ValueError(
            f"{name}[{i}]={s!r} does not match the recomputed epsilon {r!r} after "
            f"round {i + 1} (allowed: equal to within {_LEDGER_TOL:g}); the ledger is "
            "inconsistent or tampered"
          )

  # -- what it holds ---------------------------------------------------------

  @property
  def mechanism(self) -> DpMechanism:
    """The mechanism whose rounds this ledger composes."""
    return self._mechanism

  @property
  def client_size(self) -> int:
    """``N_k``, records of the client accounted for."""
    return self._client_size

  # The mechanism's fields, under the names of the stored dict.
  min_client_size = client_size
  noise_multiplier = property(lambda self: self._mechanism.noise_multiplier)
  batch_size = property(lambda self: self._mechanism.batch_size)
  steps_per_round = property(lambda self: self._mechanism.steps_per_round)
  delta = property(lambda self: self._mechanism.delta)
  adjacency = property(lambda self: self._mechanism.adjacency)

  @property
  def rounds(self) -> int:
    """Rounds recorded so far."""
    return len(self._steps)

  @property
  def steps(self) -> list[int]:
    """``T`` of each recorded round (a copy)."""
    return list(self._steps)

  @property
  def epsilons(self) -> list[float]:
    """``epsilon`` (nats, of :attr:`adjacency`) after each recorded round (a copy)."""
    return list(self._epsilons)

  @property
  def epsilons_add_remove(self) -> list[float]:
    """The add/remove ``epsilon`` after each recorded round (a copy)."""
    return list(self._epsilons_add_remove)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, PrivacyLedger):
      return NotImplemented
    return self._key() == other._key() and (self._epsilons, self._epsilons_add_remove) == (
      other._epsilons,
      other._epsilons_add_remove,
    )

  __hash__ = None  # type: ignore[assignment]  # mutable

  def __repr__(self) -> str:
    return (
      f"PrivacyLedger({self._mechanism!r}, client_size={self._client_size}, "
      f"steps={self._steps!r}, epsilon={self.epsilon!r})"
    )

  # -- internals -----------------------------------------------------------

  def _key(self) -> tuple:
    return (self._mechanism, self._client_size, tuple(self._steps))

  def _q(self) -> float:
    return self._mechanism.batch_size / self._client_size

  def _add_round(self, steps: int) -> None:
    """Composes one round into the RDP sum and appends both epsilons."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    q, sigma = self._q(), self.noise_multiplier
    if self._rdp is None:
      self._rdp = np.zeros(len(_orders()), dtype=np.float64)
    # RdpAccountant.compose(round_event(...)): += 1 * rdp(q), then += (T - 1) * rdp(q).
    self._rdp = self._rdp + 1 * _step_rdp(q, sigma)
    if steps > 1:
      self._rdp = self._rdp + (steps - 1) * _step_rdp(q, sigma)
    add_remove = _rdp_epsilon(self._rdp, self.delta)
    self._epsilons_add_remove.append(add_remove)
    if self.adjacency == ADD_REMOVE:
      self._epsilons.append(add_remove)
    else:
      total = sum(self._steps[: len(self._epsilons)]) + steps
      self._epsilons.append(_replace_one(q, total, sigma, self.delta))

  def _recompute(self) -> None:
    """Recomputes the RDP sum and every per-round epsilon from scratch."""
    self._rdp = None
    self._epsilons: list[float] = []
    self._epsilons_add_remove: list[float] = []
    for s in self._steps:
      self._add_round(s)

  def _round_steps(self, steps: int | None) -> int:
    if steps is None:
      return self.steps_per_round
    return checks.integer("steps", steps, minimum=1)

  # -- public API ----------------------------------------------------------

  def record_round(
    self, steps: int | None = None, *, participants: Iterable[int] | None = None
  ) -> float:
    """Composes one more round and returns :attr:`epsilon` (nats) so far.

    The same call as :meth:`ClientLedgers.record_round`.

    Args:
      steps: ``T`` of this round (noisy local steps), >= 1; defaults to
        ``steps_per_round``.
      participants: the clients that took part, or ``None``. This ledger is
        the bound of every client (its own, or the smallest client's when
        every client takes part in every round), so the round is charged
        whoever took part; given, the indices are only checked (distinct,
        >= 0, at least one).
    """
    steps = self._round_steps(steps)
    if participants is not None:
      _participants(participants)
    self._steps.append(steps)
    self._add_round(steps)
    return self._epsilons[-1]

  def epsilon_after(self, steps: int | None = None) -> float:
    """The :attr:`epsilon` one more round of ``steps`` would give; nothing is recorded."""
    return copy.deepcopy(self).record_round(steps)  # the copy keeps the composed RDP

  def epsilon_lower_bound_after(self, steps: int | None = None) -> float:
    """A cheap lower bound of :meth:`epsilon_after`; nothing is recorded.

    For a replace-one headline: the optimistic PLD of all the steps on a grid
    of :data:`LOWER_BOUND_DISCRETIZATION` nats (privacy losses rounded down,
    tails dropped: each term of the hockey-stick divergence can only shrink,
    so its epsilon is below the true one, which is below the pessimistic
    headline), a fraction of the headline's cost. For an add/remove headline,
    the RDP figure itself (cheap already). A budget this bound exceeds is
    exceeded by the round; one it does not may still be (compute
    :meth:`epsilon_after` then).
    """
    steps = self._round_steps(steps)
    if self.adjacency == ADD_REMOVE:
      return self.epsilon_after(steps)
    total = sum(self._steps) + steps
    return _replace_one_lower(self._q(), total, self.noise_multiplier, self.delta)

  @property
  def epsilon(self) -> float:
    """``epsilon`` (nats, of :attr:`adjacency`) after all recorded rounds; 0.0 before any."""
    return self._epsilons[-1] if self._epsilons else 0.0

  @property
  def epsilon_add_remove(self) -> float:
    """The add/remove-one ``epsilon`` (RDP; the paper's notion) after all recorded rounds."""
    return self._epsilons_add_remove[-1] if self._epsilons_add_remove else 0.0

  @property
  def epsilon_replace_one(self) -> float:
    """The replace-one ``epsilon`` (PLD) after all recorded rounds (computed if not kept)."""
    if self.adjacency == REPLACE_ONE:
      return self.epsilon
    return _replace_one(self._q(), sum(self._steps), self.noise_multiplier, self.delta)

  def with_adjacency(self, adjacency: str) -> "PrivacyLedger":
    """The same recorded rounds with ``adjacency`` as the headline (epsilons recomputed)."""
    mechanism = dataclasses.replace(self._mechanism, adjacency=_check_adjacency(adjacency))
    return PrivacyLedger(mechanism, self._client_size, rounds=self.rounds, steps=self._steps)

  def privacy_fields(self) -> dict:
    """The parameters that must not change when a run resumes (the stored dict's names).

    ``{noise_multiplier, batch_size, min_client_size, steps_per_round, delta,
    adjacency}``; ``PrivacyLedger(**privacy_fields())`` is an empty ledger of
    the same mechanism and client.
    """
    fields = {f: getattr(self, f) for f in _PRIVACY_FIELDS}
    fields["adjacency"] = self.adjacency
    return fields

  def to_dict(self) -> dict:
    """A JSON-serialisable record; :meth:`from_dict` restores it exactly.

    An add/remove ledger writes the mechanism's fields, ``rounds``, ``steps``
    and ``epsilons``; a replace-one ledger also ``adjacency`` and
    ``epsilons_add_remove`` (the format of every earlier version, less its
    ``participation``, which was always 1).
    """
    d: dict[str, Any] = {f: getattr(self, f) for f in _PRIVACY_FIELDS}
    if self.adjacency != ADD_REMOVE:
      d["adjacency"] = self.adjacency
    d["rounds"] = self.rounds
    d["steps"] = list(self._steps)
    d["epsilons"] = list(self._epsilons)
    if self.adjacency != ADD_REMOVE:
      d["epsilons_add_remove"] = list(self._epsilons_add_remove)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "PrivacyLedger":
    """Restores a ledger, recomputing every epsilon.

    A dict without ``adjacency`` is an add/remove ledger. Dicts of earlier
    versions carry ``participation``; it must be 1 (no front end ever
    amplified by participation; module docstring).

    Raises:
      ConfigError: if keys are missing or unknown, or a field is invalid.
      ValueError: a stored epsilon differs from the recomputed one by more
        than 1e-9 (a tampered or inconsistent ledger is refused).
    """
    checks.require(isinstance(d, dict), "d", d, "a dict from to_dict()")
    optional = _REPLACE_ONE_FIELDS if d.get("adjacency", ADD_REMOVE) != ADD_REMOVE else ()
    allowed = _DICT_FIELDS + optional
    missing = [k for k in allowed if k not in d]
    unknown = [k for k in d if k not in allowed + _LEGACY_FIELDS]
    if missing or unknown:
      raise ConfigError(
        "ledger",
        sorted(d),
        f"the keys {list(allowed)}",
        message=(
          f"ledger dict keys are invalid (missing={missing}, unknown={unknown}): allowed keys "
          f"are {list(allowed)}"
        ),
      )
    if "participation" in d:
      checks.require(
        checks.is_real(d["participation"]) and d["participation"] == 1,
        "participation",
        d["participation"],
        "1 (a ledger amplified by secret participation cannot be composed here)",
      )
    for key in ("steps", "epsilons") + optional[1:]:
      checks.require(isinstance(d[key], (list, tuple)), key, d[key], "a list")
    checks.require(
      len(d["epsilons"]) == len(d["steps"]) == d["rounds"],
      "rounds",
      d["rounds"],
      f"len(steps)={len(d['steps'])} and len(epsilons)={len(d['epsilons'])}, equal",
    )
    return cls(
      **{f: d[f] for f in _PRIVACY_FIELDS},
      adjacency=d.get("adjacency", ADD_REMOVE),
      rounds=d["rounds"],
      steps=list(d["steps"]),
      epsilons=list(d["epsilons"]),
      epsilons_add_remove=list(d.get("epsilons_add_remove", [])),
    )


# --------------------------------------------------------------------------
# One ledger per client (client sampling).
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ClientLedgers:
  """Record-level accounting per client when clients are sampled per round.

  Client ``k`` keeps its own :class:`PrivacyLedger` of the run's one
  mechanism with ``N_k`` records (its own Poisson rate ``q_k = B / N_k``, as
  the Flower app's per-client ledgers, :mod:`fedlap_flower.ledger`), charged
  only for the rounds it took part in: a client never sampled has spent
  nothing (epsilon 0). The guarantee a run reports is the maximum over
  clients (:attr:`epsilon`); with every client in every round that is the
  client with the smallest ``N_k``, i.e. exactly the single
  :class:`PrivacyLedger` of ``q = B / min_k N_k``. Participation is not
  amplified: which clients take part is public, a deterministic function of
  the seed and the round. Built by :meth:`DpMechanism.client_ledgers`.

  A round composes once per distinct ledger among its participants (same ``N_k`` and step
  counts), not once per participant.

  Attributes:
    ledgers: ``K`` ledgers, one per client, all of one mechanism.
    participants: the clients of every recorded round (``rounds`` lists).
  """

  ledgers: list[PrivacyLedger]
  participants: list[list[int]] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    checks.require(
      bool(self.ledgers) and all(isinstance(l, PrivacyLedger) for l in self.ledgers),
      "ledgers",
      self.ledgers,
      "a non-empty list of PrivacyLedger (one per client)",
    )
    mechanisms = {l.mechanism for l in self.ledgers}
    checks.require(
      len(mechanisms) == 1,
      "ledgers",
      sorted(map(repr, mechanisms)),
      "ledgers of one DpMechanism (the run's)",
    )
    k = len(self.ledgers)
    counts = [0] * k
    clean = []
    for r, ids in enumerate(self.participants):
      try:
        ids = _participants(ids, k)
      except ConfigError as e:
        raise ConfigError(f"participants[{r}]", e.value, e.allowed) from None
      for i in ids:
        counts[i] += 1
      clean.append(ids)
    self.participants = clean
    for i, (ledger, n) in enumerate(zip(self.ledgers, counts)):
      if ledger.rounds != n:
        raise ValueError(
          f"client {i}'s ledger records {ledger.rounds} rounds but it took "
          f"part in {n}; the ledgers are inconsistent or tampered"
        )

  @property
  def mechanism(self) -> DpMechanism:
    """The mechanism every client's ledger composes."""
    return self.ledgers[0].mechanism

  @property
  def rounds(self) -> int:
    """Server rounds recorded."""
    return len(self.participants)

  @property
  def epsilons(self) -> list[float]:
    """``epsilon`` (nats, the ledgers' adjacency) of each client (0.0 if never sampled)."""
    return [l.epsilon for l in self.ledgers]

  @property
  def epsilons_add_remove(self) -> list[float]:
    """The add/remove ``epsilon`` of each client (the paper's notion)."""
    return [l.epsilon_add_remove for l in self.ledgers]

  @property
  def epsilon(self) -> float:
    """The run's guarantee: the maximum ``epsilon`` over clients."""
    return max(self.epsilons)

  @property
  def epsilon_add_remove(self) -> float:
    """The maximum add/remove ``epsilon`` over clients."""
    return max(self.epsilons_add_remove)

  def record_round(
    self, steps: int | None = None, *, participants: Iterable[int] | None = None
  ) -> list[float]:
    """Charges one round of ``steps`` noisy steps to each participant.

    The same call as :meth:`PrivacyLedger.record_round`; returns what it
    recorded, :attr:`epsilons` after the round (each client's epsilon; the run's
    guarantee :attr:`epsilon` is their maximum).

    Args:
      steps: ``T`` of this round; defaults to the mechanism's ``steps_per_round``.
      participants: the indices of the clients that took part (distinct, at
        least one); ``None``: every client.
    """
    k = len(self.ledgers)
    ids = list(range(k)) if participants is None else _participants(participants, k)
    steps = self.mechanism.steps_per_round if steps is None else steps
    steps = checks.integer("steps", steps, minimum=1)
    done: dict[tuple, PrivacyLedger] = {}
    new = list(self.ledgers)
    for i in ids:
      key = self.ledgers[i]._key()  # pylint: disable=protected-access
      if key not in done:
        ledger = copy.deepcopy(self.ledgers[i])  # keeps the composed RDP sum
        ledger.record_round(steps)
        done[key] = ledger
      new[i] = done[key]
    self.ledgers = new
    self.participants.append(ids)
    return self.epsilons

  def summary(self) -> dict:
    """``{"min", "median", "max"}`` of the clients' epsilons (nats)."""
    eps = sorted(self.epsilons)
    n = len(eps)
    median = eps[n // 2] if n % 2 else 0.5 * (eps[n // 2 - 1] + eps[n // 2])
    return {"min": eps[0], "median": median, "max": eps[-1]}

  def privacy_fields(self) -> list[dict]:
    """Each client's :meth:`PrivacyLedger.privacy_fields` (what must not change on resume)."""
    return [l.privacy_fields() for l in self.ledgers]

  def to_dict(self) -> dict:
    """JSON-ready: ``{"clients": [PrivacyLedger.to_dict(), ...], "participants": [...]}``."""
    return {
      "clients": [l.to_dict() for l in self.ledgers],
      "participants": [list(p) for p in self.participants],
    }

  @classmethod
  def from_dict(cls, d: dict) -> "ClientLedgers":
    """Restores the ledgers, recomputing every epsilon (equal ledgers once).

    Raises:
      ConfigError: a malformed dict, a client ledger that fails
        :meth:`PrivacyLedger.from_dict`, ledgers of different mechanisms, or
        round counts that do not match ``participants``.
    """
    if not isinstance(d, dict) or set(d) != {"clients", "participants"}:
      keys = sorted(d) if isinstance(d, dict) else d
      raise ConfigError(
        "client ledgers",
        keys,
        "a dict with the keys 'clients' and 'participants' of to_dict()",
        message=f"client ledgers dict is "
        f"invalid ({keys!r}); allowed: a dict with the keys 'clients' and "
        "'participants' of to_dict()",
      )
    checks.require(
      isinstance(d["clients"], list) and isinstance(d["participants"], list),
      "client ledgers",
      sorted(d),
      "'clients' and 'participants' lists",
    )
    memo: dict[str, PrivacyLedger] = {}
    ledgers = []
    for c in d["clients"]:
      text = repr(sorted(c.items())) if isinstance(c, dict) else repr(c)
      if text not in memo:
        memo[text] = PrivacyLedger.from_dict(c)
      ledgers.append(memo[text])
    return cls(ledgers, [list(p) for p in d["participants"]])
