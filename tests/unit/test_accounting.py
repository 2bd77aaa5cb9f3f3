"""Tests for fedlap_jax.accounting (host-side RDP accounting)."""

import dataclasses
import json

import pytest

pytest.importorskip("dp_accounting")

from fedlap_jax import accounting  # noqa: E402

# The paper's setting: N_k = 10,000, B = 256, sigma = 1, T = 200, delta = 1e-5.
PAPER = dict(
  noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=200, delta=1e-5
)


def eps_after(rounds, **overrides):
  kw = dict(PAPER, **overrides)
  return accounting.epsilon_after_rounds(rounds=rounds, **kw)


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("rounds,expected", [(1, 2.79), (15, 10.18)])
def test_paper_values(rounds, expected):
  assert eps_after(rounds) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("rounds,expected", [(7, 6.73), (17, 10.93), (27, 14.34)])
def test_figure_values(rounds, expected):
  assert eps_after(rounds) == pytest.approx(expected, abs=0.05)


def test_matches_direct_dp_accounting():
  import dp_accounting
  from dp_accounting import rdp

  acc = rdp.RdpAccountant()
  acc.compose(
    dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.0256, dp_accounting.GaussianDpEvent(1.0)), 200
    ),
    15,
  )
  assert eps_after(15) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_sampling_rates():
  q1, q2 = accounting.sampling_rates(batch_size=256, min_client_size=10_000)
  assert (q1, q2) == (0.0256, 0.0256)
  q1, q2 = accounting.sampling_rates(batch_size=256, min_client_size=10_000, participation=0.5)
  assert q1 == pytest.approx(0.0128) and q2 == pytest.approx(0.0256)


def test_round_event_structure():
  import dp_accounting

  ev = accounting.round_event(
    noise_multiplier=1.0,
    batch_size=256,
    min_client_size=10_000,
    steps_per_round=200,
    participation=0.5,
  )
  assert isinstance(ev, dp_accounting.ComposedDpEvent)
  first, rest = ev.events
  assert first.sampling_probability == pytest.approx(0.0128)
  assert first.event.noise_multiplier == 1.0
  assert rest.count == 199
  assert rest.event.sampling_probability == pytest.approx(0.0256)
  single = accounting.round_event(
    noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=1
  )
  assert len(single.events) == 1


def test_epsilon_accepts_event_or_list():
  ev = accounting.round_event(
    noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=200
  )
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
  events = [
    accounting.round_event(
      noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=t
    )
    for t in (200, 50, 1)
  ]
  assert ledger.steps == [200, 50, 1]
  assert ledger.epsilon == pytest.approx(accounting.epsilon(events, delta=1e-5), rel=1e-9)
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


@pytest.mark.parametrize(
  "field,value",
  [
    ("epsilons", "perturb"),
    ("noise_multiplier", 1.5),
    ("batch_size", 128),
    ("min_client_size", 20_000),
    ("delta", 1e-6),
    ("participation", 0.5),
    ("steps", [200, 100]),
  ],
)
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
    accounting.PrivacyLedger.from_dict({k: v for k, v in d.items() if k != "delta"})
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
  kw = dict(delta=1e-5, rounds=rounds, batch_size=256, min_client_size=10_000, steps_per_round=200)
  sigma = accounting.calibrate_noise_multiplier(target, **kw)
  del kw["rounds"]
  eps = accounting.epsilon_after_rounds(rounds=rounds, noise_multiplier=sigma, **kw)
  assert eps <= target
  assert eps >= 0.99 * target
  if target == 10.18:
    assert sigma == pytest.approx(1.0, abs=0.01)


