"""Tests for fedlap_jax.auditing (membership inference): the per-example features on the
device, and the threshold attack and its epsilon bound on the host. The audit of trained
models: ``tests/integration/test_audit_trained_models.py``; the CLI on a run dir:
``tests/integration/test_audit_cli.py``.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats

from fedlap_jax import auditing
from fedlap_jax.losses import cross_entropy, masked_mean_loss
from conftest import raises_field

DELTA = 1e-5


# --------------------------------------------------------------------------
# Device side: the features.
# --------------------------------------------------------------------------


def test_features_jit_eager_consistent(tiny_apply_fn, tiny_params, digits):
  x, y = jnp.asarray(digits.x_train[:10]), jnp.asarray(digits.y_train[:10])
  for fn in (auditing.per_example_losses, auditing.per_example_grad_norms):
    eager = fn(tiny_apply_fn, tiny_params, x, y, chunk_size=64)  # one chunk of 10
    jitted = jax.jit(functools.partial(fn, tiny_apply_fn, chunk_size=64))(tiny_params, x, y)
    chex.assert_shape([eager, jitted], (10,))
    chex.assert_trees_all_close(eager, jitted, rtol=1e-5, atol=1e-6)


def test_features_match_direct_computation(tiny_apply_fn, tiny_params, digits):
  chunk_size = 4  # 3 chunks, the last one padded with 2 rows
  x_host, y_host = digits.x_train[:10], digits.y_train[:10]  # one example out compiles nothing
  x, y = jnp.asarray(x_host), jnp.asarray(y_host)
  losses, norms = jax.jit(
    lambda p: (
      auditing.per_example_losses(tiny_apply_fn, p, x, y, chunk_size=chunk_size),
      auditing.per_example_grad_norms(tiny_apply_fn, p, x, y, chunk_size=chunk_size),
    )
  )(tiny_params)
  chex.assert_shape([losses, norms], (10,))
  direct_losses = jax.jit(lambda p: cross_entropy(tiny_apply_fn(p, x), y))(tiny_params)
  chex.assert_trees_all_close(losses, direct_losses, rtol=1e-5, atol=1e-6)

  @jax.jit
  def direct_norm(p, xi, yi):
    g = jax.grad(lambda q: masked_mean_loss(tiny_apply_fn, q, xi[None], yi[None]))(p)
    return optax.tree.norm(g)

  expected = np.stack([direct_norm(tiny_params, x_host[i], y_host[i]) for i in range(10)])
  chex.assert_trees_all_close(norms, expected, rtol=1e-4)
  assert np.all(np.asarray(norms) > 0)


def test_features_reject_bad_input(tiny_apply_fn, tiny_params, digits):
  x, y = digits.x_train[:4], digits.y_train[:4]  # NumPy: the slices below compile nothing
  with raises_field("chunk_size"):
    auditing.per_example_losses(tiny_apply_fn, tiny_params, x, y, chunk_size=0)
  with raises_field("y"):
    auditing.per_example_grad_norms(tiny_apply_fn, tiny_params, x, y[:3])
  with raises_field("y"):
    auditing.per_example_losses(tiny_apply_fn, tiny_params, x, y[:, None])


# --------------------------------------------------------------------------
# Host side: split, threshold attack, epsilon bound.
# --------------------------------------------------------------------------


def test_split_for_audit_is_balanced_and_disjoint():
  s = auditing.split_for_audit(0, 1000, 101)
  assert [a.size for a in s] == [51, 51, 50, 50]
  for pool, (a, b) in (
    (1000, (s.train_members, s.audit_members)),
    (101, (s.train_nonmembers, s.audit_nonmembers)),
  ):
    both = np.concatenate([a, b])
    assert np.unique(both).size == both.size and both.min() >= 0 and both.max() < pool
  assert np.array_equal(auditing.split_for_audit(0, 1000, 101).audit_members, s.audit_members)
  with raises_field("num_nonmembers"):
    auditing.split_for_audit(0, 10, 1)


def test_threshold_attack_on_gaussians():
  rng = np.random.default_rng(0)
  f_in, f_out = rng.normal(0.0, 1.0, 4000), rng.normal(2.0, 1.0, 4000)  # members lower
  attack = auditing.fit_threshold_attack(f_in[:2000], f_out[:2000], delta=DELTA)
  assert attack.sign == -1.0
  assert abs(-attack.threshold - 1.0) < 0.15  # Bayes threshold: the midpoint
  assert abs(attack.train_accuracy - scipy.stats.norm.cdf(1.0)) < 0.03
  assert auditing.fit_threshold_attack(f_in[:200], f_out[:200], sign=None).sign == -1.0
  learnt = auditing.fit_threshold_attack(-f_in[:200], -f_out[:200], sign=None)
  assert learnt.sign == 1.0 and learnt.train_auc > 0.85
  assert auditing.fit_threshold_attack(-f_in[:200], -f_out[:200]).train_auc < 0.15  # fixed sign

  ev = auditing.evaluate_attack(attack, f_in[2000:], f_out[2000:], delta=DELTA)
  expected_auc = scipy.stats.norm.cdf(2.0 / math.sqrt(2.0))
  assert abs(ev.auc - expected_auc) < 0.015
  from sklearn import metrics

  labels = np.r_[np.ones(2000), np.zeros(2000)]
  np.testing.assert_allclose(
    ev.auc, metrics.roc_auc_score(labels, attack.scores(np.r_[f_in[2000:], f_out[2000:]]))
  )
  assert ev.auc <= ev.auc_convex_hull < ev.auc + 0.01
  assert abs(ev.accuracy - scipy.stats.norm.cdf(1.0)) < 0.03
  # TPR at FPR 1 %: Phi(2 - z_0.99) for unit Gaussians two apart.
  assert abs(ev.tpr_at_fpr[0.01] - scipy.stats.norm.cdf(2.0 - 2.326)) < 0.06
  assert 0.5 < ev.epsilon_lower_bound <= ev.epsilon_lower_bound_max
  assert 0.5 < ev.epsilon_lower_bound_all_thresholds <= ev.epsilon_lower_bound_max

  same = auditing.evaluate_attack(attack, rng.normal(size=2000), rng.normal(size=2000))
  assert abs(same.auc - 0.5) < 0.03
  assert same.epsilon_lower_bound == 0.0 and same.epsilon_lower_bound_all_thresholds == 0.0


def test_epsilon_bound_of_a_perfect_attack_is_clopper_pearson():
  """n members above n non-members: eps >= log(TPR_lb / FPR_ub), one-sided C-P at alpha/2."""
  n, alpha = 100, 0.05
  ev = auditing.evaluate_attack(
    auditing.ThresholdAttack(1.0, 0.5, 0.5, 1.0, 1.0), np.ones(n), np.zeros(n), significance=alpha
  )
  tpr_lb = (alpha / 2) ** (1 / n)
  fpr_ub = 1 - (alpha / 2) ** (1 / n)
  np.testing.assert_allclose(ev.epsilon_lower_bound, math.log(tpr_lb / fpr_ub), rtol=1e-6)
  np.testing.assert_allclose(ev.epsilon_lower_bound_max, ev.epsilon_lower_bound)
  assert ev.auc == 1.0 and ev.accuracy == 1.0 and ev.confidence == 0.95


def test_host_side_rejects_bad_input():
  attack = auditing.ThresholdAttack(-1.0, 0.0, 0.0, 0.5, 0.5)
  with raises_field("features_in"):
    auditing.evaluate_attack(attack, np.array([1.0, np.nan]), np.ones(2))
  with raises_field("sign"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros(3), sign=0.5)
  with raises_field("significance"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros(3), significance=0.7)
  with raises_field("delta"):
    auditing.evaluate_attack(attack, np.ones(3), np.zeros(3), delta=1.5)
  with raises_field("features_out"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros((0,)))
