"""Tests for fedlap_jax.accounting (host-side RDP and PLD accounting)."""

import dataclasses
import json

import pytest
from conftest import raises_field

pytest.importorskip("dp_accounting")

from fedlap_jax import accounting  # noqa: E402

# The paper's setting: N_k = 10,000, B = 256, sigma = 1, T = 200, delta = 1e-5. Its figures
# are add/remove ones (RDP), asked for by name: the module's default is replace-one.
PAPER = dict(
  noise_multiplier=1.0,
  batch_size=256,
  min_client_size=10_000,
  steps_per_round=200,
  delta=1e-5,
  adjacency="add_remove",
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


def test_round_event_structure():
  import dp_accounting

  ev = accounting.round_event(
    noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=200
  )
  assert isinstance(ev, dp_accounting.ComposedDpEvent)
  first, rest = ev.events
  assert first.sampling_probability == 0.0256
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
  one = accounting.epsilon(ev, delta=1e-5, adjacency="add_remove")
  three = accounting.epsilon([ev, ev, ev], delta=1e-5, adjacency="add_remove")
  assert one == pytest.approx(eps_after(1), rel=1e-12)
  assert three == pytest.approx(eps_after(3), rel=1e-9)
  assert accounting.epsilon([], delta=1e-5) == 0.0
  # Custom orders are a restriction, so epsilon can only grow.
  assert accounting.epsilon(ev, delta=1e-5, orders=[2.0, 8.0, 32.0], adjacency="add_remove") >= one


def test_zero_rounds_is_zero():
  assert eps_after(0) == 0.0


def test_monotone_in_rounds():
  values = [eps_after(m) for m in (1, 2, 5, 10, 20, 40)]
  assert all(a < b for a, b in zip(values, values[1:]))


def test_larger_sigma_smaller_epsilon():
  values = [eps_after(5, noise_multiplier=s) for s in (0.8, 1.0, 1.5, 3.0)]
  assert all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize(
  "sigma,batch_size,size,steps,rounds",
  [
    (1.0, 256, 10_000, 200, 15),
    (0.9, 64, 274, 8, 10),
    (2.92, 46, 274, 20, 5),
    (7.0, 1, 1000, 1, 1),
  ],
)
def test_add_remove_figure_is_rdp_accountants_bit_for_bit(sigma, batch_size, size, steps, rounds):
  """The add/remove figure, from the cached RDP of one step, is what ``RdpAccountant`` gives
  for the run's steps composed as events; asked again, it computes no RDP."""
  import dp_accounting  # pylint: disable=g-import-not-at-top

  step = dp_accounting.PoissonSampledDpEvent(
    batch_size / size, dp_accounting.GaussianDpEvent(sigma)
  )
  ref = dp_accounting.rdp.RdpAccountant()
  ref.compose(dp_accounting.SelfComposedDpEvent(step, steps * rounds))
  kw = dict(noise_multiplier=sigma, batch_size=batch_size, min_client_size=size, delta=1e-5)
  got = accounting.epsilon_after_rounds(
    rounds=rounds, steps_per_round=steps, adjacency="add_remove", **kw
  )
  assert got == ref.get_epsilon(1e-5)
  misses = accounting._step_rdp.cache_info().misses  # pylint: disable=protected-access
  again = accounting.epsilon_after_rounds(
    rounds=rounds + 1, steps_per_round=steps, adjacency="add_remove", **kw
  )
  assert accounting._step_rdp.cache_info().misses == misses  # pylint: disable=protected-access
  assert again > got


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
  rdp = dict(delta=1e-5, adjacency="add_remove")
  assert ledger.epsilon == pytest.approx(accounting.epsilon(events, **rdp), rel=1e-9)
  # RDP composition is tighter than adding epsilons.
  separate = sum(accounting.epsilon(e, **rdp) for e in events)
  assert ledger.epsilon < separate


def test_ledger_round_trip_json():
  ledger = make_ledger()
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
  with raises_field("ledger"):
    accounting.PrivacyLedger.from_dict({k: v for k, v in d.items() if k != "delta"})
  with raises_field("ledger"):
    accounting.PrivacyLedger.from_dict(dict(d, extra=1))
  with raises_field("rounds"):
    accounting.PrivacyLedger.from_dict(dict(d, rounds=2))


def test_privacy_fields():
  ledger = make_ledger()
  ledger.record_round()
  assert ledger.privacy_fields() == PAPER
  assert accounting.PrivacyLedger(**ledger.privacy_fields()) == make_ledger()


def test_ledger_resume_from_rounds_only():
  ledger = make_ledger(rounds=3)
  assert ledger.steps == [200] * 3
  assert ledger.epsilon == pytest.approx(eps_after(3), rel=1e-9)


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize("target,rounds", [(10.18, 15), (3.0, 5), (8.0, 30)])
def test_calibrate_round_trip(target, rounds):
  kw = dict(
    delta=1e-5,
    rounds=rounds,
    batch_size=256,
    min_client_size=10_000,
    steps_per_round=200,
    adjacency="add_remove",
  )
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
  setting = dict(
    delta=1e-5,
    rounds=1,
    batch_size=64,
    min_client_size=256,
    steps_per_round=1,
    adjacency="add_remove",
  )
  sigma = accounting.calibrate_noise_multiplier(1e-6, **setting)
  del setting["delta"]
  assert accounting.epsilon_after_rounds(noise_multiplier=sigma, delta=1e-5, **setting) <= 1e-6
  below = accounting.epsilon_after_rounds(noise_multiplier=sigma / 1.01, delta=1e-5, **setting)
  assert below > 1e-6  # and it is the smallest such sigma, to the search's tolerance


def test_calibrate_unreachable():
  # 10 rounds of 200 steps at q = 1: even sigma = 1e6 gives epsilon 0.004 >> 1e-9, so the
  # search doubles sigma up to the bound and refuses. (1,000 rounds refuse the same way, with
  # 0.05, but each of the ~20 accountant calls composes 200,000 steps: 26 s instead of 2 s.)
  with raises_field("target_epsilon"):
    accounting.calibrate_noise_multiplier(
      1e-9, delta=1e-5, rounds=10, batch_size=256, min_client_size=256, steps_per_round=200
    )


# ---------------------------------------------------------------- validation


VALID = dict(
  noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=200, delta=1e-5
)


@pytest.mark.parametrize(
  "field,value",
  [
    ("noise_multiplier", 0.0),
    ("noise_multiplier", -1.0),
    ("noise_multiplier", float("nan")),
    ("noise_multiplier", 0.299),
    ("batch_size", 0),
    ("batch_size", 2.5),
    ("min_client_size", 100),
    ("steps_per_round", 0),
    ("delta", 0.0),
    ("delta", 1.0),
    ("delta", 1e-4),  # = 1 / N_k
    ("rounds", -1),
  ],
)
def test_validation_names_field(field, value):
  kw = dict(VALID, rounds=1)
  kw[field] = value
  with raises_field(field) as e:
    accounting.epsilon_after_rounds(**kw)
  assert repr(value) in str(e.value)
  ledger_kw = {k: v for k, v in kw.items()}
  ledger_kw["rounds"] = kw["rounds"] if field == "rounds" else 0
  with raises_field(field):
    accounting.PrivacyLedger(**ledger_kw)


def test_sigma_zero_says_guarantee_void():
  with raises_field("noise_multiplier"):
    accounting.round_event(
      noise_multiplier=0.0, batch_size=256, min_client_size=10_000, steps_per_round=200
    )


def test_other_validation_messages():
  with raises_field("batch_size"):
    accounting.round_event(
      noise_multiplier=1.0, batch_size=0, min_client_size=10, steps_per_round=1
    )
  with raises_field("min_client_size"):
    accounting.round_event(
      noise_multiplier=1.0, batch_size=64, min_client_size=32, steps_per_round=1
    )
  with raises_field("delta"):
    accounting.epsilon([], delta=2.0)
  with raises_field("steps"):
    make_ledger().record_round(steps=0)
  with raises_field("target_epsilon"):
    accounting.calibrate_noise_multiplier(
      0.0, delta=1e-5, rounds=1, batch_size=256, min_client_size=10_000, steps_per_round=200
    )
  with raises_field("rounds"):
    accounting.calibrate_noise_multiplier(
      1.0, delta=1e-5, rounds=0, batch_size=256, min_client_size=10_000, steps_per_round=200
    )
  with raises_field("tol"):
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
    "print(a.DpMechanism(1.0, 2, 1, 1e-5).sampling_rate(4))\n"
  )
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[2]  # the repository
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
  )
  assert "0.5" in out.stdout


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
  assert replace_one == accounting.epsilon_after_rounds(rounds=1, **HYBRID)  # the default
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

  ledger = make_ledger(adjacency="replace_one")
  acc = rdp.RdpAccountant()
  for t in (200, 50, 1, 200):
    ledger.record_round(t)
    acc.compose(
      accounting.round_event(
        noise_multiplier=1.0, batch_size=256, min_client_size=10_000, steps_per_round=t
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
  kw = dict(HYBRID, steps_per_round=4)
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


@pytest.mark.parametrize("adjacency", ["replace_one", "add_remove"])
def test_the_ledger_of_a_calibrated_run_ends_within_its_target(adjacency):
  """What a run is charged, not only what the calibration computed: the ledger of the
  calibrated sigma, every noisy step of every round recorded (in round events, as a run
  records them), ends at or below the target, at the calibration's own figure."""
  kw = dict(delta=1e-5, batch_size=46, min_client_size=274, steps_per_round=20)
  sigma = accounting.calibrate_noise_multiplier(5.0, rounds=5, **kw, adjacency=adjacency)
  ledger = accounting.PrivacyLedger(noise_multiplier=sigma, **kw, adjacency=adjacency)
  for _ in range(5):
    ledger.record_round()
  assert ledger.steps == [20] * 5
  planned = accounting.epsilon_after_rounds(
    rounds=5, noise_multiplier=sigma, **kw, adjacency=adjacency
  )
  assert 5.0 * (1 - 2e-3) <= ledger.epsilon <= 5.0
  assert ledger.epsilon == pytest.approx(planned, rel=1e-12)


def test_delta_must_stay_below_one_over_the_client_size():
  mech = accounting.DpMechanism(noise_multiplier=1.0, batch_size=46, steps_per_round=1, delta=0.01)
  mech.check_delta(99)
  with pytest.raises(accounting.ConfigError) as err:
    mech.check_delta(100)
  assert (err.value.field, err.value.value) == ("dp.delta", 0.01) and "1/100" in str(err.value)
  # Every accounting of a client refuses it, before computing anything.
  mech.ledger(99)
  for account in (
    lambda: mech.ledger(100),
    lambda: mech.client_ledgers([99, 100]),
    lambda: mech.epsilon_after(1, 100),
    lambda: mech.calibrated(5.0, rounds=1, client_size=100),
  ):
    with pytest.raises(accounting.ConfigError) as err:
      account()
    assert (err.value.field, err.value.value) == ("delta", 0.01) and "1/100" in str(err.value)


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
    (lambda: accounting.DpMechanism(1.0, 64, 1, 1e-5).sampling_rate(32), "client_size", 32),
    (lambda: accounting.DpMechanism(0.1, 1, 1, 1e-5).ledger(10), "noise_multiplier", 0.1),
    (lambda: make_ledger().record_round(steps=0), "steps", 0),
  ],
)
def test_accounting_speaks_the_check_vocabulary(build, field, value):
  """Bad inputs are fedlap_jax.checks.ConfigError (a ValueError) naming field, value, allowed."""
  with pytest.raises(accounting.ConfigError) as err:
    build()
  assert (err.value.field, err.value.value) == (field, value) and err.value.allowed
  assert str(err.value).startswith(f"{field}={value!r} is invalid; allowed: ")