def test_calibrate_to_a_target_below_the_accountants_last_nonzero_epsilon():
  """Above some sigma the RDP accountant reports epsilon 0 (its bound vanishes at this delta);
  a target below the last nonzero epsilon is met there, not refused with a math error."""
  setting = dict(delta=1e-5, rounds=1, batch_size=64, min_client_size=256, steps_per_round=1)
  sigma = accounting.calibrate_noise_multiplier(1e-6, **setting)
  del setting["delta"]
  assert accounting.epsilon_after_rounds(noise_multiplier=sigma, delta=1e-5, **setting) <= 1e-6
  below = accounting.epsilon_after_rounds(noise_multiplier=sigma / 1.01, delta=1e-5, **setting)
  assert below > 1e-6  # and it is the smallest such sigma, to the search's tolerance


def test_calibrate_unreachable():
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.calibrate_noise_multiplier(
      1e-9, delta=1e-5, rounds=1000, batch_size=256, min_client_size=256, steps_per_round=200
    )


# ---------------------------------------------------------------- validation


VALID = dict(
  noise_multiplier=1.0,
  batch_size=256,
  min_client_size=10_000,
  steps_per_round=200,
  delta=1e-5,
  participation=1.0,
)


@pytest.mark.parametrize(
  "field,value",
  [
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
  ],
)
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
    accounting.round_event(
      noise_multiplier=0.0, batch_size=256, min_client_size=10_000, steps_per_round=200
    )


def test_other_validation_messages():
  with pytest.raises(ValueError, match="batch_size"):
    accounting.sampling_rates(batch_size=0, min_client_size=10)
  with pytest.raises(ValueError, match="min_client_size"):
    accounting.sampling_rates(batch_size=64, min_client_size=32)
  with pytest.raises(ValueError, match="participation"):
    accounting.sampling_rates(batch_size=64, min_client_size=640, participation=-0.1)
  with pytest.raises(ValueError, match="delta"):
    accounting.epsilon([], delta=2.0)
  with pytest.raises(ValueError, match="steps"):
    make_ledger().record_round(steps=0)
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.calibrate_noise_multiplier(
      0.0, delta=1e-5, rounds=1, batch_size=256, min_client_size=10_000, steps_per_round=200
    )
  with pytest.raises(ValueError, match="rounds"):
    accounting.calibrate_noise_multiplier(
      1.0, delta=1e-5, rounds=0, batch_size=256, min_client_size=10_000, steps_per_round=200
    )
  with pytest.raises(ValueError, match="tol"):
    accounting.calibrate_noise_multiplier(
      1.0,
      delta=1e-5,
      rounds=1,
      batch_size=256,
      min_client_size=10_000,
      steps_per_round=200,
      tol=0.0,
    )


def test_package_imports_without_dp_accounting():
  """The package (and the rate arithmetic) works where dp_accounting is missing."""
  import subprocess
  import sys

  code = (
    "import sys; sys.modules['dp_accounting'] = None\n"
    "import fedlap_jax as fl\n"
    "import fedlap_jax.accounting as a\n"
    "assert sys.modules['dp_accounting'] is None\n"
    "print(a.sampling_rates(batch_size=2, min_client_size=4))\n"
  )
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[2]  # the repository
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
  )
  assert "(0.5, 0.5)" in out.stdout


# ---------------------------------------------------------------- replace-one neighbours

# A hybrid FedLAP-DP round on digits: q = 46/274, sigma 2.92, T = 100 (one round), delta 1e-5.
HYBRID = dict(
  noise_multiplier=2.92, batch_size=46, min_client_size=274, steps_per_round=100, delta=1e-5
)


