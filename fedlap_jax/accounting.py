"""Host-side privacy accounting for FedLAP-DP: the mechanism, its epsilon, the ledgers.

Every DP method of the project (FedLAP-DP, DP-FedAvg, DP-FedProx, PSG) runs the
same mechanism on each client ``k`` in each round: ``T`` noisy steps
(``T = steps_per_round``), each a Poisson sample of the client's ``N_k``
records at rate ``q_k = B / N_k`` whose per-record gradients are clipped and
summed with Gaussian noise of multiplier ``sigma`` (noise std / clip norm).
:class:`DpMechanism` is that declaration, the one value a method hands to
everything that accounts for it (calibration, the experiment's ledgers, a
Flower client's ledger); :class:`PrivacyLedger` composes the rounds of one
client and :class:`ClientLedgers` those of many.

Neighbouring datasets (``adjacency``)
-------------------------------------
The guarantee is record-level and per client. Two notions are computed:

* ``"replace_one"``: the client's data set with one record replaced by
  another, the size ``N_k`` fixed. This is the guarantee that holds when
  ``N_k`` and the client's classes are public, as they are here: the
  experiments release ``client_sizes`` and ``client_classes``, and a client's
  epsilon determines its ``N_k`` (the rate ``q_k = B / N_k`` enters it). Its
  epsilon is computed with ``dp_accounting``'s privacy loss distributions
  (PLD, ``NeighboringRelation.REPLACE_ONE``; RDP does not support it for the
  Poisson-sampled Gaussian), discretised at :data:`PLD_DISCRETIZATION` nats
  with pessimistic rounding, so the figure is an upper bound.
* ``"add_remove"``: one record added or removed (the paper's notion, Renyi DP
  of the Poisson-subsampled Gaussian in one ``RdpAccountant``). It describes
  neighbours of different sizes, which public ``N_k`` rule out; it is kept
  under this explicit name for comparison with the paper's numbers.

For the same ``q``, ``sigma`` and ``T`` the replace-one epsilon is larger
(``q = 46/274``, ``sigma = 2.92``, ``T = 100``, ``delta = 1e-5``: add/remove
2.78 by RDP, 2.54 by PLD; replace-one 5.12 by PLD). :class:`DpMechanism`
reports replace-one by default; the lower-level functions take ``adjacency``
explicitly and default to ``"add_remove"``.

Participation
-------------
The paper amplifies the first step of each round by the probability ``c``
that a client takes part (``q1 = c * B / min_k N_k``). That is unsound when
who takes part is public (here: every client in every round, or clients
drawn from the public participation seed and released per round), and the
project never uses it: :class:`DpMechanism` has no participation term and
every front end accounts with ``c = 1``. The ``participation`` arguments
below exist for a setting where participation is secret and random.

Units used throughout:

* ``batch_size`` ``B``: records per local step (expected batch size under
  Poisson sampling);
* ``min_client_size`` / ``client_size`` ``N_k``: records of the client
  accounted for (the smallest client gives the largest rate);
* ``steps_per_round`` ``T``: noisy local steps per client per round;
* ``rounds`` ``M``: communication rounds;
* ``noise_multiplier`` ``sigma``: dimensionless (noise std / clip norm);
* ``delta``: probability, in ``(0, 1)``; ``epsilon``: nats (natural log).

Cost: the RDP vector of one Poisson-sampled Gaussian step and the PLD of one
step are cached per ``(q, sigma)``, and a replace-one epsilon per
``(q, sigma, steps, delta)`` (``functools.lru_cache``; pure functions of their
arguments), so a ledger round costs one PLD self-composition and ledgers that
share a rate share it.

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
  "DpMechanism",
  "sampling_rates",
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

# Relative / absolute tolerance used when a stored ledger's epsilons are
# checked against the recomputed ones.
_LEDGER_TOL = 1e-9

# Search range of calibrate_noise_multiplier (dimensionless sigma). Below
# _MIN_SIGMA_PLD a replace-one PLD spans so many privacy-loss values that one
# evaluation takes minutes; the epsilon there is in the thousands.
_MIN_SIGMA = 1e-3
_MIN_SIGMA_PLD = 0.1
_MAX_SIGMA = 1e6

# Width (nats) of the privacy-loss grid of the replace-one PLD. dp_accounting
# rounds pessimistically, so a coarser grid only raises epsilon: at q = 46/274,
# sigma = 2.92, T = 100 this grid gives 5.11629 against 5.11625 at 1e-4, 15x
# faster.
PLD_DISCRETIZATION = 1e-3


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
  checks.require(
    checks.is_real(value) and value > 0,
    name,
    value,
    "a finite number > 0 (sigma = 0 adds no noise, so the differential-privacy "
    "guarantee would be void)",
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


def _check_adjacency(value: Any) -> str:
  checks.one_of("adjacency", value, ADJACENCIES)
  return value


# --------------------------------------------------------------------------
# The two epsilons of n1 steps at rate q1 and n2 steps at rate q2 (cached).
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


@functools.lru_cache(maxsize=512)
def _step_pld(q: float, sigma: float):
  """PLD (replace-one) of one Poisson-sampled Gaussian step."""
  import dp_accounting  # pylint: disable=g-import-not-at-top
  from dp_accounting.pld import privacy_loss_distribution  # pylint: disable=g-import-not-at-top

  return privacy_loss_distribution.from_gaussian_mechanism(
    standard_deviation=sigma,
    sampling_prob=q,
    value_discretization_interval=PLD_DISCRETIZATION,
    neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
  )


@functools.lru_cache(maxsize=65536)
def _replace_one(q1: float, n1: int, q2: float, n2: int, sigma: float, delta: float) -> float:
  """Replace-one epsilon of ``n1`` steps at rate ``q1`` and ``n2`` at ``q2``."""
  if q1 == q2:
    q1, n1, n2 = q2, 0, n1 + n2
  pld = None
  for q, n in ((q1, n1), (q2, n2)):
    if n:
      part = _step_pld(q, sigma)
      part = part.self_compose(n) if n > 1 else part
      pld = part if pld is None else pld.compose(part)
  return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


def _replace_one_figure(
  *, q1: float, q2: float, sigma: float, rounds: int, steps: int, delta: float
) -> float:
  """Replace-one epsilon of ``rounds`` rounds of ``steps`` steps in all (the first of each at
  ``q1``, the others at ``q2``)."""
  if not rounds:
    return 0.0
  if q1 == q2:  # one cache entry per (rate, steps), however the steps fall into rounds
    return _replace_one(q2, 0, q2, steps, sigma, delta)
  return _replace_one(q1, rounds, q2, steps - rounds, sigma, delta)


# --------------------------------------------------------------------------
# Events and epsilon.
# --------------------------------------------------------------------------


def sampling_rates(
  *, batch_size: int, min_client_size: int, participation: float = 1.0
) -> tuple[float, float]:
  """Poisson sampling rates ``(q1, q2)`` of one round.

  Args:
    batch_size: ``B``, records per local step (expected Poisson batch), >= 1.
    min_client_size: ``N_k``, records of the client accounted for,
      >= ``batch_size``.
    participation: ``c``, probability that a client takes part in a round,
      in ``(0, 1]``; 1 unless participation is secret (module docstring).

  Returns:
    ``(q1, q2)`` with ``q1 = c * B / N_k`` (rate of the first step of a
    round) and ``q2 = B / N_k`` (rate of each of the other steps); both are
    probabilities in ``(0, 1]``.

  Raises:
    ConfigError: naming the field, its value and the allowed range.
  """
  batch_size, min_client_size = _check_sizes(batch_size, min_client_size)
  participation = checks.probability("participation", participation, one_allowed=True)
  q2 = batch_size / min_client_size
  q1 = participation * q2
  return q1, q2


def round_event(
  *,
  noise_multiplier: float,
  batch_size: int,
  min_client_size: int,
  steps_per_round: int,
  participation: float = 1.0,
) -> "dp_accounting.DpEvent":
  """The ``dp_accounting`` event of one round for one client.

  ``ComposedDpEvent([PoissonSampled(q1, Gaussian(sigma)),
  SelfComposed(PoissonSampled(q2, Gaussian(sigma)), T - 1)])``; the second
  part is left out when ``T == 1``.

  Args:
    noise_multiplier: ``sigma`` (noise std / clip norm), > 0.
    batch_size: ``B``, records per step, >= 1.
    min_client_size: ``N_k``, records, >= ``batch_size``.
    steps_per_round: ``T``, noisy local steps in the round, >= 1.
    participation: ``c``, client participation probability in ``(0, 1]``.

  Returns:
    A ``dp_accounting.DpEvent``.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  sigma = _check_noise_multiplier(noise_multiplier)
  steps = checks.integer("steps_per_round", steps_per_round, minimum=1)
  q1, q2 = sampling_rates(
    batch_size=batch_size, min_client_size=min_client_size, participation=participation
  )
  gaussian = dp_accounting.GaussianDpEvent(sigma)
  events = [dp_accounting.PoissonSampledDpEvent(q1, gaussian)]
  if steps > 1:
    events.append(
      dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q2, gaussian), steps - 1
      )
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
  adjacency: str = ADD_REMOVE,
) -> float:
  """``epsilon`` (nats) of an event, or of several events composed.

  Args:
    events_or_event: a ``dp_accounting.DpEvent`` or an iterable of them; all
      are composed in one accountant (not a sum of epsilons).
    delta: target ``delta``, in ``(0, 1)``.
    orders: Renyi orders (each > 1) for ``"add_remove"``; ``None`` uses
      ``dp_accounting``'s default orders.
    adjacency: ``"add_remove"`` (RDP, ``RdpAccountant``) or ``"replace_one"``
      (PLD, ``PLDAccountant`` on a grid of :data:`PLD_DISCRETIZATION`).

  Returns:
    The smallest ``epsilon`` such that the composition is
    ``(epsilon, delta)``-DP; ``0.0`` for an empty iterable.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top
  from dp_accounting.pld import pld_privacy_accountant  # pylint: disable=g-import-not-at-top

  delta = checks.probability("delta", delta)
  adjacency = _check_adjacency(adjacency)
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
  participation: float = 1.0,
  adjacency: str = ADD_REMOVE,
) -> float:
  """``epsilon`` (nats) after ``rounds`` identical rounds.

  Args:
    rounds: ``M``, communication rounds, >= 0 (0 gives ``0.0``).
    noise_multiplier: ``sigma``, > 0.
    batch_size: ``B``, records per step.
    min_client_size: ``N_k``, records.
    steps_per_round: ``T``, noisy steps per round, >= 1.
    delta: in ``(0, 1)``.
    participation: ``c`` in ``(0, 1]``.
    adjacency: ``"add_remove"`` (RDP, the paper's figure) or ``"replace_one"``
      (PLD; the guarantee when ``N_k`` is public).
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  rounds = checks.integer("rounds", rounds, minimum=0)
  delta = checks.probability("delta", delta)
  adjacency = _check_adjacency(adjacency)
  event = round_event(
    noise_multiplier=noise_multiplier,
    batch_size=batch_size,
    min_client_size=min_client_size,
    steps_per_round=steps_per_round,
    participation=participation,
  )
  if rounds == 0:
    return 0.0
  q1, q2 = sampling_rates(
    batch_size=batch_size, min_client_size=min_client_size, participation=participation
  )
  sigma = float(noise_multiplier)
  if adjacency == REPLACE_ONE:
    return _replace_one_figure(
      q1=q1, q2=q2, sigma=sigma, rounds=rounds, steps=rounds * int(steps_per_round), delta=delta
    )
  if q1 == q2:  # every step alike: the same RDP sum, computed once (half the time)
    event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q2, dp_accounting.GaussianDpEvent(sigma)), steps_per_round
    )
  return epsilon(dp_accounting.SelfComposedDpEvent(event, rounds), delta=delta)


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
  participation: float = 1.0,
  tol: float = 1e-3,
  max_noise_multiplier: float = _MAX_SIGMA,
  adjacency: str = ADD_REMOVE,
) -> float:
  """Smallest noise multiplier ``sigma`` whose epsilon is <= the target.

  The one calibration of the project (:meth:`DpMechanism.calibrated` calls it
  for ``dp.target_epsilon`` and ``dp.match_epsilon_of``, for every DP method):
  Brent's method, then bisection, on ``sigma`` over
  :func:`epsilon_after_rounds` of ``adjacency``, the figure the ledgers
  compose (``epsilon`` decreases as ``sigma`` grows). The returned ``sigma``
  always satisfies ``epsilon(sigma) <= target_epsilon`` and is within a
  relative ``tol`` of the smallest such ``sigma`` (so a larger target never
  gets a ``sigma`` more than ``tol`` larger).

  Args:
    target_epsilon: target ``epsilon`` in nats, finite and > 0.
    delta: in ``(0, 1)``.
    rounds: ``M``, >= 1.
    batch_size: ``B``, records per step.
    min_client_size: ``N_k``, records.
    steps_per_round: ``T``, >= 1.
    participation: ``c`` in ``(0, 1]``.
    tol: relative width of the final bracket on ``sigma``, in ``(0, 1)``.
    max_noise_multiplier: the largest ``sigma`` the caller accepts, in
      ``(1e-3, 1e6]``; a target that needs more is refused.
    adjacency: the figure calibrated, ``"add_remove"`` or ``"replace_one"``.

  Returns:
    ``sigma`` (dimensionless). The search halves ``sigma`` from 1 while the
    target is met and stops below ``1e-3`` (``0.1`` for ``"replace_one"``,
    whose PLD grows too large below it), returning the last ``sigma`` that
    met it.

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
  checks.require(
    _MIN_SIGMA < max_sigma <= _MAX_SIGMA,
    "max_noise_multiplier",
    max_noise_multiplier,
    f"a number in ({_MIN_SIGMA:g}, {_MAX_SIGMA:g}]",
  )
  adjacency = _check_adjacency(adjacency)
  floor = _MIN_SIGMA_PLD if adjacency == REPLACE_ONE else _MIN_SIGMA
  # Validate the rest once, with a placeholder sigma.
  round_event(
    noise_multiplier=1.0,
    batch_size=batch_size,
    min_client_size=min_client_size,
    steps_per_round=steps_per_round,
    participation=participation,
  )
  delta = checks.probability("delta", delta)

  def eps(sigma: float) -> float:
    return epsilon_after_rounds(
      rounds=rounds,
      noise_multiplier=sigma,
      batch_size=batch_size,
      min_client_size=min_client_size,
      steps_per_round=steps_per_round,
      delta=delta,
      participation=participation,
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
  if lo < floor:  # the search stops here (an epsilon far above any useful target)
    return hi
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
# Ledger.
# --------------------------------------------------------------------------

_PRIVACY_FIELDS = (
  "noise_multiplier",
  "batch_size",
  "min_client_size",
  "steps_per_round",
  "delta",
  "participation",
)
_DICT_FIELDS = _PRIVACY_FIELDS + ("rounds", "steps", "epsilons")
# Written by ledgers whose headline is replace-one; a dict without them is an add/remove ledger.
_REPLACE_ONE_FIELDS = ("adjacency", "epsilons_add_remove")


@dataclasses.dataclass
class PrivacyLedger:
  """Host-side record of the privacy spent by one client (or the worst client).

  Each recorded round of ``T`` steps is composed, and the ``epsilon`` after
  it is stored: ``epsilons`` holds the figure of ``adjacency`` (the
  headline), ``epsilons_add_remove`` the add/remove figure (RDP, the paper's
  notion) after every round, computed for every ledger (equal to
  ``epsilons`` when ``adjacency`` is ``"add_remove"``). A run keeps
  ``to_dict()`` with its checkpoints and restores it with ``from_dict``,
  which recomputes every epsilon and refuses a ledger whose stored values do
  not match.

  Add/remove rounds add one cached RDP vector per rate in the order
  ``RdpAccountant`` adds them, so they equal its numbers bit for bit;
  replace-one rounds cost one PLD composition of all steps so far, shared by
  every ledger with the same rate and step count.

  Attributes:
    noise_multiplier: ``sigma`` (noise std / clip norm), > 0.
    batch_size: ``B``, records per local step, >= 1.
    min_client_size: ``N_k``, records of the client, >= ``batch_size``.
    steps_per_round: default ``T`` (noisy steps per round), >= 1.
    delta: target ``delta`` in ``(0, 1)``.
    participation: ``c``, client participation probability in ``(0, 1]``
      (1 unless participation is secret; module docstring).
    adjacency: ``"add_remove"`` or ``"replace_one"``: the neighbouring
      relation of :attr:`epsilon` and ``epsilons``.
    rounds: rounds recorded so far, >= 0.
    steps: ``T`` of each recorded round (``len(steps) == rounds``); if empty
      while ``rounds > 0`` it is filled with ``steps_per_round``.
    epsilons: ``epsilon`` (nats, of ``adjacency``) after each recorded round;
      if empty while ``rounds > 0`` it is computed, else checked against the
      recomputation.
    epsilons_add_remove: the add/remove epsilons after each round; computed
      (always, when ``epsilons`` is empty), or checked like ``epsilons``.
  """

  noise_multiplier: float
  batch_size: int
  min_client_size: int
  steps_per_round: int
  delta: float
  participation: float = 1.0
  rounds: int = 0
  steps: list[int] = dataclasses.field(default_factory=list)
  epsilons: list[float] = dataclasses.field(default_factory=list)
  adjacency: str = ADD_REMOVE
  epsilons_add_remove: list[float] = dataclasses.field(default_factory=list)
  # Incremental RDP sum (not part of the record).
  _rdp: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
  _cache_key: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __post_init__(self):
    self.noise_multiplier = _check_noise_multiplier(self.noise_multiplier)
    self.batch_size, self.min_client_size = _check_sizes(self.batch_size, self.min_client_size)
    self.steps_per_round = checks.integer("steps_per_round", self.steps_per_round, minimum=1)
    self.delta = checks.probability("delta", self.delta)
    self.participation = checks.probability("participation", self.participation, one_allowed=True)
    self.adjacency = _check_adjacency(self.adjacency)
    self.rounds = checks.integer("rounds", self.rounds, minimum=0)

    steps = list(self.steps)
    if not steps and self.rounds > 0:
      steps = [self.steps_per_round] * self.rounds
    checks.require(
      len(steps) == self.rounds,
      "steps",
      steps,
      f"one entry per recorded round (rounds={self.rounds})",
    )
    self.steps = [checks.integer(f"steps[{i}]", s, minimum=1) for i, s in enumerate(steps)]

    # Empty epsilons (with rounds > 0) ask for a recomputation of both lists.
    stored = {
      "epsilons": list(self.epsilons),
      "epsilons_add_remove": list(self.epsilons_add_remove) if self.epsilons else [],
    }
    self._recompute()
    for name, values in stored.items():
      if not values and (self.rounds > 0 or name == "epsilons_add_remove"):
        continue
      checks.require(
        len(values) == self.rounds,
        name,
        values,
        f"one epsilon per recorded round (rounds={self.rounds})",
      )
      for i, (s, r) in enumerate(zip(values, getattr(self, name))):
        s_f = checks.finite(f"{name}[{i}]", s)
        if not math.isclose(s_f, r, rel_tol=_LEDGER_TOL, abs_tol=_LEDGER_TOL):
          # Not a bad input but a record that contradicts itself: a plain ValueError.
          raise ValueError(
            f"{name}[{i}]={s!r} does not match the recomputed epsilon {r!r} after "
            f"round {i + 1} (allowed: equal to within {_LEDGER_TOL:g}); the ledger is "
            "inconsistent or tampered"
          )

  # -- internals -----------------------------------------------------------

  def _key(self) -> tuple:
    return tuple(getattr(self, f) for f in _PRIVACY_FIELDS) + (self.adjacency, tuple(self.steps))

  def _rates(self) -> tuple[float, float]:
    return sampling_rates(
      batch_size=self.batch_size,
      min_client_size=self.min_client_size,
      participation=self.participation,
    )

  def _add_round(self, steps: int) -> None:
    """Composes one round into the RDP sum and appends both epsilons."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    q1, q2 = self._rates()
    sigma = self.noise_multiplier
    if self._rdp is None:
      self._rdp = np.zeros(len(_orders()), dtype=np.float64)
    # RdpAccountant.compose(round_event(...)): += 1 * rdp(q1), then += (T - 1) * rdp(q2).
    self._rdp = self._rdp + 1 * _step_rdp(q1, sigma)
    if steps > 1:
      self._rdp = self._rdp + (steps - 1) * _step_rdp(q2, sigma)
    add_remove = _rdp_epsilon(self._rdp, self.delta)
    self.epsilons_add_remove.append(add_remove)
    if self.adjacency == ADD_REMOVE:
      self.epsilons.append(add_remove)
    else:
      rounds = len(self.epsilons) + 1
      total = sum(self.steps[: rounds - 1]) + steps
      self.epsilons.append(
        _replace_one_figure(q1=q1, q2=q2, sigma=sigma, rounds=rounds, steps=total, delta=self.delta)
      )

  def _recompute(self) -> None:
    """Recomputes the RDP sum and every per-round epsilon from scratch."""
    self._rdp = None
    self.epsilons, self.epsilons_add_remove = [], []
    for s in self.steps:
      self._add_round(s)
    self._cache_key = self._key()

  # -- public API ----------------------------------------------------------

  def record_round(self, steps: int | None = None) -> float:
    """Composes one more round and returns :attr:`epsilon` (nats) so far.

    Args:
      steps: ``T`` of this round (noisy local steps), >= 1; defaults to
        ``steps_per_round``.
    """
    steps = self.steps_per_round if steps is None else checks.integer("steps", steps, minimum=1)
    if self._cache_key != self._key():
      self._recompute()  # fields were changed by hand: rebuild from scratch
    self.steps.append(steps)
    self._add_round(steps)
    self.rounds += 1
    self._cache_key = self._key()
    return self.epsilons[-1]

  @property
  def epsilon(self) -> float:
    """``epsilon`` (nats, of :attr:`adjacency`) after all recorded rounds; 0.0 before any."""
    return self.epsilons[-1] if self.epsilons else 0.0

  @property
  def epsilon_add_remove(self) -> float:
    """The add/remove-one ``epsilon`` (RDP; the paper's notion) after all recorded rounds."""
    return self.epsilons_add_remove[-1] if self.epsilons_add_remove else 0.0

  @property
  def epsilon_replace_one(self) -> float:
    """The replace-one ``epsilon`` (PLD) after all recorded rounds (computed if not kept)."""
    if self.adjacency == REPLACE_ONE:
      return self.epsilon
    q1, q2 = self._rates()
    return _replace_one_figure(
      q1=q1,
      q2=q2,
      sigma=self.noise_multiplier,
      rounds=self.rounds,
      steps=sum(self.steps),
      delta=self.delta,
    )

  def with_adjacency(self, adjacency: str) -> "PrivacyLedger":
    """The same recorded rounds with ``adjacency`` as the headline (epsilons recomputed)."""
    fields = {**self.privacy_fields(), "adjacency": _check_adjacency(adjacency)}
    return PrivacyLedger(**fields, rounds=self.rounds, steps=list(self.steps))

  def privacy_fields(self) -> dict:
    """The parameters that must not change when a run resumes.

    ``adjacency`` is listed when it is not ``"add_remove"``.
    """
    fields = {f: getattr(self, f) for f in _PRIVACY_FIELDS}
    if self.adjacency != ADD_REMOVE:
      fields["adjacency"] = self.adjacency
    return fields

  def to_dict(self) -> dict:
    """A JSON-serialisable record; ``from_dict`` restores it exactly.

    An add/remove ledger writes ``_DICT_FIELDS``; a replace-one ledger also
    ``adjacency`` and ``epsilons_add_remove``.
    """
    d = self.privacy_fields()
    d["rounds"] = self.rounds
    d["steps"] = list(self.steps)
    d["epsilons"] = list(self.epsilons)
    if self.adjacency != ADD_REMOVE:
      d["epsilons_add_remove"] = list(self.epsilons_add_remove)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "PrivacyLedger":
    """Restores a ledger, recomputing every epsilon.

    A dict without ``adjacency`` is an add/remove ledger.

    Raises:
      ConfigError: if keys are missing or unknown, or a field is invalid.
      ValueError: a stored epsilon differs from the recomputed one by more
        than 1e-9 (a tampered or inconsistent ledger is refused).
    """
    checks.require(isinstance(d, dict), "d", d, "a dict from to_dict()")
    optional = _REPLACE_ONE_FIELDS if d.get("adjacency", ADD_REMOVE) != ADD_REMOVE else ()
    allowed = _DICT_FIELDS + optional
    missing = [k for k in allowed if k not in d]
    unknown = [k for k in d if k not in allowed]
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
    for key in ("steps", "epsilons") + optional[1:]:
      checks.require(isinstance(d[key], (list, tuple)), key, d[key], "a list")
    checks.require(
      len(d["epsilons"]) == len(d["steps"]) == d["rounds"],
      "rounds",
      d["rounds"],
      f"len(steps)={len(d['steps'])} and len(epsilons)={len(d['epsilons'])}, equal",
    )
    kwargs: dict[str, Any] = {
      k: (list(d[k]) if k in ("steps", "epsilons", "epsilons_add_remove") else d[k])
      for k in allowed
    }
    return cls(**kwargs)


