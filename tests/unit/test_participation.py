"""Client sampling per round (data.clients_per_round) and per-client privacy ledgers.

Unit level: the draw (uniform, deterministic per (seed, round)), the ledgers
(a client never sampled spends nothing; all clients every round equals the
single ledger with q = B / min_k N_k exactly), the sampled clients' device block. Sampled
rounds and whole runs: tests/integration/test_participation_runs.py.
"""

import json

import chex
import numpy as np
import pytest

from fedlap_jax import accounting, participation
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import stack_clients
from conftest import raises_field

pytest.importorskip("dp_accounting")

# The paper's setting (tests/unit/test_accounting.py): eps 2.79 after 1 round, 10.18 after 15.
PAPER = dict(noise_multiplier=1.0, batch_size=256, steps_per_round=200, delta=1e-5)
# The paper's figures are add/remove ones (RDP); the mechanism's default is replace-one.
PAPER_MECHANISM = accounting.DpMechanism(**PAPER, adjacency="add_remove")
PAPER_RDP = dict(PAPER, adjacency="add_remove")


# ---------------------------------------------------------------- the draw


def test_sample_is_uniform_without_replacement_and_a_function_of_seed_and_round():
  draws = [participation.sample_clients(0, r, 20, 5) for r in range(1, 401)]
  for d in draws:
    assert d.dtype == np.int32 and len(d) == 5 and len(set(d.tolist())) == 5
    assert np.all(np.diff(d) > 0) and d.min() >= 0 and d.max() < 20
  again = [participation.sample_clients(0, r, 20, 5) for r in range(1, 401)]
  assert all(np.array_equal(a, b) for a, b in zip(draws, again))
  assert not np.array_equal(draws[0], draws[1])
  assert not np.array_equal(draws[0], participation.sample_clients(1, 1, 20, 5))
  # Uniform: each client in 400 * 5 / 20 = 100 draws; binomial sd ~ 8.7.
  counts = np.bincount(np.concatenate(draws), minlength=20)
  assert counts.sum() == 2000 and np.all(np.abs(counts - 100) < 40), counts


def test_all_clients_is_every_client_in_order():
  for m in (None, 7):
    np.testing.assert_array_equal(participation.sample_clients(3, 9, 7, m), np.arange(7))


@pytest.mark.parametrize("value", [0, 6, -1, 2.5, True, "3"])
def test_bad_clients_per_round_names_field_value_and_range(value):
  with pytest.raises(ConfigError) as e:
    participation.check_clients_per_round(value, 5)
  msg = str(e.value)
  assert "data.clients_per_round" in msg and repr(value) in msg and "1..5" in msg


# ---------------------------------------------------------------- the ledgers


def test_client_never_sampled_spends_nothing_and_each_pays_its_own_rate():
  ledgers = PAPER_MECHANISM.client_ledgers([10_000, 20_000, 10_000])
  ledgers.record_round(participants=[0, 1])
  ledgers.record_round(participants=[1])
  eps = ledgers.epsilons
  assert eps[2] == 0.0 and ledgers.ledgers[2].rounds == 0
  assert eps[0] == pytest.approx(2.79, abs=0.01)  # one round at q = 256 / 10,000
  assert (
    0 < eps[1] < accounting.epsilon_after_rounds(rounds=2, min_client_size=10_000, **PAPER_RDP)
  )  # q = 256 / 20,000
  assert eps[1] == pytest.approx(
    accounting.epsilon_after_rounds(rounds=2, min_client_size=20_000, **PAPER_RDP), rel=1e-9
  )
  assert ledgers.epsilon == max(eps)
  assert ledgers.summary() == {"min": 0.0, "median": sorted(eps)[1], "max": max(eps)}


def test_all_clients_every_round_equals_the_single_ledger_exactly():
  sizes = [12_000, 10_000, 12_000]
  ledgers = PAPER_MECHANISM.client_ledgers(sizes)
  single = PAPER_MECHANISM.ledger(min(sizes))
  for r in range(15):
    # The two ledger types record a round with the same call.
    everyone = range(3) if r % 2 else None
    # ClientLedgers returns each client's epsilon, the single ledger the smallest client's.
    per_client = ledgers.record_round(participants=everyone)
    assert max(per_client) == per_client[1] == single.record_round(participants=everyone)
  assert ledgers.epsilon == single.epsilon == pytest.approx(10.18, abs=0.01)
  assert single.epsilons[0] == pytest.approx(2.79, abs=0.01)


def test_client_ledgers_surface_is_one_of_properties_and_record_round_returns_its_record():
  """epsilons, epsilon and their add/remove figures are all read as properties, as on
  PrivacyLedger; record_round returns what it recorded: each client's epsilon after the round."""
  ledgers = PAPER_MECHANISM.client_ledgers([10_000, 20_000, 10_000])
  recorded = ledgers.record_round(participants=[0, 1])
  assert recorded == ledgers.epsilons and len(recorded) == 3 and recorded[2] == 0.0
  assert recorded[0] == pytest.approx(2.79, abs=0.01)
  assert ledgers.epsilon == max(recorded)
  assert ledgers.epsilons_add_remove[2] == 0.0
  assert ledgers.epsilon_add_remove == max(ledgers.epsilons_add_remove) > 0
  assert ledgers.record_round(participants=[2]) == ledgers.epsilons != recorded