def test_replace_one_and_add_remove_figures_of_the_hybrid_round():
  """Each client's N_k is public, so the guarantee is replace-one: 5.12 against the paper's
  add/remove 2.78 (RDP; 2.54 by PLD) for the same mechanism."""
  import dp_accounting
  from dp_accounting.pld import pld_privacy_accountant

  add_remove = accounting.epsilon_after_rounds(rounds=1, **HYBRID, adjacency="add_remove")
  replace_one = accounting.epsilon_after_rounds(rounds=1, **HYBRID, adjacency="replace_one")
  assert round(add_remove, 2) == 2.78 and round(replace_one, 2) == 5.12
  assert add_remove == accounting.epsilon_after_rounds(rounds=1, **HYBRID)  # the default
  event = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(46 / 274, dp_accounting.GaussianDpEvent(2.92)), 100
  )
  pld = {}
  for rel in ("ADD_OR_REMOVE_ONE", "REPLACE_ONE"):
    acc = pld_privacy_accountant.PLDAccountant(getattr(dp_accounting.NeighboringRelation, rel))
    acc.compose(event)
    pld[rel] = acc.get_epsilon(1e-5)
  assert round(pld["ADD_OR_REMOVE_ONE"], 2) == 2.54
  # dp_accounting's own replace-one PLD on its finer default grid: ours is an upper bound
  # within 1e-4 (pessimistic rounding on a 1e-3 grid).
  assert pld["REPLACE_ONE"] <= replace_one <= pld["REPLACE_ONE"] + 1e-4
  assert replace_one == pytest.approx(
    accounting.epsilon(event, delta=1e-5, adjacency="replace_one"), rel=1e-6
  )


def test_mechanism_reports_replace_one_with_add_remove_beside_it():
  mech = accounting.DpMechanism(
    noise_multiplier=2.92, batch_size=46, steps_per_round=100, delta=1e-5
  )
  assert mech.adjacency == "replace_one" and mech.sampling_rate(274) == 46 / 274
  ledger = mech.ledger(274)
  assert round(ledger.record_round(), 2) == 5.12 == round(ledger.epsilon, 2)
  assert round(ledger.epsilon_add_remove, 2) == 2.78
  assert ledger.epsilon_replace_one == ledger.epsilon
  assert mech.epsilon_after(1, 274) == ledger.epsilon
  assert mech.epsilon_after(1, 274, adjacency="add_remove") == pytest.approx(
    ledger.epsilon_add_remove, rel=1e-12
  )
  back = accounting.PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
  assert back == ledger and back.to_dict()["adjacency"] == "replace_one"
  edited = ledger.to_dict()
  edited["epsilons_add_remove"][0] *= 0.9
  with pytest.raises(ValueError, match="epsilons_add_remove.0.=.* tampered"):
    accounting.PrivacyLedger.from_dict(edited)
  # An add/remove ledger's dict keeps the keys it always had; it reports replace-one on demand.
  paper = make_ledger()
  paper.record_round()
  assert set(paper.to_dict()) == {
    "noise_multiplier",
    "batch_size",
    "min_client_size",
    "steps_per_round",
    "delta",
    "participation",
    "rounds",
    "steps",
    "epsilons",
  }
  assert paper.epsilon_replace_one == pytest.approx(
    make_ledger(adjacency="replace_one").record_round(), rel=1e-12
  )
  assert paper.with_adjacency("replace_one").epsilons == [paper.epsilon_replace_one]


def test_add_remove_rounds_equal_the_rdp_accountant_bit_for_bit():
  """The cached per-rate RDP vectors add up exactly as RdpAccountant composes round events."""
  from dp_accounting import rdp

  ledger = make_ledger(adjacency="replace_one", participation=0.7)
  acc = rdp.RdpAccountant()
  for t in (200, 50, 1, 200):
    ledger.record_round(t)
    acc.compose(
      accounting.round_event(
        noise_multiplier=1.0,
        batch_size=256,
        min_client_size=10_000,
        steps_per_round=t,
        participation=0.7,
      )
    )
    assert ledger.epsilon_add_remove == acc.get_epsilon(1e-5)


def test_replace_one_ledger_composes_all_steps_and_caches_per_rate(monkeypatch):
  """Many rounds stay cheap: one PLD of one step per (q, sigma), then one self-composition of
  all the steps so far per round (cached per rate and step count)."""
  from dp_accounting.pld import privacy_loss_distribution

  accounting._step_pld.cache_clear()
  accounting._replace_one.cache_clear()
  built = []
  real = privacy_loss_distribution.from_gaussian_mechanism

  def counting(**kw):
    built.append((kw["sampling_prob"], kw["standard_deviation"]))
    return real(**kw)

  monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", counting)
  kw = dict(HYBRID, steps_per_round=4, adjacency="replace_one")
  ledger = accounting.PrivacyLedger(**kw)
  for _ in range(30):
    ledger.record_round()
  assert built == [(46 / 274, 2.92)]
  assert ledger.epsilon == accounting.epsilon_after_rounds(rounds=30, **kw)
  again = accounting.PrivacyLedger(**kw, rounds=30)  # the same 30 figures: all cached
  assert again.epsilons == ledger.epsilons and built == [(46 / 274, 2.92)]


