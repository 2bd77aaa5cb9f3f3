"""Tests for fedlap_jax.accounting (host-side RDP accounting)."""

import json
import math

import pytest

pytest.importorskip("dp_accounting")

from fedlap_jax import accounting  # noqa: E402

# The paper's setting: N_k = 10,000, B = 256, sigma = 1, T = 200, delta = 1e-5.
PAPER = dict(noise_multiplier=1.0, batch_size=256, min_client_size=10_000,
             steps_per_round=200, delta=1e-5)


def eps_after(rounds, **overrides):
  kw = dict(PAPER, **overrides)
  return accounting.epsilon_after_rounds(rounds=rounds, **kw)


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("rounds,expected", [(1, 2.79), (15, 10.18)])
def test_paper_values(rounds, expected):
  assert eps_after(rounds) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("rounds,expected",
                         [(7, 6.73), (17, 10.93), (27, 14.34)])
def test_figure_values(rounds, expected):
  assert eps_after(rounds) == pytest.approx(expected, abs=0.05)


def test_matches_direct_dp_accounting():
  import dp_accounting
  from dp_accounting import rdp
  acc = rdp.RdpAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          0.0256, dp_accounting.GaussianDpEvent(1.0)), 200), 15)
  assert eps_after(15) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_sampling_rates():
  q1, q2 = accounting.sampling_rates(batch_size=256, min_client_size=10_000)
  assert (q1, q2) == (0.0256, 0.0256)
  q1, q2 = accounting.sampling_rates(batch_size=256, min_client_size=10_000,
                                     participation=0.5)
  assert q1 == pytest.approx(0.0128) and q2 == pytest.approx(0.0256)


def test_round_event_structure():
  import dp_accounting
  ev = accounting.round_event(noise_multiplier=1.0, batch_size=256,
                              min_client_size=10_000, steps_per_round=200,
                              participation=0.5)
  assert isinstance(ev, dp_accounting.ComposedDpEvent)
  first, rest = ev.events
  assert first.sampling_probability == pytest.approx(0.0128)
  assert first.event.noise_multiplier == 1.0
  assert rest.count == 199
  assert rest.event.sampling_probability == pytest.approx(0.0256)
  single = accounting.round_event(noise_multiplier=1.0, batch_size=256,
                                  min_client_size=10_000, steps_per_round=1)
  assert len(single.events) == 1


def test_epsilon_accepts_event_or_list():
  ev = accounting.round_event(noise_multiplier=1.0, batch_size=256,
                              min_client_size=10_000, steps_per_round=200)
  one = accounting.epsilon(ev, delta=1e-5)
  three = accounting.epsilon([ev, ev, ev], delta=1e-5)
  assert one == pytest.approx(eps_after(1), rel=1e-12)
  assert three == pytest.approx(eps_after(3), rel=1e-9)
  assert accounting.epsilon([], delta=1e-5) == 0.0
  # Custom orders are a restriction, so epsilon can only grow.
  assert accounting.epsilon(ev, delta=1e-5, orders=[2.0, 8.0, 32.0]) >= one


def test_zero_rounds_is_zero():
  assert eps_after(0) == 0.0


def test_monotone_in_rounds():
  values = [eps_after(m) for m in (1, 2, 5, 10, 20, 40)]
  assert all(a < b for a, b in zip(values, values[1:]))


def test_larger_sigma_smaller_epsilon():
  values = [eps_after(5, noise_multiplier=s) for s in (0.8, 1.0, 1.5, 3.0)]
  assert all(a > b for a, b in zip(values, values[1:]))


def test_participation_lowers_epsilon():
  full = eps_after(5)
  half = eps_after(5, participation=0.5)
  tenth = eps_after(5, participation=0.1)
  assert tenth < half < full


# ---------------------------------------------------------------- ledger


def make_ledger(**overrides):
  return accounting.PrivacyLedger(**dict(PAPER, **overrides))


