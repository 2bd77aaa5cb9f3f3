"""Calibration of a DP run's noise to an epsilon: ``dp.target_epsilon``, ``dp.match_epsilon_of``.

A DP config spends what its method's mechanism declares (:class:`DpBudget`: ``B``, ``T`` noisy
steps per round, ``delta``, at the smallest client's rate ``q = B / min_k N_k``, for the run's
rounds). :meth:`DpBudget.calibrate` finds the smallest noise multiplier whose epsilon after the
last round is at most a target; :func:`calibrate_noise` does it for a config or a suite (in
place, one log line per run), :func:`match_epsilons` for the suite runs that match another
run's epsilon. :mod:`fedlap_runs.build` calibrates a run it builds with :meth:`DpBudget.calibrate`
(``experiments.run`` and the Flower app alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from fedlap_jax.checks import ConfigError

if TYPE_CHECKING:  # the annotation only; the module imports JAX lazily
  from fedlap_jax import accounting


def client_sizes(cfg) -> list[int]:
  """Records per client of ``cfg``'s data and partition (loads the data:
  :func:`fedlap_runs.data.load_split`).

  Raises:
    ConfigError: the data does not load or does not split as configured.
  """
  from fedlap_runs import data  # pylint: disable=g-import-not-at-top

  return [int(len(i)) for i in data.load_split(cfg.data)[1]]


# The largest noise multiplier dp.target_epsilon may calibrate to: beyond it the released
# statistics are noise (sigma * C / B per coordinate) and the target is refused as unreachable.
MAX_TARGET_NOISE_MULTIPLIER = 100.0
# Relative accuracy of the calibrated sigma (epsilon then lands within ~1e-4 of the target).
CALIBRATION_TOL = 1e-4


class DpBudget(NamedTuple):
  """What a DP config spends: its method's mechanism for ``rounds`` rounds at the smallest
  client's rate, and the epsilon its calibration targets.

  ``mechanism`` is the :class:`~fedlap_jax.accounting.DpMechanism` the method declares
  (:func:`fedlap_runs.library_configs.dp_mechanism`: ``B``, ``T`` per round, ``delta``; the same
  value the run's :class:`~fedlap_jax.algorithm.FederatedAlgorithm` carries and its ledgers
  compose); ``epsilon_for`` is ``dp.epsilon_for``, the figure (``"replace_one"`` or
  ``"add_remove"``) that :meth:`epsilon` returns and :meth:`calibrate` targets.
  """

  mechanism: "accounting.DpMechanism"
  min_client_size: int
  rounds: int
  epsilon_for: str

  @property
  def batch_size(self) -> int:
    return self.mechanism.batch_size

  @property
  def steps_per_round(self) -> int:
    return self.mechanism.steps_per_round

  @property
  def delta(self) -> float:
    return self.mechanism.delta

  @property
  def sampling_rate(self) -> float:
    return self.mechanism.sampling_rate(self.min_client_size)

  def epsilon(self, noise_multiplier: float) -> float:
    """Epsilon (nats, of ``epsilon_for``) after the last round with this ``noise_multiplier``."""
    return self.mechanism.with_noise_multiplier(noise_multiplier).epsilon_after(
      self.rounds, self.min_client_size, adjacency=self.epsilon_for
    )

  def calibrate(self, target_epsilon: float, *, field: str) -> float:
    """The smallest sigma (to ``CALIBRATION_TOL``) whose epsilon is <= ``target_epsilon``.

    Raises:
      ConfigError: naming ``field`` when the target is not a positive number or needs
        ``sigma > MAX_TARGET_NOISE_MULTIPLIER``.
    """
    allowed = (
      f"a finite number > 0 that some noise_multiplier <= "
      f"{MAX_TARGET_NOISE_MULTIPLIER:g} meets (here q = {self.batch_size}/"
      f"{self.min_client_size}, T = {self.steps_per_round} per round, {self.rounds} "
      f"rounds, delta = {self.delta:g}, {self.epsilon_for} epsilon)"
    )
    try:
      return self.mechanism.calibrated(
        target_epsilon,
        rounds=self.rounds,
        client_size=self.min_client_size,
        adjacency=self.epsilon_for,
        tol=CALIBRATION_TOL,
        max_noise_multiplier=MAX_TARGET_NOISE_MULTIPLIER,
      ).noise_multiplier
    except ValueError:
      if isinstance(target_epsilon, (int, float)) and target_epsilon > 0:
        floor = self.epsilon(MAX_TARGET_NOISE_MULTIPLIER)
        allowed = (
          f"a target >= {floor:.4g}, the epsilon of noise_multiplier="
          f"{MAX_TARGET_NOISE_MULTIPLIER:g}" + allowed[allowed.index(" (here") :]
        )
      raise ConfigError(
        field,
        target_epsilon,
        allowed,
        message=f"{field}={target_epsilon!r} is unreachable; allowed: {allowed}",
      ) from None


def budget(cfg, mechanism: "accounting.DpMechanism", sizes) -> DpBudget:
  """The :class:`DpBudget` of a DP config whose method declares ``mechanism``, on clients of
  ``sizes`` records (the smallest sets the rate)."""
  from fedlap_jax import accounting  # pylint: disable=g-import-not-at-top

  return DpBudget(
    mechanism, int(min(sizes)), int(cfg.rounds), cfg.dp.get("epsilon_for", accounting.REPLACE_ONE)
  )


def dp_budget(cfg, sizes: list[int] | None = None) -> DpBudget:
  """The :class:`DpBudget` of a DP config (``sizes``: records per client; loaded if None)."""
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  sizes = client_sizes(cfg) if sizes is None else sizes
  return budget(cfg, library_configs.dp_mechanism(cfg, sizes), sizes)


def line(label: str, what: str, target: float, noise_multiplier: float, spent: DpBudget) -> str:
  """The log line of one calibration: ``calibrated: LABELWHAT=TARGET -> dp.noise_multiplier=...``
  with the mechanism's figures and the epsilon it reaches."""
  eps = spent.epsilon(noise_multiplier)
  return (
    f"calibrated: {label}{what}={target:.6g} -> dp.noise_multiplier="
    f"{noise_multiplier:.6g} (q = {spent.batch_size}/"
    f"{spent.min_client_size} = {spent.sampling_rate:.4g}, T = "
    f"{spent.steps_per_round} per round, {spent.rounds} rounds, delta = "
    f"{spent.delta:g}: {spent.epsilon_for} epsilon {eps:.4f})"
  )


