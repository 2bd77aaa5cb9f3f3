"""Host-side Renyi-DP accounting for FedLAP-DP.

FedLAP-DP's privacy theorem bounds the Renyi DP of the Poisson-subsampled
Gaussian mechanism.  In each communication round a client runs ``T`` noisy
steps (``T = steps_per_round``) over its local data:

* the first step is sampled at rate ``q1 = c * B / min_k N_k`` (``c`` is the
  probability that a client takes part in the round, 1 by default), because
  the client's participation itself is random;
* the remaining ``T - 1`` steps are sampled at rate ``q2 = B / min_k N_k``;

every step adds Gaussian noise with noise multiplier ``sigma`` (noise standard
deviation divided by the clipping norm).  The rounds are composed in RDP (all
of them in one ``dp_accounting.rdp.RdpAccountant``) and the result is converted
to an ``(epsilon, delta)`` guarantee.  The guarantee is record-level and
per-client: ``min_k N_k`` is the size of the smallest client dataset, which
gives the largest sampling rate and hence the worst case over clients.

Units used throughout:

* ``batch_size`` ``B``: records per local step (expected batch size under
  Poisson sampling);
* ``min_client_size`` ``min_k N_k``: records in the smallest client dataset;
* ``steps_per_round`` ``T``: noisy local steps per client per round;
* ``rounds`` ``M``: communication rounds;
* ``noise_multiplier`` ``sigma``: dimensionless (noise std / clip norm);
* ``delta``: probability, in ``(0, 1)``; ``epsilon``: nats (natural log).

This module is pure Python on the host: it needs neither JAX nor NumPy, and
``dp_accounting`` is imported only inside the functions that use it, so
``import fedlap_jax.accounting`` works where ``dp_accounting`` is missing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
  import dp_accounting

__all__ = [
    "sampling_rates",
    "round_event",
    "epsilon",
    "epsilon_after_rounds",
    "calibrate_noise_multiplier",
    "PrivacyLedger",
    "ClientLedgers",
]

# Relative / absolute tolerance used when a stored ledger's epsilons are
# checked against the recomputed ones.
_LEDGER_TOL = 1e-9

# Search range of calibrate_noise_multiplier (dimensionless sigma).
_MIN_SIGMA = 1e-3
_MAX_SIGMA = 1e6


# --------------------------------------------------------------------------
# Validation helpers: every error names the field, the value and what is
# allowed.
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


def _check_int(name: str, value: Any, *, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(
        f"{name}={value!r} is invalid: must be an integer >= {minimum}")
  value = int(value)
  if value < minimum:
    raise ValueError(
        f"{name}={value!r} is invalid: must be an integer >= {minimum}")
  return value


def _check_real(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name}={value!r} is invalid: must be a real number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name}={value!r} is invalid: must be finite")
  return value


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier"
                            ) -> float:
  allowed = "must be a finite number > 0"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name}={value!r} is invalid: {allowed}")
  value = float(value)
  if value == 0.0:
    raise ValueError(
        f"{name}={value!r} is invalid: {allowed}; sigma = 0 adds no noise, "
        "so the differential-privacy guarantee is void")
  if not math.isfinite(value) or value < 0.0:
    raise ValueError(f"{name}={value!r} is invalid: {allowed}")
  return value


def _check_delta(value: Any) -> float:
  allowed = "must be a probability in the open interval (0, 1)"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"delta={value!r} is invalid: {allowed}")
  value = float(value)
  if not 0.0 < value < 1.0:
    raise ValueError(f"delta={value!r} is invalid: {allowed}")
  return value


def _check_participation(value: Any) -> float:
  allowed = "must be a probability in (0, 1]"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"participation={value!r} is invalid: {allowed}")
  value = float(value)
  if not 0.0 < value <= 1.0:
    raise ValueError(f"participation={value!r} is invalid: {allowed}")
  return value


def _check_sizes(batch_size: Any, min_client_size: Any) -> tuple[int, int]:
  batch_size = _check_int("batch_size", batch_size, minimum=1)
  if isinstance(min_client_size, bool) or not isinstance(
      min_client_size, numbers.Integral) or int(min_client_size) < batch_size:
    raise ValueError(
        f"min_client_size={min_client_size!r} is invalid: must be an integer "
        f">= batch_size={batch_size} (records in the smallest client dataset; "
        "the sampling rate batch_size / min_client_size must be <= 1)")
  return batch_size, int(min_client_size)


# --------------------------------------------------------------------------
# Events and epsilon.
# --------------------------------------------------------------------------


def sampling_rates(*, batch_size: int, min_client_size: int,
                   participation: float = 1.0) -> tuple[float, float]:
  """Poisson sampling rates ``(q1, q2)`` of one FedLAP-DP round.

  Args:
    batch_size: ``B``, records per local step (expected Poisson batch), >= 1.
    min_client_size: ``min_k N_k``, records in the smallest client dataset,
      >= ``batch_size``.
    participation: ``c``, probability that a client takes part in a round,
      in ``(0, 1]``.

  Returns:
    ``(q1, q2)`` with ``q1 = c * B / min_k N_k`` (rate of the first step of a
    round) and ``q2 = B / min_k N_k`` (rate of each of the other steps); both
    are probabilities in ``(0, 1]``.

  Raises:
    ValueError: naming the field, its value and the allowed range.
  """
  batch_size, min_client_size = _check_sizes(batch_size, min_client_size)
  participation = _check_participation(participation)
  q2 = batch_size / min_client_size
  q1 = participation * q2
  return q1, q2


def round_event(*, noise_multiplier: float, batch_size: int,
                min_client_size: int, steps_per_round: int,
                participation: float = 1.0) -> "dp_accounting.DpEvent":
  """The ``dp_accounting`` event of one FedLAP-DP round for one client.

  ``ComposedDpEvent([PoissonSampled(q1, Gaussian(sigma)),
  SelfComposed(PoissonSampled(q2, Gaussian(sigma)), T - 1)])``; the second
  part is left out when ``T == 1``.

  Args:
    noise_multiplier: ``sigma`` (noise std / clip norm), > 0.
    batch_size: ``B``, records per step, >= 1.
    min_client_size: ``min_k N_k``, records, >= ``batch_size``.
    steps_per_round: ``T``, noisy local steps in the round, >= 1.
    participation: ``c``, client participation probability in ``(0, 1]``.

  Returns:
    A ``dp_accounting.DpEvent``.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  sigma = _check_noise_multiplier(noise_multiplier)
  steps = _check_int("steps_per_round", steps_per_round, minimum=1)
  q1, q2 = sampling_rates(batch_size=batch_size,
                          min_client_size=min_client_size,
                          participation=participation)
  gaussian = dp_accounting.GaussianDpEvent(sigma)
  events = [dp_accounting.PoissonSampledDpEvent(q1, gaussian)]
  if steps > 1:
    events.append(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q2, gaussian), steps - 1))
  return dp_accounting.ComposedDpEvent(events)