def test_participation_amplification_is_documented_unsound_and_nothing_takes_it():
  """The paper's q1 = c B / min N_k needs secret participation; here it is public. The module
  says so, and no function, mechanism or ledger takes a participation term."""
  import inspect

  doc = " ".join(accounting.__doc__.split())
  assert "q1 = c * B / min_k N_k" in doc and "unsound when who takes part is public" in doc
  assert "never uses it" in doc
  assert "participation" not in {f.name for f in dataclasses.fields(accounting.DpMechanism)}
  for fn in (
    accounting.round_event,
    accounting.epsilon_after_rounds,
    accounting.calibrate_noise_multiplier,
    accounting.PrivacyLedger,
  ):
    assert "participation" not in inspect.signature(fn).parameters, fn
  with raises_field("PrivacyLedger"):
    accounting.PrivacyLedger(**VALID, participation=0.5)


# ---------------------------------------------------------------- hard to misuse


def test_one_default_neighbour_relation_everywhere():
  """sigma 1, B 32, T 8, delta 1e-4, N 300, 3 rounds: every entry point gives the replace-one
  figure unless add/remove is asked for by name (a27beca: 4.479 from the mechanism, 3.948 from
  epsilon_after_rounds, the ledger and the calibration)."""
  kw = dict(noise_multiplier=1.0, batch_size=32, steps_per_round=8, delta=1e-4)
  mech = accounting.DpMechanism(**kw)
  ledger = accounting.PrivacyLedger(**kw, min_client_size=300)
  for _ in range(3):
    ledger.record_round()
  by_mechanism = mech.epsilon_after(3, 300)
  by_function = accounting.epsilon_after_rounds(rounds=3, min_client_size=300, **kw)
  by_events = accounting.epsilon(
    [accounting.round_event(min_client_size=300, **{k: kw[k] for k in kw if k != "delta"})] * 3,
    delta=1e-4,
  )
  assert round(by_mechanism, 3) == 4.479
  assert (
    by_function
    == by_mechanism
    == ledger.epsilon
    == mech.ledger(300).with_adjacency("replace_one").epsilon_after(24)
  )
  assert by_events == pytest.approx(by_mechanism, rel=1e-6)
  add_remove = accounting.epsilon_after_rounds(
    rounds=3, min_client_size=300, adjacency="add_remove", **kw
  )
  assert round(add_remove, 3) == 3.948 and ledger.epsilon_add_remove == pytest.approx(add_remove)
  calibrated = accounting.calibrate_noise_multiplier(
    by_mechanism, rounds=3, min_client_size=300, **{k: kw[k] for k in kw if k != "noise_multiplier"}
  )
  assert calibrated == pytest.approx(1.0, rel=2e-3)  # the replace-one figure was calibrated