def outside_a_suite(cfg) -> None:
  """Refuses ``dp.match_epsilon_of`` on a config that is not a run of a suite.

  Raises:
    ConfigError: naming ``dp.match_epsilon_of``.
  """
  other = cfg.dp.get("match_epsilon_of", "")
  if other:
    raise ConfigError(
      "dp.match_epsilon_of", other, "'' outside a suite (it names another run of the suite)"
    )


def calibrate_noise(config, sizes_of=None, budget_of=None) -> list[str]:
  """Sets ``dp.noise_multiplier`` of every (suite) run with ``dp.target_epsilon`` or
  ``dp.match_epsilon_of`` (in place); returns one log line per calibrated run.

  ``sizes_of(cfg)`` gives a run's records per client (default :func:`client_sizes`, which
  loads the data; :mod:`experiments.epsilons` passes the published sizes of data it does not
  load); ``budget_of(cfg)`` gives a run's :class:`DpBudget` as configured now (default: from
  ``sizes_of``; :mod:`experiments.suite` passes those of the runs it built).

  * ``dp.target_epsilon = E``: the smallest sigma whose epsilon (of ``dp.epsilon_for``:
    replace-one by default, the reported guarantee) after the run's last round is at most
    ``E`` (:meth:`DpBudget.calibrate`, with the run's own client sizes and its method's
    mechanism, for every DP method).
  * ``dp.match_epsilon_of = "other"`` (suites only): ``E`` is the epsilon of the suite's run
    ``other`` after its last round (after ``other``'s own calibration, if it has a target).

  This needs the data's client sizes, so it runs when the run or suite starts, not in the config
  file. The calibrated sigma lands in the run's ``config.json``, ``run_info.json`` and ledger.

  Raises:
    ConfigError: an unreachable target; ``match_epsilon_of`` outside a suite, naming no other DP
      run of it, naming a run that matches another itself, or set on a run without DP.
  """
  lines = []
  loaded = {}  # the runs of a suite mostly share data and partition: load them once

  def sized_budget(cfg):
    key = repr(sorted(cfg.data.to_dict().items()))
    if key not in loaded:
      loaded[key] = (sizes_of or client_sizes)(cfg)
    return dp_budget(cfg, loaded[key])

  budget_of = budget_of or sized_budget

  def log(label, field, target, cfg, spent):
    lines.append(line(label, field, target, cfg.dp.noise_multiplier, spent))

  if "suite" not in config:
    outside_a_suite(config)
    runs = [("", config)]
  else:
    runs = [(f"suite.{k}.", config.suite[k]) for k in config.suite.keys()]
  budgets = {}
  for prefix, cfg in runs:
    target = cfg.dp.get("target_epsilon")
    if target is None:
      continue
    field = f"{prefix}dp.target_epsilon"
    if not cfg.dp.enabled:
      raise ConfigError(field, target, "None when dp.enabled is False")
    budgets[prefix] = spent = budget_of(cfg)
    cfg.dp.noise_multiplier = spent.calibrate(target, field=field)
    log(prefix, "dp.target_epsilon", target, cfg, spent)
  if "suite" in config:
    match_epsilons(config, budgets, log, budget_of)
  return lines