def _new_accountant(orders: Sequence[float] | None = None):
  from dp_accounting import rdp  # pylint: disable=g-import-not-at-top
  if orders is None:
    return rdp.RdpAccountant()
  orders = [float(o) for o in orders]
  if not orders or any(not math.isfinite(o) or o <= 1.0 for o in orders):
    raise ValueError(
        f"orders={orders!r} is invalid: must be a non-empty sequence of "
        "finite Renyi orders > 1")
  return rdp.RdpAccountant(orders)


def epsilon(events_or_event, *, delta: float,
            orders: Sequence[float] | None = None) -> float:
  """``epsilon`` (nats) of an event, or of several events composed in RDP.

  Args:
    events_or_event: a ``dp_accounting.DpEvent`` or an iterable of them; all
      are composed in one ``RdpAccountant`` (RDP composition, not a sum of
      epsilons).
    delta: target ``delta``, in ``(0, 1)``.
    orders: Renyi orders (each > 1); ``None`` uses ``dp_accounting``'s
      default orders.

  Returns:
    The smallest ``epsilon`` over the orders such that the composition is
    ``(epsilon, delta)``-DP; ``0.0`` for an empty iterable.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  delta = _check_delta(delta)
  accountant = _new_accountant(orders)
  if isinstance(events_or_event, dp_accounting.DpEvent):
    events = [events_or_event]
  elif isinstance(events_or_event, Iterable):
    events = list(events_or_event)
  else:
    raise ValueError(
        f"events_or_event={events_or_event!r} is invalid: must be a "
        "dp_accounting.DpEvent or an iterable of them")
  for event in events:
    if not isinstance(event, dp_accounting.DpEvent):
      raise ValueError(
          f"events_or_event contains {event!r}: every item must be a "
          "dp_accounting.DpEvent")
    accountant.compose(event)
  return float(accountant.get_epsilon(delta))


def epsilon_after_rounds(*, rounds: int, noise_multiplier: float,
                         batch_size: int, min_client_size: int,
                         steps_per_round: int, delta: float,
                         participation: float = 1.0) -> float:
  """``epsilon`` (nats) after ``rounds`` identical FedLAP-DP rounds.

  Args:
    rounds: ``M``, communication rounds, >= 0 (0 gives ``0.0``).
    noise_multiplier: ``sigma``, > 0.
    batch_size: ``B``, records per step.
    min_client_size: ``min_k N_k``, records.
    steps_per_round: ``T``, noisy steps per round, >= 1.
    delta: in ``(0, 1)``.
    participation: ``c`` in ``(0, 1]``.
  """
  import dp_accounting  # pylint: disable=g-import-not-at-top

  rounds = _check_int("rounds", rounds, minimum=0)
  delta = _check_delta(delta)
  event = round_event(noise_multiplier=noise_multiplier,
                      batch_size=batch_size, min_client_size=min_client_size,
                      steps_per_round=steps_per_round,
                      participation=participation)
  if rounds == 0:
    return 0.0
  q1, q2 = sampling_rates(batch_size=batch_size, min_client_size=min_client_size,
                          participation=participation)
  if q1 == q2:  # every step alike: the same RDP sum, computed once (half the time)
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q2, dp_accounting.GaussianDpEvent(float(noise_multiplier))), steps_per_round)
  return epsilon(dp_accounting.SelfComposedDpEvent(event, rounds),
                 delta=delta)


def calibrate_noise_multiplier(target_epsilon: float, *, delta: float,
                               rounds: int, batch_size: int,
                               min_client_size: int, steps_per_round: int,
                               participation: float = 1.0,
                               tol: float = 1e-3,
                               max_noise_multiplier: float = _MAX_SIGMA) -> float:
  """Smallest noise multiplier ``sigma`` whose epsilon is <= the target.

  The one calibration of the project (``experiments.run`` uses it for
  ``dp.target_epsilon`` and ``dp.match_epsilon_of``, for every DP method):
  bisection on ``sigma`` over :func:`epsilon_after_rounds`, the accountant the
  :class:`PrivacyLedger` composes (``epsilon`` decreases as ``sigma`` grows).
  The returned ``sigma`` always satisfies ``epsilon(sigma) <= target_epsilon``
  and is within a relative ``tol`` of the smallest such ``sigma`` (so a larger
  target never gets a ``sigma`` more than ``tol`` larger).

  Args:
    target_epsilon: target ``epsilon`` in nats, finite and > 0.
    delta: in ``(0, 1)``.
    rounds: ``M``, >= 1.
    batch_size: ``B``, records per step.
    min_client_size: ``min_k N_k``, records.
    steps_per_round: ``T``, >= 1.
    participation: ``c`` in ``(0, 1]``.
    tol: relative width of the final bracket on ``sigma``, in ``(0, 1)``.
    max_noise_multiplier: the largest ``sigma`` the caller accepts, in
      ``(1e-3, 1e6]``; a target that needs more is refused.

  Returns:
    ``sigma`` (dimensionless).  If even ``sigma = 1e-3`` meets the target,
    ``1e-3`` is returned.

  Raises:
    ValueError: on invalid arguments, or if the target needs
      ``sigma > max_noise_multiplier`` (the message names ``target_epsilon``,
      its value and the bound).
  """
  target = _check_real("target_epsilon", target_epsilon)
  if target <= 0.0:
    raise ValueError(
        f"target_epsilon={target_epsilon!r} is invalid: must be a finite "
        "number > 0")
  tol = _check_real("tol", tol)
  if not 0.0 < tol < 1.0:
    raise ValueError(f"tol={tol!r} is invalid: must be in (0, 1)")
  rounds = _check_int("rounds", rounds, minimum=1)
  max_sigma = _check_real("max_noise_multiplier", max_noise_multiplier)
  if not _MIN_SIGMA < max_sigma <= _MAX_SIGMA:
    raise ValueError(f"max_noise_multiplier={max_noise_multiplier!r} is invalid: must be in "
                     f"({_MIN_SIGMA:g}, {_MAX_SIGMA:g}]")
  # Validate the rest once, with a placeholder sigma.
  round_event(noise_multiplier=1.0, batch_size=batch_size,
              min_client_size=min_client_size,
              steps_per_round=steps_per_round, participation=participation)
  delta = _check_delta(delta)

  def eps(sigma: float) -> float:
    return epsilon_after_rounds(
        rounds=rounds, noise_multiplier=sigma, batch_size=batch_size,
        min_client_size=min_client_size, steps_per_round=steps_per_round,
        delta=delta, participation=participation)

  # Bracket: eps(lo) > target >= eps(hi).
  hi = min(1.0, max_sigma)
  while (eps_hi := eps(hi)) > target:
    if hi >= max_sigma:
      raise ValueError(
          f"target_epsilon={target!r} is unreachable: even noise_multiplier="
          f"{max_sigma:g} gives epsilon {eps_hi:.4g} after {rounds} rounds "
          f"(allowed: a target met by some noise_multiplier <= {max_sigma:g})")
    hi = min(2.0 * hi, max_sigma)
  lo = hi / 2.0
  while eps(lo) <= target:
    hi = lo
    lo /= 2.0
    if lo < _MIN_SIGMA:
      return hi
  # Brent's method on log(epsilon / target) (fewer accountant calls than bisection) to a
  # relative tol / 4; upper = root * (1 + tol / 2) is then above the true root (epsilon <=
  # target) and upper / (1 + tol) below it (so within tol of the smallest sigma).
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  root = optimize.brentq(lambda s: math.log(eps(s) / target), lo, hi,
                         xtol=1e-12, rtol=0.25 * tol)
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

_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "min_client_size",
                   "steps_per_round", "delta", "participation")
_DICT_FIELDS = _PRIVACY_FIELDS + ("rounds", "steps", "epsilons")


@dataclasses.dataclass
class PrivacyLedger:
  """Host-side record of the privacy spent by a FedLAP-DP run.

  Each recorded round is composed (in RDP, one ``RdpAccountant`` for all
  rounds) and the ``epsilon`` after it is stored; a run keeps ``to_dict()``
  with its checkpoints and restores it with ``from_dict``, which recomputes
  every epsilon and refuses a ledger whose stored values do not match.

  Attributes:
    noise_multiplier: ``sigma`` (noise std / clip norm), > 0.
    batch_size: ``B``, records per local step, >= 1.
    min_client_size: ``min_k N_k``, records, >= ``batch_size``.
    steps_per_round: default ``T`` (noisy steps per round), >= 1.
    delta: target ``delta`` in ``(0, 1)``.
    participation: ``c``, client participation probability in ``(0, 1]``.
    rounds: rounds recorded so far, >= 0.
    steps: ``T`` of each recorded round (``len(steps) == rounds``); if empty
      while ``rounds > 0`` it is filled with ``steps_per_round``.
    epsilons: ``epsilon`` (nats) after each recorded round; if empty while
      ``rounds > 0`` it is computed, else checked against the recomputation.
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
  # Incremental accountant cache (not part of the record).
  _accountant: Any = dataclasses.field(default=None, init=False, repr=False,
                                       compare=False)
  _cache_key: Any = dataclasses.field(default=None, init=False, repr=False,
                                      compare=False)

  def __post_init__(self):
    self.noise_multiplier = _check_noise_multiplier(self.noise_multiplier)
    self.batch_size, self.min_client_size = _check_sizes(
        self.batch_size, self.min_client_size)
    self.steps_per_round = _check_int("steps_per_round", self.steps_per_round,
                                      minimum=1)
    self.delta = _check_delta(self.delta)
    self.participation = _check_participation(self.participation)
    self.rounds = _check_int("rounds", self.rounds, minimum=0)

    steps = list(self.steps)
    if not steps and self.rounds > 0:
      steps = [self.steps_per_round] * self.rounds
    if len(steps) != self.rounds:
      raise ValueError(
          f"steps={steps!r} is invalid: must hold one entry per recorded "
          f"round (rounds={self.rounds})")
    self.steps = [_check_int(f"steps[{i}]", s, minimum=1)
                  for i, s in enumerate(steps)]

    stored = list(self.epsilons)
    recomputed = self._recompute()
    if stored or self.rounds == 0:
      if len(stored) != self.rounds:
        raise ValueError(
            f"epsilons={stored!r} is invalid: must hold one epsilon per "
            f"recorded round (rounds={self.rounds})")
      for i, (s, r) in enumerate(zip(stored, recomputed)):
        s_f = _check_real(f"epsilons[{i}]", s)
        if not math.isclose(s_f, r, rel_tol=_LEDGER_TOL, abs_tol=_LEDGER_TOL):
          raise ValueError(
              f"epsilons[{i}]={s!r} does not match the recomputed epsilon "
              f"{r!r} after round {i + 1} (allowed: equal to within "
              f"{_LEDGER_TOL:g}); the ledger is inconsistent or tampered")
    self.epsilons = recomputed

  # -- internals -----------------------------------------------------------

  def _key(self) -> tuple:
    return tuple(getattr(self, f) for f in _PRIVACY_FIELDS) + (
        tuple(self.steps),)

  def _event(self, steps: int):
    return round_event(noise_multiplier=self.noise_multiplier,
                       batch_size=self.batch_size,
                       min_client_size=self.min_client_size,
                       steps_per_round=steps,
                       participation=self.participation)

  def _recompute(self) -> list[float]:
    """Recomputes the accountant and every per-round epsilon from scratch."""
    accountant = _new_accountant()
    epsilons = []
    for s in self.steps:
      accountant.compose(self._event(s))
      epsilons.append(float(accountant.get_epsilon(self.delta)))
    self._accountant = accountant
    self._cache_key = self._key()
    return epsilons

  # -- public API ----------------------------------------------------------

  def record_round(self, steps: int | None = None) -> float:
    """Composes one more round and returns ``epsilon`` (nats) so far.

    Args:
      steps: ``T`` of this round (noisy local steps), >= 1; defaults to
        ``steps_per_round``.
    """
    steps = self.steps_per_round if steps is None else _check_int(
        "steps", steps, minimum=1)
    event = self._event(steps)
    if self._accountant is None or self._cache_key != self._key():
      self._recompute()  # fields were changed by hand: rebuild from scratch
    self._accountant.compose(event)
    eps = float(self._accountant.get_epsilon(self.delta))
    self.steps.append(steps)
    self.epsilons.append(eps)
    self.rounds += 1
    self._cache_key = self._key()
    return eps

  @property
  def epsilon(self) -> float:
    """``epsilon`` (nats) after all recorded rounds; 0.0 before any."""
    return self.epsilons[-1] if self.epsilons else 0.0

  def privacy_fields(self) -> dict:
    """The parameters that must not change when a run resumes."""
    return {f: getattr(self, f) for f in _PRIVACY_FIELDS}

  def to_dict(self) -> dict:
    """A JSON-serialisable record; ``from_dict`` restores it exactly."""
    d = self.privacy_fields()
    d["rounds"] = self.rounds
    d["steps"] = list(self.steps)
    d["epsilons"] = list(self.epsilons)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "PrivacyLedger":
    """Restores a ledger, recomputing every epsilon.

    Raises:
      ValueError: if keys are missing or unknown, a field is invalid, or a
        stored epsilon differs from the recomputed one by more than 1e-9
        (a tampered or inconsistent ledger is refused).
    """
    if not isinstance(d, dict):
      raise ValueError(f"d={d!r} is invalid: must be a dict from to_dict()")
    missing = [k for k in _DICT_FIELDS if k not in d]
    unknown = [k for k in d if k not in _DICT_FIELDS]
    if missing or unknown:
      raise ValueError(
          f"ledger dict keys are invalid (missing={missing}, "
          f"unknown={unknown}): allowed keys are {list(_DICT_FIELDS)}")
    for key in ("steps", "epsilons"):
      if not isinstance(d[key], (list, tuple)):
        raise ValueError(f"{key}={d[key]!r} is invalid: must be a list")
    if len(d["epsilons"]) != len(d["steps"]) or len(d["steps"]) != d["rounds"]:
      raise ValueError(
          f"rounds={d['rounds']!r} is invalid: must equal len(steps)="
          f"{len(d['steps'])} and len(epsilons)={len(d['epsilons'])}")
    return cls(**{k: (list(d[k]) if k in ("steps", "epsilons") else d[k])
                  for k in _DICT_FIELDS})