def test_ledger_matches_epsilon_after_rounds():
  ledger = make_ledger()
  assert ledger.epsilon == 0.0 and ledger.rounds == 0
  for m in range(1, 16):
    eps = ledger.record_round()
    assert eps == ledger.epsilon == ledger.epsilons[-1]
    assert eps == pytest.approx(eps_after(m), rel=1e-9)
  assert ledger.rounds == 15 and ledger.steps == [200] * 15
  assert ledger.epsilon == pytest.approx(10.18, abs=0.01)


def test_ledger_variable_steps_composes_in_rdp():
  ledger = make_ledger()
  ledger.record_round()
  ledger.record_round(steps=50)
  ledger.record_round(steps=1)
  events = [accounting.round_event(
      noise_multiplier=1.0, batch_size=256, min_client_size=10_000,
      steps_per_round=t) for t in (200, 50, 1)]
  assert ledger.steps == [200, 50, 1]
  assert ledger.epsilon == pytest.approx(
      accounting.epsilon(events, delta=1e-5), rel=1e-9)
  # RDP composition is tighter than adding epsilons.
  separate = sum(accounting.epsilon(e, delta=1e-5) for e in events)
  assert ledger.epsilon < separate


def test_ledger_round_trip_json():
  ledger = make_ledger(participation=0.7)
  ledger.record_round()
  ledger.record_round(steps=120)
  ledger.record_round()
  d = json.loads(json.dumps(ledger.to_dict()))
  restored = accounting.PrivacyLedger.from_dict(d)
  assert restored == ledger
  assert restored.to_dict() == ledger.to_dict()
  assert restored.epsilons == ledger.epsilons  # exact
  # A restored ledger keeps composing exactly like the original.
  assert restored.record_round() == ledger.record_round()
  empty = accounting.PrivacyLedger.from_dict(make_ledger().to_dict())
  assert empty.epsilon == 0.0 and empty.rounds == 0


@pytest.mark.parametrize("field,value", [
    ("epsilons", "perturb"),
    ("noise_multiplier", 1.5),
    ("batch_size", 128),
    ("min_client_size", 20_000),
    ("delta", 1e-6),
    ("participation", 0.5),
    ("steps", [200, 100]),
])
def test_ledger_tamper_detected(field, value):
  ledger = make_ledger()
  ledger.record_round()
  ledger.record_round()
  d = ledger.to_dict()
  if value == "perturb":
    d["epsilons"] = [d["epsilons"][0], d["epsilons"][1] * (1 - 1e-6)]
  else:
    d[field] = value
  with pytest.raises(ValueError, match="tampered"):
    accounting.PrivacyLedger.from_dict(d)


def test_ledger_from_dict_rejects_bad_keys_and_lengths():
  ledger = make_ledger()
  ledger.record_round()
  d = ledger.to_dict()
  with pytest.raises(ValueError, match="missing"):
    accounting.PrivacyLedger.from_dict({k: v for k, v in d.items()
                                        if k != "delta"})
  with pytest.raises(ValueError, match="unknown"):
    accounting.PrivacyLedger.from_dict(dict(d, extra=1))
  with pytest.raises(ValueError, match="rounds"):
    accounting.PrivacyLedger.from_dict(dict(d, rounds=2))


def test_privacy_fields():
  ledger = make_ledger()
  ledger.record_round()
  assert ledger.privacy_fields() == dict(PAPER, participation=1.0)


def test_ledger_resume_from_rounds_only():
  ledger = make_ledger(rounds=3)
  assert ledger.steps == [200] * 3
  assert ledger.epsilon == pytest.approx(eps_after(3), rel=1e-9)


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize("target,rounds", [(10.18, 15), (3.0, 5), (8.0, 30)])
def test_calibrate_round_trip(target, rounds):
  kw = dict(delta=1e-5, rounds=rounds, batch_size=256, min_client_size=10_000,
            steps_per_round=200)
  sigma = accounting.calibrate_noise_multiplier(target, **kw)
  del kw["rounds"]
  eps = accounting.epsilon_after_rounds(rounds=rounds, noise_multiplier=sigma,
                                        **kw)
  assert eps <= target
  assert eps >= 0.99 * target
  if target == 10.18:
    assert sigma == pytest.approx(1.0, abs=0.01)