def match_epsilons(config, budgets=None, log=None, budget_of=dp_budget):
  """Sets the noise of every suite run with ``dp.match_epsilon_of`` (in place; returns ``config``).

  A run ``r`` with ``dp.match_epsilon_of = "other"`` gets the noise multiplier
  (:meth:`DpBudget.calibrate`, tolerance ``CALIBRATION_TOL``) that makes its epsilon after its
  last round equal ``other``'s, each from its own client sizes and mechanism; both epsilons
  are of ``r``'s ``dp.epsilon_for``.
  Used by :func:`calibrate_noise` (after the ``dp.target_epsilon`` runs are calibrated).

  Raises:
    ConfigError: ``match_epsilon_of`` outside a suite, naming no other DP run
      of it, naming a run that matches another itself, or set on a run
      without DP.
  """
  budgets = {} if budgets is None else budgets
  if "suite" not in config:
    outside_a_suite(config)
    return config
  suite = config.suite
  for name in suite.keys():
    cfg = suite[name]
    other = cfg.dp.get("match_epsilon_of", "")
    if not other:
      continue
    field = f"suite.{name}.dp.match_epsilon_of"
    candidates = [
      k
      for k in suite.keys()
      if k != name and suite[k].dp.enabled and not suite[k].dp.get("match_epsilon_of", "")
    ]
    if other not in candidates:
      raise ConfigError(
        field,
        other,
        f"one of {candidates}, the suite's other DP runs that match no other run themselves",
      )
    if not cfg.dp.enabled:
      raise ConfigError(f"suite.{name}.dp.enabled", cfg.dp.enabled, f"True with {field}={other!r}")
    if cfg.dp.get("target_epsilon") is not None:
      raise ConfigError(
        f"suite.{name}.dp.target_epsilon",
        cfg.dp.target_epsilon,
        f"None with {field}={other!r} (set one of the two)",
      )
    ref = suite[other]
    budget = budget_of(cfg)
    ref_budget = budgets.get(f"suite.{other}.") or budget_of(ref)
    target = ref_budget._replace(epsilon_for=budget.epsilon_for).epsilon(ref.dp.noise_multiplier)
    cfg.dp.noise_multiplier = budget.calibrate(target, field=field)
    if log is not None:
      log(f"suite.{name}.", f"dp.match_epsilon_of={other!r}: epsilon", target, cfg, budget)
  return config
