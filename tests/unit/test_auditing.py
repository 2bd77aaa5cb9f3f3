"""Tests for fedlap_jax.auditing (membership inference); its CLI on a run dir:
``tests/integration/test_audit_cli.py``.

Three ConvNets (width 32, depth 2) on digits, members = 64 training records:
untrained; overfit (100 full-batch SGD steps); and the same 100 steps with
DP-SGD (Poisson rate 1/8, sigma 5, C 0.1: epsilon about 1.1 at delta 1e-5).
"""

from __future__ import annotations

import functools
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats

from fedlap_jax import auditing
from fedlap_jax.accounting import epsilon_after_rounds
from fedlap_jax.losses import cross_entropy, masked_mean_loss
from fedlap_jax.privacy import poisson_capacity, poisson_sample, private_gradient

# Its module fixtures run once: under xdist (-n 2) all of this file goes to one worker.
pytestmark = pytest.mark.xdist_group("auditing")

NUM_MEMBERS = 64
STEPS = 100
DP_BATCH = 8  # expected Poisson batch: q = 8 / 64
DP_SIGMA = 5.0
DP_CLIP = 0.1
DELTA = 1e-5


# --------------------------------------------------------------------------
# Fixtures: members / non-members and three models.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def members(digits):
  idx = np.random.default_rng(0).permutation(len(digits.y_train))[:NUM_MEMBERS]
  return digits.x_train[idx], digits.y_train[idx]


@pytest.fixture(scope="module")
def nonmembers(digits):
  return digits.x_test, digits.y_test


@functools.partial(jax.jit, static_argnums=(0, 5))
def _train(apply_fn, params, x, y, key, dp: bool):
  """STEPS steps of SGD (lr 0.1, momentum 0.9): full batch, or DP-SGD with Poisson batches."""
  opt = optax.sgd(0.1, momentum=0.9)
  n = x.shape[0]

  def step(carry, k):
    p, s = carry
    if dp:
      k_batch, k_noise = jax.random.split(k)
      b = poisson_sample(k_batch, jnp.ones(n, bool), DP_BATCH / n, poisson_capacity(DP_BATCH))
      g, _ = private_gradient(
        k_noise,
        apply_fn,
        p,
        x[b.indices],
        y[b.indices],
        b.is_padding,
        l2_clip_norm=DP_CLIP,
        noise_multiplier=DP_SIGMA,
        expected_batch_size=DP_BATCH,
      )
    else:
      g = jax.grad(lambda q: masked_mean_loss(apply_fn, q, x, y))(p)
    updates, s = opt.update(g, s, p)
    return (optax.apply_updates(p, updates), s), None

  (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), jax.random.split(key, STEPS))
  return p


@pytest.fixture(scope="module")
def models(apply_fn, params, members):
  x, y = jnp.asarray(members[0]), jnp.asarray(members[1])
  key = jax.random.PRNGKey(1)
  return {
    "untrained": params,
    "overfit": _train(apply_fn, params, x, y, key, False),
    "dp": _train(apply_fn, params, x, y, key, True),
  }


@pytest.fixture(scope="module")
def feature_fns(apply_fn):
  return {
    "loss": jax.jit(functools.partial(auditing.per_example_losses, apply_fn)),
    "grad_norm": jax.jit(functools.partial(auditing.per_example_grad_norms, apply_fn)),
  }


@pytest.fixture(scope="module")
def features(models, feature_fns, members, nonmembers):
  """``{model: {feature: (members (64,), nonmembers (360,))}}`` as numpy."""
  out = {}
  for name, p in models.items():
    out[name] = {
      f: (np.asarray(fn(p, *members)), np.asarray(fn(p, *nonmembers)))
      for f, fn in feature_fns.items()
    }
  return out


def _auc(f_in, f_out):
  """AUC of the a-priori attack "a low feature means member"."""
  attack = auditing.ThresholdAttack(-1.0, 0.0, 0.0, 0.5, 0.5)
  return auditing.evaluate_attack(attack, f_in, f_out, delta=DELTA)


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
  x, y = jnp.asarray(digits.x_train[:10]), jnp.asarray(digits.y_train[:10])
  losses, norms = jax.jit(
    lambda p: (
      auditing.per_example_losses(tiny_apply_fn, p, x, y, chunk_size=chunk_size),
      auditing.per_example_grad_norms(tiny_apply_fn, p, x, y, chunk_size=chunk_size),
    )
  )(tiny_params)
  chex.assert_shape([losses, norms], (10,))
  chex.assert_trees_all_close(
    losses, cross_entropy(tiny_apply_fn(tiny_params, x), y), rtol=1e-5, atol=1e-6
  )

  @jax.jit
  def direct_norm(p, xi, yi):
    g = jax.grad(lambda q: masked_mean_loss(tiny_apply_fn, q, xi[None], yi[None]))(p)
    return optax.tree.norm(g)

  expected = jnp.stack([direct_norm(tiny_params, x[i], y[i]) for i in range(10)])
  chex.assert_trees_all_close(norms, expected, rtol=1e-4)
  assert np.all(np.asarray(norms) > 0)