# --------------------------------------------------------------------------
# One ledger per client (client sampling).
# --------------------------------------------------------------------------


def _ledger_key(ledger: PrivacyLedger) -> tuple:
  return ledger._key()  # pylint: disable=protected-access


@dataclasses.dataclass
class ClientLedgers:
  """Record-level accounting per client when clients are sampled per round.

  Client ``k`` keeps its own :class:`PrivacyLedger` with
  ``min_client_size = N_k`` (its own Poisson rate ``q_k = B / N_k``, as the
  Flower app's per-client ledgers, :mod:`fedlap_flower.ledger`), charged only
  for the rounds it took part in: a client never sampled has spent nothing
  (epsilon 0). The guarantee a run reports is the maximum over clients
  (:attr:`epsilon`); with every client in every round that is the client with
  the smallest ``N_k``, i.e. exactly the single :class:`PrivacyLedger` with
  ``q = B / min_k N_k``. Participation is not amplified (``participation``
  stays 1: which clients take part is public, a deterministic function of the
  seed and the round).

  A round composes once per distinct ledger among its participants (same
  ``N_k`` and the same rounds' step counts), not per participant, and the
  per-step RDP and PLD it needs are cached per rate, so the participants of a
  round that share ``(q_k, steps)`` share one composition.

  Attributes:
    ledgers: ``K`` ledgers, one per client.
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
    k = len(self.ledgers)
    counts = [0] * k
    clean = []
    for r, ids in enumerate(self.participants):
      ids = [checks.integer(f"participants[{r}][]", i, minimum=0) for i in ids]
      checks.require(
        ids and all(i < k for i in ids) and len(set(ids)) == len(ids),
        f"participants[{r}]",
        ids,
        f"distinct client indices in 0..{k - 1}, at least one",
      )
      for i in ids:
        counts[i] += 1
      clean.append(sorted(ids))
    self.participants = clean
    for i, (ledger, n) in enumerate(zip(self.ledgers, counts)):
      if ledger.rounds != n:
        raise ValueError(
          f"client {i}'s ledger records {ledger.rounds} rounds but it took "
          f"part in {n}; the ledgers are inconsistent or tampered"
        )

  @classmethod
  def create(
    cls,
    *,
    client_sizes: Sequence[int],
    noise_multiplier: float,
    batch_size: int,
    steps_per_round: int,
    delta: float,
    adjacency: str = ADD_REMOVE,
  ) -> "ClientLedgers":
    """Empty ledgers for clients of ``client_sizes`` records (``N_k``)."""
    shared: dict[int, PrivacyLedger] = {}
    ledgers = []
    for n in client_sizes:
      if n not in shared:
        shared[n] = PrivacyLedger(
          noise_multiplier=noise_multiplier,
          batch_size=batch_size,
          min_client_size=n,
          steps_per_round=steps_per_round,
          delta=delta,
          adjacency=adjacency,
        )
      ledgers.append(shared[n])  # shared until recorded: record_round never mutates in place
    return cls(ledgers)

  @property
  def rounds(self) -> int:
    """Server rounds recorded."""
    return len(self.participants)

  def epsilons(self) -> list[float]:
    """``epsilon`` (nats, the ledgers' adjacency) of each client (0.0 if never sampled)."""
    return [l.epsilon for l in self.ledgers]

  def epsilons_add_remove(self) -> list[float]:
    """The add/remove ``epsilon`` of each client (the paper's notion)."""
    return [l.epsilon_add_remove for l in self.ledgers]

  @property
  def epsilon(self) -> float:
    """The run's guarantee: the maximum ``epsilon`` over clients."""
    return max(self.epsilons())

  @property
  def epsilon_add_remove(self) -> float:
    """The maximum add/remove ``epsilon`` over clients."""
    return max(self.epsilons_add_remove())

  def record_round(self, participants: Iterable[int], steps: int | None = None) -> float:
    """Charges one round of ``steps`` noisy steps to each participant; returns :attr:`epsilon`.

    Args:
      participants: the indices of the clients that took part (distinct).
      steps: ``T`` of this round; defaults to each ledger's ``steps_per_round``.
    """
    ids = sorted(int(i) for i in participants)
    k = len(self.ledgers)
    checks.require(
      bool(ids) and len(set(ids)) == len(ids) and 0 <= ids[0] <= ids[-1] < k,
      "participants",
      ids,
      f"distinct client indices in 0..{k - 1}, at least one",
    )
    done: dict[tuple, PrivacyLedger] = {}
    new = list(self.ledgers)
    for i in ids:
      key = _ledger_key(self.ledgers[i])
      if key not in done:
        ledger = _copy_ledger(self.ledgers[i])
        ledger.record_round(steps)
        done[key] = ledger
      new[i] = done[key]
    self.ledgers = new
    self.participants.append(ids)
    return self.epsilon

  def summary(self) -> dict:
    """``{"min", "median", "max"}`` of the clients' epsilons (nats)."""
    eps = sorted(self.epsilons())
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
        :meth:`PrivacyLedger.from_dict`, or round counts that do not match
        ``participants``.
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


def _copy_ledger(ledger: PrivacyLedger) -> PrivacyLedger:
  """A copy that keeps the composed RDP sum (so recording one more round is incremental)."""
  return copy.deepcopy(ledger)


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
  scheduled local steps; :attr:`fedlap_jax.algorithm.FederatedAlgorithm.dp`),
  and calibration (:meth:`calibrated`), the ledgers (:meth:`ledger`,
  :meth:`client_ledgers`) and the planned epsilon (:meth:`epsilon_after`) are
  derived from this value only.

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

  def sampling_rate(self, client_size: int) -> float:
    """``q_k = B / N_k`` of a client with ``client_size`` records (``N_k >= B``)."""
    batch, n = _check_sizes(self.batch_size, client_size, "client_size")
    return batch / n

  def with_noise_multiplier(self, noise_multiplier: float) -> "DpMechanism":
    return dataclasses.replace(self, noise_multiplier=noise_multiplier)

  def ledger(self, client_size: int) -> PrivacyLedger:
    """An empty ledger of a client with ``client_size`` records (or of the smallest client)."""
    return PrivacyLedger(
      noise_multiplier=self.noise_multiplier,
      batch_size=self.batch_size,
      min_client_size=client_size,
      steps_per_round=self.steps_per_round,
      delta=self.delta,
      adjacency=self.adjacency,
    )

  def client_ledgers(self, client_sizes: Sequence[int]) -> ClientLedgers:
    """Empty per-client ledgers (client sampling: each charged for its own rounds)."""
    return ClientLedgers.create(
      client_sizes=client_sizes,
      noise_multiplier=self.noise_multiplier,
      batch_size=self.batch_size,
      steps_per_round=self.steps_per_round,
      delta=self.delta,
      adjacency=self.adjacency,
    )

  def epsilon_after(self, rounds: int, client_size: int, *, adjacency: str | None = None) -> float:
    """Epsilon (nats) after ``rounds`` rounds of a client with ``client_size`` records.

    ``adjacency`` defaults to the mechanism's; the figure equals what a
    ledger of :meth:`ledger` shows after ``rounds`` rounds of ``T`` steps.
    """
    return epsilon_after_rounds(
      rounds=rounds,
      noise_multiplier=self.noise_multiplier,
      batch_size=self.batch_size,
      min_client_size=client_size,
      steps_per_round=self.steps_per_round,
      delta=self.delta,
      adjacency=self.adjacency if adjacency is None else adjacency,
    )

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

  def check_delta(self, client_size: int, *, field: str = "dp.delta") -> None:
    """Refuses ``delta >= 1 / N_k``: such a ``delta`` allows releasing a whole record.

    Raises:
      ConfigError: naming ``field``, the value and the bound.
    """
    n = checks.integer("client_size", client_size, minimum=1)
    checks.require(
      self.delta < 1.0 / n,
      field,
      self.delta,
      f"a delta < 1 / N_k = 1/{n} = {1.0 / n:.3g} (N_k: the records of the smallest client)",
    )