def test_ledgers_round_trip_and_refuse_tampering():
  ledgers = PAPER_MECHANISM.client_ledgers([10_000, 12_000, 10_000])
  ledgers.record_round(participants=[0, 2])
  ledgers.record_round(participants=[1, 2])
  d = json.loads(json.dumps(ledgers.to_dict()))
  back = accounting.ClientLedgers.from_dict(d)
  assert back.epsilons == ledgers.epsilons and back.participants == [[0, 2], [1, 2]]
  back.record_round(participants=[0])
  ledgers.record_round(participants=[0])
  assert back.epsilons == ledgers.epsilons
  edited = json.loads(json.dumps(d))
  edited["clients"][1]["epsilons"][0] *= 0.5
  with pytest.raises(ValueError, match="does not match the recomputed"):
    accounting.ClientLedgers.from_dict(edited)
  dropped = json.loads(json.dumps(d))
  dropped["participants"][0] = [0]  # client 2's ledger holds 2 rounds, the history 1
  with pytest.raises(ValueError, match="client 2's ledger records 2 rounds"):
    accounting.ClientLedgers.from_dict(dropped)
  with raises_field("participants"):
    ledgers.record_round(participants=[0, 0])
  with raises_field("participants"):
    ledgers.record_round(participants=[3])
  with raises_field("participants"):
    ledgers.record_round(participants=[])


def test_a_round_composes_once_per_distinct_rate_and_steps(monkeypatch):
  """200 clients of 3 sizes, 40 sampled per round: the add/remove RDP of a step is computed
  once per rate for the whole run (not once per participant or per round), and the replace-one
  PLD once per rate, then one composition per distinct (rate, steps spent) a round touches."""
  from dp_accounting.pld import privacy_loss_distribution
  from dp_accounting.rdp import rdp_privacy_accountant

  accounting._step_rdp.cache_clear()
  accounting._step_pld.cache_clear()
  accounting._replace_one.cache_clear()
  rdp_rates, pld_rates, compositions = [], [], []
  real_rdp = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian
  real_pld = privacy_loss_distribution.from_gaussian_mechanism
  real_compose = privacy_loss_distribution.PrivacyLossDistribution.self_compose

  def rdp(q, noise_multiplier, orders):
    rdp_rates.append(q)
    return real_rdp(q=q, noise_multiplier=noise_multiplier, orders=orders)

  def pld(**kw):
    pld_rates.append(kw["sampling_prob"])
    return real_pld(**kw)

  def compose(self, n, *args, **kw):
    compositions.append(n)
    return real_compose(self, n, *args, **kw)

  monkeypatch.setattr(rdp_privacy_accountant, "_compute_rdp_poisson_subsampled_gaussian", rdp)
  monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", pld)
  monkeypatch.setattr(privacy_loss_distribution.PrivacyLossDistribution, "self_compose", compose)
  sizes = [300] * 50 + [400] * 50 + [500] * 100
  small = dict(noise_multiplier=2.0, batch_size=30, steps_per_round=3, delta=1e-5)
  ledgers = accounting.DpMechanism(**small).client_ledgers(sizes)
  distinct_per_round = []
  for r in range(1, 6):
    ids = participation.sample_clients(0, r, len(sizes), 40).tolist()
    touched = {(sizes[i], sum(ledgers.ledgers[i].steps) + 3) for i in ids}
    before = len(compositions)
    ledgers.record_round(participants=ids)
    distinct_per_round.append((len(touched), len(compositions) - before))
  assert sorted(rdp_rates) == [30 / 500, 30 / 400, 30 / 300]
  assert sorted(pld_rates) == [30 / 500, 30 / 400, 30 / 300]
  assert all(made <= touched for touched, made in distinct_per_round), distinct_per_round
  single = accounting.PrivacyLedger(**small, min_client_size=300, adjacency="replace_one")
  busiest = max(ledgers.ledgers[:50], key=lambda l: l.rounds)
  for _ in range(busiest.rounds):
    single.record_round()
  assert busiest.epsilons == single.epsilons
  assert busiest.epsilons_add_remove == single.epsilons_add_remove


# ---------------------------------------------------------------- the device block


def test_the_sampled_block_holds_every_record_of_the_sampled_clients():
  """No record of a sampled client is dropped on the way to the device: the block's mask
  covers each client's N_k records and its data are the host rows, in the draw's order."""
  rng = np.random.default_rng(0)
  sizes = [3, 9, 5, 7, 4]
  xs = [rng.normal(size=(n, 4, 4, 1)).astype(np.float32) for n in sizes]
  ys = [rng.integers(0, 10, n) for n in sizes]
  host = stack_clients(xs, ys, on_host=True)
  idx = participation.sample_clients(3, 2, 5, 3)
  block = participation.device_block(host, idx)
  chex.assert_shape(block.x, (3, 9, 4, 4, 1))
  for j, k in enumerate(idx):
    mask = np.asarray(block.mask[j])
    assert mask.sum() == sizes[k] and mask[: sizes[k]].all()
    np.testing.assert_array_equal(np.asarray(block.x[j])[mask], xs[k])
    np.testing.assert_array_equal(np.asarray(block.y[j])[mask], ys[k])
