"""Membership-inference auditing of a trained model (the paper's "Privacy Auditing").

Two attack features per example, computed on the device:

* :func:`per_example_losses` -- black-box: the cross-entropy of the example under
  the model (members tend to have a *lower* loss);
* :func:`per_example_grad_norms` -- white-box: the L2 norm, over the whole
  parameter pytree, of the gradient of the example's loss (members tend to have
  a *smaller* gradient).

Both run ``chunk_size`` examples at a time under ``lax.map``, so memory is
bounded by one chunk (``chunk_size x num_params`` floats for the gradients).

The attack itself is a threshold on one feature, fitted on one half of a
balanced member / non-member set and evaluated on the other half (host side,
NumPy):

* :func:`split_for_audit` draws the balanced halves;
* :func:`fit_threshold_attack` chooses, on the training half, the threshold of
  highest balanced accuracy and the threshold of highest epsilon lower bound
  (the orientation is "a low feature means member" unless asked to learn it);
* :func:`evaluate_attack` reports, on the audit half, the AUC, the TPR at low
  FPRs and an empirical epsilon lower bound, through
  ``jax_privacy.auditing.CanaryScoreAuditor`` (Clopper-Pearson bounds,
  Jagielski et al. 2020).

Attack scores follow the ``CanaryScoreAuditor`` convention: *higher score =>
member*. The epsilon lower bound is a statistical statement at the given
confidence, valid when members and non-members are exchangeable (each record
of the pool is equally likely to have been a member: true for an i.i.d.
train / test split of one distribution, approximately for benchmark splits).
It is a lower bound: a value far below the accountant's epsilon is expected
(the attack is weak, the bound is for one record, and the accountant is a
worst-case upper bound).

References:
  Wang et al., "FedLAP-DP", PoPETs 2024, Section "Privacy Auditing".
  Yeom et al., "Privacy Risk in Machine Learning: Analyzing the Connection to
  Overfitting", CSF 2018 (the loss-threshold attack).
  Jagielski et al., "Auditing Differentially Private Machine Learning: How
  Private is Private SGD?", NeurIPS 2020.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.checks import ConfigError
from fedlap_jax.losses import cross_entropy
from fedlap_jax.privacy import per_example_gradients
from fedlap_jax.types import ApplyFn, PyTree


DEFAULT_FPRS = (0.001, 0.01)

__all__ = [
  "AttackEvaluation",
  "AuditSplit",
  "DEFAULT_FPRS",
  "ThresholdAttack",
  "evaluate_attack",
  "fit_threshold_attack",
  "per_example_grad_norms",
  "per_example_losses",
  "split_for_audit",
]


# --------------------------------------------------------------------------
# Device side: attack features.
# --------------------------------------------------------------------------


def _check_batch(x, y, chunk_size) -> None:
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ConfigError("chunk_size", chunk_size, "an integer >= 1")
  if y.ndim != 1:
    raise ConfigError(
      "y",
      y.shape,
      "(N,) integer labels",
      message=f"y has shape {y.shape}; allowed: (N,) integer labels",
    )
  if x.shape[0] != y.shape[0]:
    raise ConfigError(
      "y",
      y.shape[0],
      f"{x.shape[0]}, the examples of x",
      message=f"x has {x.shape[0]} examples but y has {y.shape[0]}; allowed: equal",
    )
  if x.shape[0] < 1:
    raise ConfigError("x", 0, "N >= 1", message="x has 0 examples; allowed: N >= 1")


def _map_chunks(
  fn: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, y: jax.Array, chunk_size: int
) -> jax.Array:
  """Applies ``fn(xc, yc) -> (cs,)`` to ``chunk_size`` examples at a time; ``(N,)`` out.

  The last chunk is zero-padded; the padded rows are dropped from the result.
  """
  n = x.shape[0]
  cs = min(chunk_size, n)
  chunks = math.ceil(n / cs)
  pad = chunks * cs - n
  xp = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(chunks, cs, *x.shape[1:])
  yp = jnp.pad(y, (0, pad)).reshape(chunks, cs)
  out = jax.lax.map(lambda args: fn(*args), (xp, yp))
  return out.reshape(-1)[:n]


def per_example_losses(
  apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, *, chunk_size: int = 512
) -> jax.Array:
  """Per-example cross-entropy, the black-box membership feature.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: model parameters.
    x: ``(N, ...)`` inputs; y: ``(N,)`` int labels.
    chunk_size: examples per ``lax.map`` step (static).

  Returns:
    ``(N,)`` float losses in nats. Members tend to score lower: use ``-loss``
    as a "higher => member" attack score.
  """
  _check_batch(x, y, chunk_size)
  return _map_chunks(lambda xc, yc: cross_entropy(apply_fn(params, xc), yc), x, y, chunk_size)


def per_example_grad_norms(
  apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, *, chunk_size: int = 64
) -> jax.Array:
  """Per-example L2 norm of the loss gradient, the white-box membership feature.

  The norm is over the whole flattened parameter pytree (as in DP-SGD
  clipping), of the gradient of the example's cross-entropy, computed with
  :func:`fedlap_jax.privacy.per_example_gradients` (``vmap(grad)``).

  Args:
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: model parameters.
    x: ``(N, ...)`` inputs; y: ``(N,)`` int labels.
    chunk_size: examples per ``lax.map`` step (static); memory is about
      ``chunk_size x num_params`` floats.

  Returns:
    ``(N,)`` non-negative norms. Members tend to score lower.
  """
  _check_batch(x, y, chunk_size)

  def norms(xc, yc):
    grads = per_example_gradients(apply_fn, params, xc, yc)
    sq = [jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads)]
    return jnp.sqrt(sum(sq))

  return _map_chunks(norms, x, y, chunk_size)


# --------------------------------------------------------------------------
# Host side: the protocol and the threshold attack.
# --------------------------------------------------------------------------


class AuditSplit(NamedTuple):
  """Indices of a balanced member / non-member set, cut into two halves.

  Each array indexes the member pool (``*_members``) or the non-member pool
  (``*_nonmembers``). The four arrays have sizes ``ceil(n/2), ceil(n/2),
  floor(n/2), floor(n/2)`` where ``n = min(num_members, num_nonmembers)``.

  Attributes:
    train_members, train_nonmembers: the half that fits the attack.
    audit_members, audit_nonmembers: the half the attack is evaluated on.
  """

  train_members: np.ndarray
  train_nonmembers: np.ndarray
  audit_members: np.ndarray
  audit_nonmembers: np.ndarray


def split_for_audit(seed: int, num_members: int, num_nonmembers: int) -> AuditSplit:
  """Subsamples the larger pool to the smaller one and halves both at random.

  Args:
    seed: NumPy seed of the subsampling and the split.
    num_members: size of the member pool (e.g. all clients' training records).
    num_nonmembers: size of the non-member pool (e.g. the test split).

  Returns:
    An :class:`AuditSplit`; each half holds as many members as non-members.
  """
  for name, value in (("num_members", num_members), ("num_nonmembers", num_nonmembers)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 2:
      raise ConfigError(name, value, "an integer >= 2 (each half of the audit needs one record)")
  n = int(min(num_members, num_nonmembers))
  rng = np.random.default_rng(seed)
  members = rng.permutation(num_members)[:n]
  nonmembers = rng.permutation(num_nonmembers)[:n]
  half = (n + 1) // 2
  return AuditSplit(members[:half], nonmembers[:half], members[half:], nonmembers[half:])


class ThresholdAttack(NamedTuple):
  """A fitted threshold attack: ``member iff sign * feature >= threshold``.

  Attributes:
    sign: ``+1.0`` (a high feature means member) or ``-1.0`` (a low feature
      means member, e.g. the loss).
    threshold: the threshold on ``sign * feature`` of highest balanced
      accuracy on the training half.
    epsilon_threshold: the threshold on ``sign * feature`` of highest
      Clopper-Pearson epsilon lower bound on the training half (the decision
      rule the audit half tests).
    train_auc: AUC of ``sign * feature`` on the training half.
    train_accuracy: balanced accuracy at ``threshold`` on the training half.
  """

  sign: float
  threshold: float
  epsilon_threshold: float
  train_auc: float
  train_accuracy: float

  def scores(self, features: np.ndarray) -> np.ndarray:
    """Attack scores ``sign * features`` (higher => member)."""
    return self.sign * np.asarray(features, np.float64)


def _check_scores(name: str, values) -> np.ndarray:
  values = np.asarray(values, np.float64)
  if values.ndim != 1 or values.size == 0:
    raise ConfigError(
      name,
      values.shape,
      "(n,) with n >= 1",
      message=f"{name} has shape {values.shape}; allowed: (n,) with n >= 1",
    )
  if not np.all(np.isfinite(values)):
    bad = int(np.sum(~np.isfinite(values)))
    raise ConfigError(
      name,
      f"{bad} non-finite values",
      "finite scores",
      message=f"{name} contains {bad} non-finite values; allowed: finite scores (is the model NaN?)",
    )
  return values


def _check_significance(significance: float) -> None:
  if not 0 < significance < 0.5:
    raise ConfigError("significance", significance, "(0, 0.5) (one minus the confidence level)")


def _check_delta(delta: float) -> None:
  if not 0 <= delta < 1:
    raise ConfigError("delta", delta, "[0, 1)")


def _candidate_thresholds(scores: np.ndarray, max_candidates: int) -> np.ndarray:
  """Midpoints between consecutive distinct scores, plus one below and one above all."""
  u = np.unique(scores)
  if u.size > max_candidates:
    u = np.unique(np.quantile(u, np.linspace(0.0, 1.0, max_candidates)))
  mids = (u[:-1] + u[1:]) / 2
  span = max(float(u[-1] - u[0]), 1.0)
  return np.concatenate([[u[0] - span], mids, [u[-1] + span]])


def _auc(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
  """Area under the ROC curve of "member iff score >= t" (ties count 1/2).

  The Mann-Whitney U statistic over ``n_in * n_out``; equals
  ``sklearn.metrics.roc_auc_score``.
  """
  import scipy.stats  # pylint: disable=g-import-not-at-top

  u = scipy.stats.mannwhitneyu(scores_in, scores_out, alternative="two-sided").statistic
  return float(u / (scores_in.size * scores_out.size))


def _auditor(scores_in: np.ndarray, scores_out: np.ndarray):
  from jax_privacy import auditing as jp_auditing  # host-side; imports scipy

  return jp_auditing.CanaryScoreAuditor(scores_in, scores_out)


def _epsilon_at(auditor, threshold: float, significance: float, delta: float) -> float:
  from jax_privacy import auditing as jp_auditing

  return float(
    auditor.epsilon_clopper_pearson(
      significance, delta, threshold_strategy=jp_auditing.Explicit(float(threshold))
    )
  )


def fit_threshold_attack(
  features_in,
  features_out,
  *,
  sign: float | None = -1.0,
  significance: float = 0.05,
  delta: float = 0.0,
  max_candidates: int = 512,
) -> ThresholdAttack:
  """Fits a one-feature threshold attack on the training half (host side).

  The orientation is fixed by ``sign`` (``-1``: a low feature means member,
  the loss-threshold attack of Yeom et al. 2018 and its gradient-norm
  analogue), or, with ``sign=None``, learnt as the one of higher AUC on these
  examples (``-1`` on a tie). A learnt orientation is noisy when the signal is
  weak (it can then be wrong on the audit half, giving AUC < 0.5), so the
  fixed one is the default. The accuracy threshold
  maximises the balanced accuracy ``(TPR + TNR) / 2``; the epsilon threshold
  maximises the Clopper-Pearson epsilon lower bound at ``significance`` and
  ``delta``. Thresholds are midpoints between observed scores.

  Args:
    features_in: ``(n_in,)`` feature of members (e.g. per-example losses).
    features_out: ``(n_out,)`` feature of non-members.
    sign: ``-1.0`` or ``1.0`` (member iff ``sign * feature >= threshold``), or
      ``None`` to learn it from these examples.
    significance: one minus the confidence of the epsilon bound.
    delta: the ``delta`` of the epsilon bound.
    max_candidates: at most this many distinct thresholds are tried (score
      quantiles beyond that), which bounds the host time.

  Returns:
    A :class:`ThresholdAttack`.
  """
  f_in = _check_scores("features_in", features_in)
  f_out = _check_scores("features_out", features_out)
  if sign is not None and sign not in (-1.0, 1.0):
    raise ConfigError("sign", sign, "-1.0, 1.0 or None (learn it)")
  _check_significance(significance)
  _check_delta(delta)
  if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 2:
    raise ConfigError("max_candidates", max_candidates, "an integer >= 2")

  if sign is None:
    sign = 1.0 if _auc(f_in, f_out) > 0.5 else -1.0
  sign = float(sign)
  s_in, s_out = sign * f_in, sign * f_out

  candidates = _candidate_thresholds(np.concatenate([s_in, s_out]), max_candidates)
  tpr = 1.0 - np.searchsorted(np.sort(s_in), candidates, side="left") / s_in.size
  tnr = np.searchsorted(np.sort(s_out), candidates, side="left") / s_out.size
  accuracy = (tpr + tnr) / 2
  best = int(np.argmax(accuracy))

  auditor = _auditor(s_in, s_out)
  epsilons = np.array([_epsilon_at(auditor, t, significance, delta) for t in candidates])
  # Among equal bounds prefer the highest threshold (the lowest FPR).
  eps_best = int(len(candidates) - 1 - np.argmax(epsilons[::-1]))
  return ThresholdAttack(
    sign=sign,
    threshold=float(candidates[best]),
    epsilon_threshold=float(candidates[eps_best]),
    train_auc=_auc(s_in, s_out),
    train_accuracy=float(accuracy[best]),
  )


class AttackEvaluation(NamedTuple):
  """A threshold attack measured on the audit half.

  Attributes:
    auc: area under the ROC curve of the attack scores (0.5 = guessing), the
      usual empirical AUC (as ``sklearn.metrics.roc_auc_score``).
    auc_convex_hull: the AUC of the ROC curve's convex hull (randomising
      between thresholds), ``CanaryScoreAuditor.attack_auroc``; ``>= auc``.
    tpr_at_fpr: ``{fpr: tpr}``, the best TPR at each FPR (randomising between
      two thresholds where the FPR falls between observed values).
    accuracy: balanced accuracy at the attack's fitted threshold.
    epsilon_lower_bound: Clopper-Pearson lower bound on epsilon at the
      attack's ``epsilon_threshold`` (one pre-registered test), holding with
      probability ``confidence``.
    epsilon_lower_bound_all_thresholds: the same bound maximised over every
      threshold of the audit half, Bonferroni-corrected (uses nothing of the
      attack but its orientation).
    epsilon_lower_bound_max: the largest bound this many examples could give
      (a perfect attack), to read the other two against.
    confidence: ``1 - significance``.
    delta: the ``delta`` of the bounds.
    num_members, num_nonmembers: audit-half sizes.
  """

  auc: float
  auc_convex_hull: float
  tpr_at_fpr: dict
  accuracy: float
  epsilon_lower_bound: float
  epsilon_lower_bound_all_thresholds: float
  epsilon_lower_bound_max: float
  confidence: float
  delta: float
  num_members: int
  num_nonmembers: int


def evaluate_attack(
  attack: ThresholdAttack,
  features_in,
  features_out,
  *,
  significance: float = 0.05,
  delta: float = 0.0,
  fprs=DEFAULT_FPRS,
) -> AttackEvaluation:
  """Measures a fitted attack on the audit half with ``CanaryScoreAuditor``.

  Args:
    attack: from :func:`fit_threshold_attack` on the *other* half.
    features_in: ``(n_in,)`` feature of the audit members.
    features_out: ``(n_out,)`` feature of the audit non-members.
    significance: one minus the confidence of the epsilon bounds.
    delta: the ``delta`` of the epsilon bounds (use the run's ``delta`` to
      compare with the accountant's ``(epsilon, delta)``).
    fprs: false-positive rates in ``[0, 1]`` at which to report the TPR.

  Returns:
    An :class:`AttackEvaluation`.
  """
  from jax_privacy import auditing as jp_auditing

  s_in = attack.scores(_check_scores("features_in", features_in))
  s_out = attack.scores(_check_scores("features_out", features_out))
  _check_significance(significance)
  _check_delta(delta)
  fprs = tuple(float(f) for f in fprs)
  for f in fprs:
    if not 0 <= f <= 1:
      raise ValueError(f"fprs contains {f!r}; allowed: values in [0, 1]")

  auditor = _auditor(s_in, s_out)
  tprs = np.atleast_1d(auditor.tpr_at_given_fpr(np.asarray(fprs)))
  accuracy = 0.5 * (np.mean(s_in >= attack.threshold) + np.mean(s_out < attack.threshold))
  perfect = _auditor(np.ones(s_in.size), np.zeros(s_out.size))
  return AttackEvaluation(
    auc=_auc(s_in, s_out),
    auc_convex_hull=float(auditor.attack_auroc()),
    tpr_at_fpr={f: float(t) for f, t in zip(fprs, tprs)},
    accuracy=float(accuracy),
    epsilon_lower_bound=_epsilon_at(auditor, attack.epsilon_threshold, significance, delta),
    epsilon_lower_bound_all_thresholds=float(
      auditor.epsilon_clopper_pearson(
        significance, delta, threshold_strategy=jp_auditing.Bonferroni()
      )
    ),
    epsilon_lower_bound_max=_epsilon_at(perfect, 0.5, significance, delta),
    confidence=1.0 - significance,
    delta=float(delta),
    num_members=int(s_in.size),
    num_nonmembers=int(s_out.size),
  )