def test_calibrate_unreachable():
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.calibrate_noise_multiplier(
        1e-9, delta=1e-5, rounds=1000, batch_size=256, min_client_size=256,
        steps_per_round=200)


# ---------------------------------------------------------------- validation


VALID = dict(noise_multiplier=1.0, batch_size=256, min_client_size=10_000,
             steps_per_round=200, delta=1e-5, participation=1.0)


@pytest.mark.parametrize("field,value", [
    ("noise_multiplier", 0.0),
    ("noise_multiplier", -1.0),
    ("noise_multiplier", float("nan")),
    ("batch_size", 0),
    ("batch_size", 2.5),
    ("min_client_size", 100),
    ("steps_per_round", 0),
    ("delta", 0.0),
    ("delta", 1.0),
    ("participation", 0.0),
    ("participation", 1.5),
    ("rounds", -1),
])
def test_validation_names_field(field, value):
  kw = dict(VALID, rounds=1)
  kw[field] = value
  with pytest.raises(ValueError) as e:
    accounting.epsilon_after_rounds(**kw)
  assert field in str(e.value) and repr(value) in str(e.value)
  ledger_kw = {k: v for k, v in kw.items()}
  ledger_kw["rounds"] = kw["rounds"] if field == "rounds" else 0
  with pytest.raises(ValueError, match=field):
    accounting.PrivacyLedger(**ledger_kw)


def test_sigma_zero_says_guarantee_void():
  with pytest.raises(ValueError, match="void"):
    accounting.round_event(noise_multiplier=0.0, batch_size=256,
                           min_client_size=10_000, steps_per_round=200)


def test_other_validation_messages():
  with pytest.raises(ValueError, match="batch_size"):
    accounting.sampling_rates(batch_size=0, min_client_size=10)
  with pytest.raises(ValueError, match="min_client_size"):
    accounting.sampling_rates(batch_size=64, min_client_size=32)
  with pytest.raises(ValueError, match="participation"):
    accounting.sampling_rates(batch_size=64, min_client_size=640,
                              participation=-0.1)
  with pytest.raises(ValueError, match="delta"):
    accounting.epsilon([], delta=2.0)
  with pytest.raises(ValueError, match="steps"):
    make_ledger().record_round(steps=0)
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.calibrate_noise_multiplier(
        0.0, delta=1e-5, rounds=1, batch_size=256, min_client_size=10_000,
        steps_per_round=200)
  with pytest.raises(ValueError, match="rounds"):
    accounting.calibrate_noise_multiplier(
        1.0, delta=1e-5, rounds=0, batch_size=256, min_client_size=10_000,
        steps_per_round=200)
  with pytest.raises(ValueError, match="tol"):
    accounting.calibrate_noise_multiplier(
        1.0, delta=1e-5, rounds=1, batch_size=256, min_client_size=10_000,
        steps_per_round=200, tol=0.0)


def test_package_imports_without_dp_accounting():
  """The package (and the rate arithmetic) works where dp_accounting is missing."""
  import subprocess
  import sys
  code = (
      "import sys; sys.modules['dp_accounting'] = None\n"
      "import fedlap_jax as fl\n"
      "import fedlap_jax.accounting as a\n"
      "assert sys.modules['dp_accounting'] is None\n"
      "print(a.sampling_rates(batch_size=2, min_client_size=4))\n")
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], cwd=root,
                       capture_output=True, text=True, check=True)
  assert "(0.5, 0.5)" in out.stdout
