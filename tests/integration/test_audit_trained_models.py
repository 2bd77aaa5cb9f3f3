"""Membership inference on trained models (fedlap_jax.auditing): the attack finds the
members of an overfit model, not those of an untrained one, and DP-SGD hides them.

Three ConvNets (width 32, depth 2) on digits, members = 64 training records:
untrained; overfit (100 full-batch SGD steps); and the same 100 steps with
DP-SGD (Poisson rate 1/8, sigma 5, C 0.1: epsilon about 1.1 at delta 1e-5).
The features and the attack alone: ``tests/unit/test_auditing.py``.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import auditing
from fedlap_jax.accounting import epsilon_after_rounds
from fedlap_jax.losses import masked_mean_loss
from fedlap_jax.privacy import clipped_gradient_sum, poisson_capacity, poisson_sample, privatise


NUM_MEMBERS = 64
STEPS = 100
DP_BATCH = 8  # expected Poisson batch: q = 8 / 64
DP_SIGMA = 5.0
DP_CLIP = 0.1
DELTA = 1e-5


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
      clipped, _ = clipped_gradient_sum(
        apply_fn, p, x[b.indices], y[b.indices], b.is_padding, l2_clip_norm=DP_CLIP
      )
      g = privatise(
        k_noise,
        clipped,
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
    adjacency="add_remove",  # the paper's figure
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