def test_features_reject_bad_input(tiny_apply_fn, tiny_params, digits):
  x, y = jnp.asarray(digits.x_train[:4]), jnp.asarray(digits.y_train[:4])
  with pytest.raises(ValueError, match="chunk_size=0"):
    auditing.per_example_losses(tiny_apply_fn, tiny_params, x, y, chunk_size=0)
  with pytest.raises(ValueError, match="x has 4 examples but y has 3"):
    auditing.per_example_grad_norms(tiny_apply_fn, tiny_params, x, y[:3])
  with pytest.raises(ValueError, match="y has shape"):
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
  with pytest.raises(ValueError, match="num_nonmembers=1"):
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
  with pytest.raises(ValueError, match="non-finite"):
    auditing.evaluate_attack(attack, np.array([1.0, np.nan]), np.ones(2))
  with pytest.raises(ValueError, match="sign=0.5"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros(3), sign=0.5)
  with pytest.raises(ValueError, match="significance=0.7"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros(3), significance=0.7)
  with pytest.raises(ValueError, match="delta=1.5"):
    auditing.evaluate_attack(attack, np.ones(3), np.zeros(3), delta=1.5)
  with pytest.raises(ValueError, match="features_out has shape"):
    auditing.fit_threshold_attack(np.ones(3), np.zeros((0,)))


# --------------------------------------------------------------------------
# Behaviour on trained models.
# --------------------------------------------------------------------------


@pytest.mark.run_bound  # long runs of few programs (conftest's compiler note)
def test_overfit_model_leaks_untrained_does_not(features):
  overfit = _auc(*features["overfit"]["loss"])
  untrained = _auc(*features["untrained"]["loss"])
  assert overfit.auc > 0.75, overfit
  assert abs(untrained.auc - 0.5) < 0.1, untrained
  for ev in (overfit, untrained, _auc(*features["overfit"]["grad_norm"])):
    assert 0.0 <= ev.auc <= 1.0
    assert 0.0 <= ev.epsilon_lower_bound_all_thresholds < math.inf
  assert _auc(*features["overfit"]["grad_norm"]).auc > 0.75
  assert (
    overfit.epsilon_lower_bound_all_thresholds > untrained.epsilon_lower_bound_all_thresholds + 0.2
  )


def test_dp_training_lowers_the_attack_auc(features):
  eps = epsilon_after_rounds(
    rounds=1,
    noise_multiplier=DP_SIGMA,
    batch_size=DP_BATCH,
    min_client_size=NUM_MEMBERS,
    steps_per_round=STEPS,
    delta=DELTA,
  )
  assert 0.5 < eps < 1.5
  for feature in ("loss", "grad_norm"):
    overfit = _auc(*features["overfit"][feature]).auc
    dp = _auc(*features["dp"][feature]).auc
    assert overfit > dp + 0.2, (feature, overfit, dp)
    assert abs(dp - 0.5) < 0.1, (feature, dp)


def test_audit_model_writes_roc_and_json(apply_fn, models, members, nonmembers, tmp_path):
  audit = pytest.importorskip("experiments.audit")
  result = audit.audit_model(
    apply_fn,
    models["overfit"],
    members,
    nonmembers,
    seed=0,
    out_dir=tmp_path,
    accountant_epsilon=None,
    delta=DELTA,
  )
  for name in ("roc_blackbox.png", "roc_whitebox.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with open(tmp_path / "audit.json") as f:
    loaded = json.load(f)
  assert loaded == json.loads(json.dumps(result))
  assert loaded["counts"] == {
    "member_pool": 64,
    "nonmember_pool": len(nonmembers[1]),
    "train_members": 32,
    "train_nonmembers": 32,
    "audit_members": 32,
    "audit_nonmembers": 32,
  }
  assert loaded["accountant"] == {"dp": False, "epsilon": None, "delta": DELTA}
  assert loaded["model"]["member_accuracy"] == 1.0
  for name in ("blackbox_loss", "whitebox_grad_norm"):
    a = loaded["attacks"][name]
    assert 0.0 <= a["auc"] <= 1.0 and a["sign"] == -1.0
    assert a["auc"] > 0.6, a
    assert set(a["tpr_at_fpr"]) == {"0.001", "0.01"}
    assert 0.0 <= a["epsilon_lower_bound"] <= a["epsilon_lower_bound_max"] < math.inf
    assert a["confidence"] == 0.95 and a["delta"] == DELTA