def _no_accounting(monkeypatch):
  """Makes every PLD and RDP computation fail: what is refused must be refused before them."""
  from dp_accounting.pld import privacy_loss_distribution
  from dp_accounting.rdp import rdp_privacy_accountant

  def fail(*args, **kwargs):
    raise AssertionError("accounting ran")

  accounting._step_pld.cache_clear()
  accounting._step_rdp.cache_clear()
  accounting._replace_one.cache_clear()
  accounting._replace_one_lower.cache_clear()
  monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", fail)
  monkeypatch.setattr(rdp_privacy_accountant, "_compute_rdp_poisson_subsampled_gaussian", fail)


def test_a_noise_multiplier_below_the_floor_is_refused_before_any_accounting(monkeypatch):
  """sigma 0.001, B 32, N 1,000, T 1 took 17 GB and minutes in one replace-one PLD."""
  import dp_accounting

  _no_accounting(monkeypatch)
  mech = accounting.DpMechanism(
    noise_multiplier=0.001, batch_size=32, steps_per_round=1, delta=1e-5
  )
  calls = [
    lambda: mech.ledger(1000),
    lambda: mech.client_ledgers([1000, 2000]),
    lambda: mech.epsilon_after(1, 1000),
    lambda: mech.epsilon_after(1, 1000, adjacency="add_remove"),
    lambda: accounting.PrivacyLedger(**dataclasses.asdict(mech), min_client_size=1000),
    lambda: accounting.epsilon_after_rounds(
      rounds=1, min_client_size=1000, **dataclasses.asdict(mech)
    ),
    lambda: accounting.epsilon(
      dp_accounting.PoissonSampledDpEvent(0.032, dp_accounting.GaussianDpEvent(0.001)), delta=1e-5
    ),
  ]
  for call in calls:
    with pytest.raises(accounting.ConfigError) as err:
      call()
    assert "noise_multiplier" in err.value.field and err.value.value == 0.001
    assert f"MIN_NOISE_MULTIPLIER = {accounting.MIN_NOISE_MULTIPLIER:g}" in str(err.value)
  with raises_field("max_noise_multiplier"):
    accounting.calibrate_noise_multiplier(
      1.0,
      delta=1e-5,
      rounds=1,
      batch_size=32,
      min_client_size=1000,
      steps_per_round=1,
      max_noise_multiplier=0.2,
    )
  # A mechanism may still declare it (tests of the mechanism's arithmetic do).
  assert mech.noise_multiplier == 0.001


