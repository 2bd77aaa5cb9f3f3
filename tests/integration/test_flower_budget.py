"""A Flower client's budget check: what a noise multiplier below the floor or a far exceeded
``max-epsilon`` costs the client (:meth:`fedlap_flower.ledger.ClientState.spend`)."""

from __future__ import annotations

import pytest
from conftest import raises_field

pytest.importorskip("dp_accounting")

from fedlap_flower import ledger as ledger_lib  # noqa: E402
from fedlap_jax import accounting  # noqa: E402

FINGERPRINT = {"data": "partition", "index": 0, "num_records": 1000}


def test_a_noise_multiplier_below_the_floor_never_reaches_the_accountant(tmp_path):
  """sigma 0.001 (a run config override) took a fresh client to 17 GB in one PLD."""
  state = ledger_lib.ClientState(tmp_path / "c0")
  privacy = dict(  # what the client app passes (mechanism.ledger(N_k).privacy_fields())
    noise_multiplier=0.001,
    batch_size=32,
    min_client_size=1000,
    steps_per_round=1,
    delta=1e-5,
    adjacency="replace_one",
  )
  with raises_field("noise_multiplier"):
    state.ledger(FINGERPRINT, **privacy)
  assert not (tmp_path / "c0" / ledger_lib.LEDGER_FILE).exists()


def test_a_far_exceeded_budget_is_refused_by_the_cheap_bound(tmp_path, monkeypatch):
  """At the floor, q = 1 and 20,000 steps the headline PLD takes seconds and over a GB; the
  optimistic bound refuses first, and nothing is recorded."""
  from dp_accounting.pld import privacy_loss_distribution

  real = privacy_loss_distribution.from_gaussian_mechanism

  def only_optimistic(**kw):
    assert kw.get("pessimistic_estimate", True) is False, "the headline PLD was built"
    return real(**kw)

  accounting._step_pld.cache_clear()
  monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", only_optimistic)
  privacy = dict(
    noise_multiplier=accounting.MIN_NOISE_MULTIPLIER,
    batch_size=64,
    min_client_size=64,
    steps_per_round=20_000,
    delta=1e-5,
    adjacency="replace_one",
  )
  fingerprint = dict(FINGERPRINT, num_records=64)
  state = ledger_lib.ClientState(tmp_path / "c0")
  led = state.ledger(fingerprint, **privacy)
  with pytest.raises(ledger_lib.BudgetExceeded) as err:
    state.spend(led, fingerprint, 20_000, 10.0, {"server_round": 1})
  assert err.value.epsilon == 0.0 and err.value.at_least
  assert err.value.epsilon_after > 1e5 and err.value.max_epsilon == 10.0
  assert led.rounds == 0 and not (tmp_path / "c0" / ledger_lib.LEDGER_FILE).exists()


def test_a_round_within_the_budget_is_charged_its_headline_epsilon(tmp_path):
  privacy = dict(
    noise_multiplier=2.92,
    batch_size=46,
    min_client_size=274,
    steps_per_round=100,
    delta=1e-5,
    adjacency="replace_one",
  )
  fingerprint = dict(FINGERPRINT, num_records=274)
  state = ledger_lib.ClientState(tmp_path / "c0")
  led = state.ledger(fingerprint, **privacy)
  assert round(state.spend(led, fingerprint, 100, 7.0, {"server_round": 1}), 4) == 5.1163
  # After a second round the bound is 6.71, below 7, the headline 7.71: refused by the headline.
  with pytest.raises(ledger_lib.BudgetExceeded) as err:
    state.spend(led, fingerprint, 100, 7.0, {"server_round": 2})
  assert (round(err.value.epsilon, 4), round(err.value.epsilon_after, 4)) == (5.1163, 7.7091)
  assert not err.value.at_least and led.rounds == 1
  # ... and by the bound alone below it.
  with pytest.raises(ledger_lib.BudgetExceeded) as err:
    state.spend(led, fingerprint, 100, 6.5, {"server_round": 2})
  assert (round(err.value.epsilon, 4), round(err.value.epsilon_after, 4)) == (5.1163, 6.7112)
  assert err.value.at_least
