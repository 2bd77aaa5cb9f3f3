"""Client sampling per round (data.clients_per_round): a sampled round of the library, and
runs end to end by ``experiments``.

SCAFFOLD's sampled round equals a federation of the sampled clients, with the m / K server
variate. Tiny FedLAP-DP on digits, 2 of 5 clients per round: unsampled clients' synthetic
sets stay as they are, the ledger file holds every client, a run stopped after
round 2 resumes identically, clients_per_round = K equals the run without
sampling; the config checks of the two sampling fields.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import accounting, baselines, participation, rounds
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import count_params
from conftest import raises_field

pytest.importorskip("dp_accounting")


# ---------------------------------------------------------------- the config


def test_config_validation_refuses_more_clients_than_k():
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  cfg = quickstart.dp_config()
  cfg.data.clients_per_round = 6
  with raises_field("data.clients_per_round"):
    library_configs.validate_config(cfg)


def test_config_validation_refuses_a_negative_participation_seed():
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  cfg = quickstart.dp_config()
  cfg.data.participation_seed = -1  # (ml_collections refuses other types itself)
  with raises_field("data.participation_seed"):
    library_configs.validate_config(cfg)


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory):
  """Tiny FedLAP-DP, 2 of 5 clients per round, 4 rounds: straight, and stopped after round 2."""
  from test_experiments_run import tiny_config  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  from fault_run import install  # pylint: disable=g-import-not-at-top

  overrides = dict(
    progress_bar=False,
    plots=False,
    checkpoint_every=1,
    snapshot_rounds=(),
    **{"data.clients_per_round": 2},
  )
  straight_dir = tmp_path_factory.mktemp("sampled_straight")
  straight = train.train_and_evaluate(tiny_config(**overrides), straight_dir)
  resumed_dir = tmp_path_factory.mktemp("sampled_resumed")
  mp = pytest.MonkeyPatch()

  def stop():
    raise RuntimeError("stopped in round 3")

  install("round", 3, stop, mp.setattr)
  with pytest.raises(RuntimeError, match="stopped in round 3"):
    train.train_and_evaluate(tiny_config(**overrides), resumed_dir)
  mp.undo()
  resumed = train.train_and_evaluate(tiny_config(**overrides), resumed_dir)
  return tiny_config, train, overrides, (straight_dir, straight), (resumed_dir, resumed)


@pytest.mark.slow
def test_sampled_run_charges_only_participants_and_keeps_unsampled_sets(sampled_runs):
  tiny_config, train, overrides, (workdir, out), _ = sampled_runs
  records = out["records"]
  drawn = [r["clients"] for r in records]
  assert drawn == [participation.sample_clients(0, m, 5, 2).tolist() for m in (1, 2, 3, 4)]
  stored = json.loads((workdir / "privacy_ledger.json").read_text())
  ledgers = accounting.ClientLedgers.from_dict(stored)
  assert ledgers.participants == drawn
  eps = ledgers.epsilons
  taken = {k for d in drawn for k in d}
  for k in range(5):
    rounds = sum(k in d for d in drawn)
    assert ledgers.ledgers[k].rounds == rounds
    assert (eps[k] == 0.0) == (rounds == 0)
  assert records[-1]["epsilon"] == max(eps)
  assert records[-1]["epsilon_clients"]["max"] == max(eps)
  assert records[-1]["epsilon_clients"]["min"] == min(eps)
  per_client = [
    k for k, v in records[-1].items() if isinstance(v, list) and len(v) == 2 and k != "clients"
  ]
  assert per_client  # per-client metrics are of the 2 sampled clients
  # FedLAP-DP carries synthetic sets: those of clients never sampled are the initial noise.
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  setup = build.build_run(tiny_config(**overrides))
  before, after = np.asarray(setup.state.synthetic.x), np.asarray(out["state"].synthetic.x)
  for k in range(5):
    if k in taken:
      assert not np.array_equal(before[k], after[k])
    else:
      np.testing.assert_array_equal(before[k], after[k])
  assert isinstance(setup.clients.x, np.ndarray)  # data on the host when m < K


@pytest.mark.slow
def test_sampled_run_resumes_identically(sampled_runs):
  *_, (straight_dir, straight), (resumed_dir, resumed) = sampled_runs
  timing = ("round_seconds", "wall_seconds", "first_in_process")
  strip = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in rs]
  assert strip(resumed["records"]) == strip(straight["records"])
  assert resumed["ledger"] == straight["ledger"]
  assert json.loads((resumed_dir / "privacy_ledger.json").read_text()) == json.loads(
    (straight_dir / "privacy_ledger.json").read_text()
  )


@pytest.mark.slow
def test_clients_per_round_k_equals_no_sampling(sampled_runs, tmp_path):
  tiny_config, train, _, _, _ = sampled_runs
  base = dict(progress_bar=False, plots=False, snapshot_rounds=())  # 4 rounds, as tiny runs
  plain = train.train_and_evaluate(tiny_config(**base), tmp_path / "plain")
  full = train.train_and_evaluate(
    tiny_config(**base, **{"data.clients_per_round": 5}), tmp_path / "full"
  )
  chex.assert_trees_all_equal(plain["state"].params, full["state"].params)
  for a, b in zip(plain["records"], full["records"]):
    assert a["test_accuracy"] == b["test_accuracy"] and a["epsilon"] == b["epsilon"]
    assert b["clients"] == [0, 1, 2, 3, 4]
    assert b["epsilon_clients"]["max"] == a["epsilon"]
  assert "clients" not in plain["records"][0]
  assert set(plain["ledger"]) >= {"epsilons", "min_client_size"}  # today's single ledger


# ---------------------------------------------------------------- privacy audit


@pytest.mark.slow
def test_released_participants_do_not_depend_on_the_secret_seed(sampled_runs, tmp_path):
  """`clients` (metrics.jsonl, privacy_ledger.json) is released; the run's `seed` is secret
  (it drives every noise draw). Participants drawn from the seed would let anyone test seed
  guesses offline and then recompute the noise: they come from the public
  data.participation_seed only."""
  tiny_config, train, overrides, (_, out), _ = sampled_runs
  other = train.train_and_evaluate(
    tiny_config(**{**overrides, "rounds": 2, "seed": 7}), tmp_path / "seed7"
  )
  assert [r["clients"] for r in other["records"]] == [r["clients"] for r in out["records"][:2]]
  moved = train.train_and_evaluate(
    tiny_config(**{**overrides, "rounds": 2, "data.participation_seed": 1}), tmp_path / "p1"
  )
  assert [r["clients"] for r in moved["records"]] == [
    participation.sample_clients(1, m, 5, 2).tolist() for m in (1, 2)
  ]


@pytest.mark.slow
def test_sampled_dp_workdir_holds_only_dp_outputs_and_public_values(sampled_runs):
  """An attacker's look at a sampled DP run's work dir: besides what a run without sampling
  releases, only the participants (public draw) and values of the public sizes and
  participation (the per-client ledgers and their epsilons)."""
  from test_experiments_run import (
    PUBLIC_INFO_KEYS,
    RELEASED_RECORD_KEYS,  # pylint: disable=g-import-not-at-top
    WORKDIR_FILES,
  )

  _, _, _, (workdir, out), _ = sampled_runs
  listing = {p.name for p in workdir.iterdir()}
  assert {n for n in listing if not n.endswith(".png")} <= set(WORKDIR_FILES), listing
  records = out["records"]
  for r in records:
    assert set(r) <= RELEASED_RECORD_KEYS | {"clients", "epsilon_clients"}, set(r)
    assert set(r["epsilon_clients"]) == {"min", "median", "max"}
  info = json.loads((workdir / "run_info.json").read_text())
  sampling_config = {"clients_per_round", "participation_seed"}  # config: public
  assert set(info) <= PUBLIC_INFO_KEYS | sampling_config and "seed" not in info
  assert info["participation_seed"] == 0
  stored = json.loads((workdir / "privacy_ledger.json").read_text())
  assert set(stored) == {"clients", "participants"}
  assert stored["participants"] == [r["clients"] for r in records]
  for k, ledger in enumerate(stored["clients"]):
    assert set(ledger) == {
      "noise_multiplier",
      "batch_size",
      "min_client_size",
      "steps_per_round",
      "delta",
      "rounds",
      "steps",
      "epsilons",
      "adjacency",
      "epsilons_add_remove",
    }
    assert ledger["min_client_size"] == info["client_sizes"][k]  # N_k: public


@pytest.mark.slow
def test_every_noisy_access_of_a_sampled_client_reaches_its_ledger(sampled_runs):
  """Each round charges every participant T = steps_per_round noisy accesses (the worst case),
  and no client accessed its records more often than that; non-participants run nothing."""
  _, _, _, (workdir, out), _ = sampled_runs
  ledgers = accounting.ClientLedgers.from_dict(
    json.loads((workdir / "privacy_ledger.json").read_text())
  )
  t = ledgers.ledgers[0].steps_per_round
  charged = [0] * 5
  for r in out["records"]:
    assert len(r["real_accesses"]) == len(r["clients"]) == 2
    for k, accesses in zip(r["clients"], r["real_accesses"]):
      assert 1 <= accesses <= t  # the while loop may stop early, never run over
      charged[k] += 1
  for k in range(5):
    assert ledgers.ledgers[k].steps == [t] * charged[k]


@pytest.mark.slow
def test_scaffold_sampled_round_updates_only_sampled_variates_with_m_over_k(
  linear_apply_fn, linear_params, clients
):
  sizes = np.asarray(clients.mask).sum(1)
  cfg = baselines.baseline_config(
    "scaffold",
    rounds=2,
    learning_rate=0.1,
    local_epochs=1,
    batch_size=64,
    prox_mu=0.0,
    dp=None,
    max_client_size=int(sizes.max()),
    weighting="uniform",
  )
  scaffold, model, n = REGISTRY["scaffold"], ModelFns(linear_apply_fn), count_params(linear_params)
  sampled = rounds.algorithm(scaffold, cfg, model, RunFacts((8, 8, 1), 5, n, 1, None, 2))
  assert sampled.client_state_fields == ("client_controls",)
  idx = np.array([1, 3], np.int32)
  host = participation.host_clients(clients)
  block = participation.device_block(host, idx)
  key = jax.random.PRNGKey(4)
  state = sampled.init(key, linear_params, host)
  new, metrics = participation.sampled_round(sampled, state, block, idx)
  assert np.asarray(metrics.client.steps).shape == (2,)
  # The same two clients as a federation of two (scale 1): same model, variates, and c / (2/5).
  pair = rounds.algorithm(scaffold, cfg, model, RunFacts((8, 8, 1), 2, n, 1))
  ref, _ = pair.round(pair.init(key, linear_params, block), block)
  chex.assert_trees_all_close(new.params, ref.params, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(
    jax.tree.map(lambda c: c[idx], new.client_controls), ref.client_controls, rtol=1e-6, atol=1e-7
  )
  chex.assert_trees_all_close(
    new.control, jax.tree.map(lambda c: 0.4 * c, ref.control), rtol=1e-6, atol=1e-8
  )
  for k in (0, 2, 4):
    assert all(float(jnp.abs(c[k]).max()) == 0.0 for c in jax.tree.leaves(new.client_controls))
  assert any(float(jnp.abs(c[1]).max()) > 0 for c in jax.tree.leaves(new.client_controls))