def test_calibration_never_goes_below_the_floor():
  """A target the floor already meets gets the floor (a27beca returned 0.125 here)."""
  kw = dict(delta=1e-5, rounds=1, batch_size=1, min_client_size=10_000, steps_per_round=1)
  sigma = accounting.calibrate_noise_multiplier(1e3, **kw)
  assert sigma == accounting.MIN_NOISE_MULTIPLIER
  # Just above the floor's epsilon, the smallest sigma above the floor.
  at_floor = accounting.epsilon_after_rounds(noise_multiplier=0.3, **kw)
  sigma = accounting.calibrate_noise_multiplier(0.5 * at_floor, **kw)
  assert 0.3 < sigma and accounting.epsilon_after_rounds(noise_multiplier=sigma, **kw) <= (
    0.5 * at_floor
  )


@pytest.mark.parametrize(
  "q, sigma, steps",
  [
    (46 / 274, 2.92, 100),  # the pinned hybrid round
    (0.0256, 1.0, 200),
    (1.0, 0.3, 50),  # the floor at the costliest rate
    (0.5, 0.5, 1000),
    (0.01, 0.3, 1),
    (0.2, 5.0, 3000),
  ],
)
def test_the_lower_bound_is_below_the_headline(q, sigma, steps):
  """The optimistic coarse PLD bounds the pessimistic headline from below (both estimate the
  same hockey-stick divergence, rounding the losses down and up)."""
  n = 10_000
  mech = accounting.DpMechanism(
    noise_multiplier=sigma, batch_size=round(q * n), steps_per_round=steps, delta=1e-5
  )
  ledger = mech.ledger(n)
  lower, headline = ledger.epsilon_lower_bound_after(), ledger.epsilon_after()
  assert 0.0 <= lower <= headline
  assert headline == mech.epsilon_after(1, n) and ledger.rounds == 0  # nothing recorded
  # An add/remove headline is its own (cheap) bound.
  rdp = ledger.with_adjacency("add_remove")
  assert (
    rdp.epsilon_lower_bound_after()
    == rdp.epsilon_after()
    == mech.epsilon_after(1, n, adjacency="add_remove")
  )