# --------------------------------------------------------------------------
# One ledger per client (client sampling).
# --------------------------------------------------------------------------


def _ledger_key(ledger: PrivacyLedger) -> tuple:
  return tuple(getattr(ledger, f) for f in _PRIVACY_FIELDS) + (tuple(ledger.steps),)


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

  Clients with equal ledgers (same ``N_k`` and the same rounds' step counts)
  share one composition: a round costs one RDP composition per distinct
  ledger among its participants, not per client.

  Attributes:
    ledgers: ``K`` ledgers, one per client.
    participants: the clients of every recorded round (``rounds`` lists).
  """

  ledgers: list[PrivacyLedger]
  participants: list[list[int]] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if not self.ledgers or not all(isinstance(l, PrivacyLedger) for l in self.ledgers):
      raise ValueError(f"ledgers={self.ledgers!r} is invalid: must be a non-empty list of "
                       "PrivacyLedger (one per client)")
    k = len(self.ledgers)
    counts = [0] * k
    clean = []
    for r, ids in enumerate(self.participants):
      ids = [_check_int(f"participants[{r}][]", i, minimum=0) for i in ids]
      if any(i >= k for i in ids) or len(set(ids)) != len(ids) or not ids:
        raise ValueError(f"participants[{r}]={ids!r} is invalid: must be distinct client "
                         f"indices in 0..{k - 1}, at least one")
      for i in ids:
        counts[i] += 1
      clean.append(sorted(ids))
    self.participants = clean
    for i, (ledger, n) in enumerate(zip(self.ledgers, counts)):
      if ledger.rounds != n:
        raise ValueError(f"client {i}'s ledger records {ledger.rounds} rounds but it took "
                         f"part in {n}; the ledgers are inconsistent or tampered")

  @classmethod
  def create(cls, *, client_sizes: Sequence[int], noise_multiplier: float, batch_size: int,
             steps_per_round: int, delta: float) -> "ClientLedgers":
    """Empty ledgers for clients of ``client_sizes`` records (``N_k``)."""
    shared: dict[int, PrivacyLedger] = {}
    ledgers = []
    for n in client_sizes:
      if n not in shared:
        shared[n] = PrivacyLedger(noise_multiplier=noise_multiplier, batch_size=batch_size,
                                  min_client_size=n, steps_per_round=steps_per_round,
                                  delta=delta)
      ledgers.append(shared[n])  # shared until recorded: record_round never mutates in place
    return cls(ledgers)

  @property
  def rounds(self) -> int:
    """Server rounds recorded."""
    return len(self.participants)

  def epsilons(self) -> list[float]:
    """``epsilon`` (nats) of each client so far (0.0 for a client never sampled)."""
    return [l.epsilon for l in self.ledgers]

  @property
  def epsilon(self) -> float:
    """The run's guarantee: the maximum ``epsilon`` over clients."""
    return max(self.epsilons())

  def record_round(self, participants: Iterable[int], steps: int | None = None) -> float:
    """Charges one round of ``steps`` noisy steps to each participant; returns :attr:`epsilon`.

    Args:
      participants: the indices of the clients that took part (distinct).
      steps: ``T`` of this round; defaults to each ledger's ``steps_per_round``.
    """
    ids = sorted(int(i) for i in participants)
    k = len(self.ledgers)
    if not ids or len(set(ids)) != len(ids) or not 0 <= ids[0] <= ids[-1] < k:
      raise ValueError(f"participants={ids!r} is invalid: must be distinct client indices in "
                       f"0..{k - 1}, at least one")
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
    return {"clients": [l.to_dict() for l in self.ledgers],
            "participants": [list(p) for p in self.participants]}

  @classmethod
  def from_dict(cls, d: dict) -> "ClientLedgers":
    """Restores the ledgers, recomputing every epsilon (equal ledgers once).

    Raises:
      ValueError: a malformed dict, a client ledger that fails
        :meth:`PrivacyLedger.from_dict`, or round counts that do not match
        ``participants``.
    """
    if not isinstance(d, dict) or set(d) != {"clients", "participants"}:
      keys = sorted(d) if isinstance(d, dict) else d
      raise ValueError(f"client ledgers dict is invalid ({keys!r}); allowed: a dict with the "
                       "keys 'clients' and 'participants' of to_dict()")
    if not isinstance(d["clients"], list) or not isinstance(d["participants"], list):
      raise ValueError("client ledgers dict is invalid: 'clients' and 'participants' must be "
                       "lists")
    memo: dict[str, PrivacyLedger] = {}
    ledgers = []
    for c in d["clients"]:
      text = repr(sorted(c.items())) if isinstance(c, dict) else repr(c)
      if text not in memo:
        memo[text] = PrivacyLedger.from_dict(c)
      ledgers.append(memo[text])
    return cls(ledgers, [list(p) for p in d["participants"]])


def _copy_ledger(ledger: PrivacyLedger) -> PrivacyLedger:
  """A copy that keeps the composed RDP (so recording one more round is incremental)."""
  return copy.deepcopy(ledger)