def test_calibration_of_either_figure_meets_its_target():
  kw = dict(delta=1e-5, rounds=3, batch_size=46, min_client_size=274, steps_per_round=100)
  for adjacency in ("replace_one", "add_remove"):
    sigma = accounting.calibrate_noise_multiplier(5.0, **kw, adjacency=adjacency)
    eps = accounting.epsilon_after_rounds(noise_multiplier=sigma, adjacency=adjacency, **kw)
    assert 5.0 * (1 - 2e-3) <= eps <= 5.0
  mech = accounting.DpMechanism(
    noise_multiplier=1.0, batch_size=46, steps_per_round=100, delta=1e-5
  )
  assert mech.calibrated(5.0, rounds=3, client_size=274).noise_multiplier == pytest.approx(
    accounting.calibrate_noise_multiplier(5.0, **kw, adjacency="replace_one")
  )


def test_delta_must_stay_below_one_over_the_client_size():
  mech = accounting.DpMechanism(noise_multiplier=1.0, batch_size=46, steps_per_round=1, delta=0.01)
  mech.check_delta(99)
  with pytest.raises(accounting.ConfigError) as err:
    mech.check_delta(100)
  assert (err.value.field, err.value.value) == ("dp.delta", 0.01) and "1/100" in str(err.value)


@pytest.mark.parametrize(
  "build, field, value",
  [
    (lambda: accounting.PrivacyLedger(**dict(VALID, batch_size=2.5)), "batch_size", 2.5),
    (lambda: accounting.PrivacyLedger(**dict(VALID, delta=1.0)), "delta", 1.0),
    (lambda: accounting.PrivacyLedger(**dict(VALID, adjacency="swap")), "adjacency", "swap"),
    (
      lambda: accounting.DpMechanism(
        noise_multiplier=0.0, batch_size=1, steps_per_round=1, delta=1e-5
      ),
      "noise_multiplier",
      0.0,
    ),
    (lambda: accounting.sampling_rates(batch_size=64, min_client_size=32), "min_client_size", 32),
    (lambda: make_ledger().record_round(steps=0), "steps", 0),
  ],
)
def test_accounting_speaks_the_check_vocabulary(build, field, value):
  """Bad inputs are fedlap_jax.checks.ConfigError (a ValueError) naming field, value, allowed."""
  with pytest.raises(accounting.ConfigError) as err:
    build()
  assert (err.value.field, err.value.value) == (field, value) and err.value.allowed
  assert str(err.value).startswith(f"{field}={value!r} is invalid; allowed: ")


def test_participation_amplification_is_documented_unsound_and_no_front_end_uses_it():
  """The paper's q1 = c B / min N_k needs secret participation; here it is public. The module
  says so, DpMechanism has no participation term, and no caller outside the accounting module
  passes one."""
  import ast
  import pathlib

  doc = " ".join(accounting.__doc__.split())
  assert "q1 = c * B / min_k N_k" in doc and "unsound when who takes part is public" in doc
  assert "never uses it" in doc
  assert "participation" not in {f.name for f in dataclasses.fields(accounting.DpMechanism)}
  root = pathlib.Path(accounting.__file__).resolve().parents[1]
  callers = []
  for package in ("fedlap_jax", "experiments", "fedlap_flower", "benchmarks"):
    for path in (root / package).rglob("*.py"):
      if path.name == "accounting.py":
        continue
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and any(k.arg == "participation" for k in node.keywords):
          callers.append(f"{path.relative_to(root)}:{node.lineno}")
  assert callers == []