def test_the_lower_bound_never_builds_the_headline_pld(monkeypatch):
  """A far exceeded budget is seen without the (costly) pessimistic PLD: at the floor, q = 1
  and 20,000 steps the bound is already far above any budget."""
  from dp_accounting.pld import privacy_loss_distribution

  real = privacy_loss_distribution.from_gaussian_mechanism
  built = []

  def only_optimistic(**kw):
    built.append(kw.get("pessimistic_estimate", True))
    assert built[-1] is False, "the pessimistic PLD was built"
    return real(**kw)

  accounting._step_pld.cache_clear()
  monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", only_optimistic)
  mech = accounting.DpMechanism(
    noise_multiplier=0.3, batch_size=64, steps_per_round=20_000, delta=1e-5
  )
  assert mech.ledger(64).epsilon_lower_bound_after() > 1e5
  assert built == [False]


# Ledgers as a27beca wrote them (to_dict()), in checkpoints and Flower state directories.
OLD_REPLACE_ONE = {
  "noise_multiplier": 2.92,
  "batch_size": 46,
  "min_client_size": 274,
  "steps_per_round": 100,
  "delta": 1e-05,
  "participation": 1.0,
  "adjacency": "replace_one",
  "rounds": 2,
  "steps": [100, 50],
  "epsilons": [5.116290744310726, 6.492618901217047],
  "epsilons_add_remove": [2.7771056769704963, 3.4439975638758122],
}
OLD_ADD_REMOVE = {
  "noise_multiplier": 1.0,
  "batch_size": 256,
  "min_client_size": 10000,
  "steps_per_round": 200,
  "delta": 1e-05,
  "participation": 1.0,
  "rounds": 2,
  "steps": [200, 120],
  "epsilons": [2.7866439426422334, 3.3427600812789358],
}
OLD_CLIENTS = {
  "clients": [
    dict(
      noise_multiplier=1.5,
      batch_size=32,
      min_client_size=size,
      steps_per_round=10,
      delta=1e-05,
      participation=1.0,
      adjacency="replace_one",
      rounds=len(steps),
      steps=steps,
      epsilons=eps,
      epsilons_add_remove=eps_ar,
    )
    for size, steps, eps, eps_ar in [
      (300, [10], [1.9453676419530521], [1.6433041979287477]),
      (
        375,
        [10, 5],
        [1.5418570251693593, 1.8680892481621474],
        [1.3494113952328814, 1.528425270770348],
      ),
      (300, [5], [1.4291045426969387], [1.3500338358985942]),
    ]
  ],
  "participants": [[0, 1], [1, 2]],
}


def test_ledgers_stored_by_earlier_versions_load_with_their_figures():
  # Loading recomputes every figure and accepts it within 1e-9 (other NumPy / SciPy builds
  # differ in the tenth digit).
  new = accounting.PrivacyLedger.from_dict(json.loads(json.dumps(OLD_REPLACE_ONE)))
  assert new.adjacency == "replace_one"
  assert new.epsilons == pytest.approx(OLD_REPLACE_ONE["epsilons"], rel=1e-9)
  assert round(new.epsilons[0], 4) == 5.1163 and round(new.epsilons_add_remove[0], 4) == 2.7771
  assert new.mechanism == accounting.DpMechanism(2.92, 46, 100, 1e-5) and new.client_size == 274
  old = accounting.PrivacyLedger.from_dict(OLD_ADD_REMOVE)
  assert old.adjacency == "add_remove"
  assert old.epsilons == pytest.approx(OLD_ADD_REMOVE["epsilons"], rel=1e-9)
  assert round(old.epsilons[0], 4) == 2.7866
  clients = accounting.ClientLedgers.from_dict(OLD_CLIENTS)
  assert clients.epsilons == pytest.approx(
    [1.9453676419530521, 1.8680892481621474, 1.4291045426969387], rel=1e-9
  )
  # What they write now: the same keys, less the participation they never used.
  assert set(new.to_dict()) == set(OLD_REPLACE_ONE) - {"participation"}
  assert set(old.to_dict()) == set(OLD_ADD_REMOVE) - {"participation"}
  assert new.to_dict()["steps"] == [100, 50] and old.to_dict()["min_client_size"] == 10000
  # A stored participation other than 1 cannot be composed here.
  with pytest.raises(accounting.ConfigError) as err:
    accounting.PrivacyLedger.from_dict(dict(OLD_ADD_REMOVE, participation=0.7))
  assert (err.value.field, err.value.value) == ("participation", 0.7)


def test_a_ledger_holds_its_mechanism_and_client_size_only():
  mech = accounting.DpMechanism(
    noise_multiplier=2.92, batch_size=46, steps_per_round=100, delta=1e-5
  )
  ledger = mech.ledger(274)
  assert ledger.mechanism is mech and ledger.client_size == ledger.min_client_size == 274
  assert (ledger.noise_multiplier, ledger.batch_size, ledger.steps_per_round) == (2.92, 46, 100)
  assert (ledger.delta, ledger.adjacency) == (1e-5, "replace_one")
  assert (
    accounting.PrivacyLedger(mech, 274)
    == ledger
    == accounting.PrivacyLedger(**ledger.privacy_fields())
  )
  with pytest.raises(AttributeError):
    ledger.noise_multiplier = 1.0
  ledger.steps.append(5)  # a copy: the record cannot be edited from outside
  assert ledger.steps == [] and ledger.rounds == 0
  with raises_field("mechanism"):
    accounting.PrivacyLedger(mech, 274, delta=1e-6)
  other = dataclasses.replace(mech, noise_multiplier=3.0)
  with raises_field("ledgers"):
    accounting.ClientLedgers([mech.ledger(274), other.ledger(274)])


def test_both_ledger_types_record_a_round_with_the_same_call():
  mech = accounting.DpMechanism(noise_multiplier=1.0, batch_size=32, steps_per_round=8, delta=1e-4)
  single, many = mech.ledger(300), mech.client_ledgers([300, 400])
  for ledger in (single, many):
    ledger.record_round()
    ledger.record_round(4, participants=[0, 1])
    ledger.record_round(steps=2, participants=[1])
    with raises_field("participants"):
      ledger.record_round(participants=[1, 1])
    with raises_field("steps"):
      ledger.record_round(0)
  assert single.steps == many.ledgers[1].steps == [8, 4, 2] and many.ledgers[0].steps == [8, 4]
  assert single.epsilon == mech.ledger(300).with_adjacency("replace_one").epsilon_after(14)


def test_every_method_config_declares_its_mechanism():
  """T and B come from the method's config through one classmethod, never copied by hand."""
  from fedlap_jax import baselines
  from fedlap_jax import dp_config
  from fedlap_jax.methods.fedlap import config
  from fedlap_jax.methods.condensation import one_shot as condensation
  from fedlap_jax.methods.feddm import distribution_matching as feddm

  dp = dp_config.DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
  fedlap = config.paper_dp_config()
  assert accounting.DpMechanism.from_config(fedlap) == accounting.DpMechanism(
    noise_multiplier=1.0, batch_size=256, steps_per_round=4 * 5 * 10, delta=1e-5
  )
  assert accounting.DpMechanism.from_config(fedlap.client) == accounting.DpMechanism.from_config(
    fedlap
  )
  assert accounting.DpMechanism.from_config(config.paper_nondp_config()) is None
  common = dict(rounds=2, learning_rate=0.1, batch_size=50, max_client_size=1000)
  base = baselines.baseline_config("dp_fedavg", dp=dp, **common)
  mech = accounting.DpMechanism.from_config(base)
  assert (mech.batch_size, mech.steps_per_round) == (50, 5 * 20)  # E * round(N_max / B)
  plain = baselines.baseline_config("fedavg", dp=None, **common)
  assert accounting.DpMechanism.from_config(plain) is None
  psg = condensation.OneShotConfig(
    method="psg",
    condensation=condensation.CondensationConfig(
      networks=3, outer_loop=2, batch_loop=4, classwise=False, batch_size=64, dp=dp
    ),
  )
  mech = accounting.DpMechanism.from_config(psg)
  assert (mech.batch_size, mech.steps_per_round, mech.delta) == (64, 3 * 2 * 4, 1e-5)
  assert accounting.DpMechanism.from_config(feddm.FedDMConfig()) is None
  with pytest.raises(accounting.ConfigError) as err:
    accounting.DpMechanism.from_config(dp)
  assert (err.value.field, err.value.value) == ("config", "DPConfig")
