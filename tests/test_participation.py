"""Client sampling per round (data.clients_per_round) and per-client privacy ledgers.

Unit level: the draw (uniform, deterministic per (seed, round)), the ledgers
(a client never sampled spends nothing; all clients every round equals the
single ledger with q = B / min_k N_k exactly), SCAFFOLD's m / K server variate.
End to end (tiny FedLAP-DP on digits, 2 of 5 clients per round): unsampled
clients' synthetic sets stay as they are, the ledger file holds every client,
a run stopped after round 2 resumes identically, clients_per_round = K equals
the run without sampling.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import accounting, baselines, participation
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import stack_clients

pytest.importorskip("dp_accounting")

# The paper's setting (tests/test_accounting.py): eps 2.79 after 1 round, 10.18 after 15.
PAPER = dict(noise_multiplier=1.0, batch_size=256, steps_per_round=200, delta=1e-5)


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


def test_config_validation_refuses_more_clients_than_k():
  from experiments import library_configs  # pylint: disable=g-import-not-at-top
  from experiments.configs import quickstart  # pylint: disable=g-import-not-at-top
  cfg = quickstart.dp_config()
  cfg.data.clients_per_round = 6
  with pytest.raises(ConfigError, match="data.clients_per_round"):
    library_configs.validate_config(cfg)


def test_config_validation_refuses_a_negative_participation_seed():
  from experiments import library_configs  # pylint: disable=g-import-not-at-top
  from experiments.configs import quickstart  # pylint: disable=g-import-not-at-top
  cfg = quickstart.dp_config()
  cfg.data.participation_seed = -1  # (ml_collections refuses other types itself)
  with pytest.raises(ConfigError, match=r"data.participation_seed=.* allowed: an integer >= 0"):
    library_configs.validate_config(cfg)


# ---------------------------------------------------------------- the ledgers


def test_client_never_sampled_spends_nothing_and_each_pays_its_own_rate():
  ledgers = accounting.ClientLedgers.create(client_sizes=[10_000, 20_000, 10_000],
                                            **PAPER)
  ledgers.record_round([0, 1])
  ledgers.record_round([1])
  eps = ledgers.epsilons()
  assert eps[2] == 0.0 and ledgers.ledgers[2].rounds == 0
  assert eps[0] == pytest.approx(2.79, abs=0.01)  # one round at q = 256 / 10,000
  assert 0 < eps[1] < accounting.epsilon_after_rounds(rounds=2, min_client_size=10_000,
                                                      **PAPER)  # q = 256 / 20,000
  assert eps[1] == pytest.approx(accounting.epsilon_after_rounds(
      rounds=2, min_client_size=20_000, **PAPER), rel=1e-9)
  assert ledgers.epsilon == max(eps)
  assert ledgers.summary() == {"min": 0.0, "median": sorted(eps)[1], "max": max(eps)}


def test_all_clients_every_round_equals_the_single_ledger_exactly():
  sizes = [12_000, 10_000, 12_000]
  ledgers = accounting.ClientLedgers.create(client_sizes=sizes, **PAPER)
  single = accounting.PrivacyLedger(min_client_size=min(sizes), **PAPER)
  for _ in range(15):
    assert ledgers.record_round(range(3)) == single.record_round()
  assert ledgers.epsilon == single.epsilon == pytest.approx(10.18, abs=0.01)
  assert single.epsilons[0] == pytest.approx(2.79, abs=0.01)


def test_ledgers_round_trip_and_refuse_tampering():
  ledgers = accounting.ClientLedgers.create(client_sizes=[10_000, 12_000, 10_000], **PAPER)
  ledgers.record_round([0, 2])
  ledgers.record_round([1, 2])
  d = json.loads(json.dumps(ledgers.to_dict()))
  back = accounting.ClientLedgers.from_dict(d)
  assert back.epsilons() == ledgers.epsilons() and back.participants == [[0, 2], [1, 2]]
  back.record_round([0])
  ledgers.record_round([0])
  assert back.epsilons() == ledgers.epsilons()
  edited = json.loads(json.dumps(d))
  edited["clients"][1]["epsilons"][0] *= 0.5
  with pytest.raises(ValueError, match="does not match the recomputed"):
    accounting.ClientLedgers.from_dict(edited)
  dropped = json.loads(json.dumps(d))
  dropped["participants"][0] = [0]  # client 2's ledger holds 2 rounds, the history 1
  with pytest.raises(ValueError, match="client 2's ledger records 2 rounds"):
    accounting.ClientLedgers.from_dict(dropped)
  with pytest.raises(ValueError, match="distinct client indices"):
    ledgers.record_round([0, 0])
  with pytest.raises(ValueError, match="distinct client indices"):
    ledgers.record_round([3])


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
  ledgers = accounting.ClientLedgers.create(client_sizes=sizes, **small, adjacency="replace_one")
  distinct_per_round = []
  for r in range(1, 6):
    ids = participation.sample_clients(0, r, len(sizes), 40).tolist()
    touched = {(sizes[i], sum(ledgers.ledgers[i].steps) + 3) for i in ids}
    before = len(compositions)
    ledgers.record_round(ids)
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


# ---------------------------------------------------------------- SCAFFOLD


@pytest.mark.slow
def test_scaffold_sampled_round_updates_only_sampled_variates_with_m_over_k(
    tiny_apply_fn, tiny_params, clients):
  sizes = np.asarray(clients.mask).sum(1)
  cfg = baselines.baseline_config("scaffold", rounds=2, learning_rate=0.1, local_epochs=1,
                                  batch_size=64, prox_mu=0.0, dp=None,
                                  max_client_size=int(sizes.max()), weighting="uniform")
  shape = dict(image_shape=(8, 8, 1), num_params=sum(p.size for p in
                                                    jax.tree.leaves(tiny_params)))
  sampled = baselines.algorithm(tiny_apply_fn, cfg, num_clients=5, clients_per_round=2, **shape)
  assert sampled.client_state_fields == ("client_controls",)
  idx = np.array([1, 3], np.int32)
  host = participation.host_clients(clients)
  block = participation.device_block(host, idx)
  key = jax.random.PRNGKey(4)
  state = sampled.init(key, tiny_params, host)
  new, metrics = participation.sampled_round(sampled, state, block, idx)
  assert np.asarray(metrics.client.steps).shape == (2,)
  # The same two clients as a federation of two (scale 1): same model, variates, and c / (2/5).
  pair = baselines.algorithm(tiny_apply_fn, cfg, num_clients=2, **shape)
  ref, _ = pair.round(pair.init(key, tiny_params, block), block)
  chex.assert_trees_all_close(new.params, ref.params, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(jax.tree.map(lambda c: c[idx], new.client_controls),
                              ref.client_controls, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(new.control, jax.tree.map(lambda c: 0.4 * c, ref.control),
                              rtol=1e-6, atol=1e-8)
  for k in (0, 2, 4):
    assert all(float(jnp.abs(c[k]).max()) == 0.0 for c in jax.tree.leaves(new.client_controls))
  assert any(float(jnp.abs(c[1]).max()) > 0 for c in jax.tree.leaves(new.client_controls))


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory):
  """Tiny FedLAP-DP, 2 of 5 clients per round, 4 rounds: straight, and stopped after round 2."""
  from test_experiments_run import tiny_config  # pylint: disable=g-import-not-at-top
  from experiments import faults, train  # pylint: disable=g-import-not-at-top
  overrides = dict(progress_bar=False, plots=False, checkpoint_every=1,
                   snapshot_rounds=(), **{"data.clients_per_round": 2})
  straight_dir = tmp_path_factory.mktemp("sampled_straight")
  straight = train.train_and_evaluate(tiny_config(**overrides), straight_dir)
  resumed_dir = tmp_path_factory.mktemp("sampled_resumed")
  mp = pytest.MonkeyPatch()
  original = faults.point

  def stop_in_round_3(name, m):
    if name == "round" and m == 3:
      raise RuntimeError("stopped in round 3")
    return original(name, m)

  mp.setattr(faults, "point", stop_in_round_3)
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
  eps = ledgers.epsilons()
  taken = {k for d in drawn for k in d}
  for k in range(5):
    rounds = sum(k in d for d in drawn)
    assert ledgers.ledgers[k].rounds == rounds
    assert (eps[k] == 0.0) == (rounds == 0)
  assert records[-1]["epsilon"] == max(eps)
  assert records[-1]["epsilon_clients"]["max"] == max(eps)
  assert records[-1]["epsilon_clients"]["min"] == min(eps)
  per_client = [k for k, v in records[-1].items()
                if isinstance(v, list) and len(v) == 2 and k != "clients"]
  assert per_client  # per-client metrics are of the 2 sampled clients
  # FedLAP-DP carries synthetic sets: those of clients never sampled are the initial noise.
  setup = train.build_run(tiny_config(**overrides))
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
  assert (json.loads((resumed_dir / "privacy_ledger.json").read_text())
          == json.loads((straight_dir / "privacy_ledger.json").read_text()))


@pytest.mark.slow
def test_clients_per_round_k_equals_no_sampling(sampled_runs, tmp_path):
  tiny_config, train, _, _, _ = sampled_runs
  base = dict(progress_bar=False, plots=False, snapshot_rounds=())  # 4 rounds, as tiny runs
  plain = train.train_and_evaluate(tiny_config(**base), tmp_path / "plain")
  full = train.train_and_evaluate(tiny_config(**base, **{"data.clients_per_round": 5}),
                                  tmp_path / "full")
  chex.assert_trees_all_equal(plain["state"].params, full["state"].params)
  for a, b in zip(plain["records"], full["records"]):
    assert a["test_accuracy"] == b["test_accuracy"] and a["epsilon"] == b["epsilon"]
    assert b["clients"] == [0, 1, 2, 3, 4]
    assert b["epsilon_clients"]["max"] == a["epsilon"]
  assert "clients" not in plain["records"][0]
  assert set(plain["ledger"]) >= {"epsilons", "min_client_size"}  # today's single ledger


# ---------------------------------------------------------------- the benchmark's settings


def test_many_clients_benchmark_configs_are_valid_and_sample(tmp_path):
  """The benchmark's configs validate on an mnist10k-shaped file the test builds (no file
  outside the repository); by default they read where experiments.datasets writes."""
  from benchmarks import many_clients  # pylint: disable=g-import-not-at-top
  from experiments import datasets, library_configs  # pylint: disable=g-import-not-at-top
  data = tmp_path / "mnist10k.npz"
  y = np.arange(60) % 10
  datasets.write_npz(data, {"x_train": np.zeros((60, 28, 28, 1), np.uint8), "y_train": y,
                            "x_test": np.zeros((20, 28, 28, 1), np.uint8), "y_test": y[:20]})
  default = many_clients.bench_config("fedlap_dp", 5, None, rounds=3, small=False)
  assert default.data.source == f"npz:{datasets.output_path('mnist10k')}"
  for method in many_clients.METHODS:
    for k, m in ((500, 5), (500, None), (5, None)):
      cfg = many_clients.bench_config(method, k, m, rounds=3, small=False, data=data)
      assert cfg.data.source == f"npz:{data}" and cfg.data.name == "mnist"
      library_configs.validate_config(cfg)
      assert cfg.data.partition == "dirichlet" and cfg.data.dirichlet_alpha == 0.5
      assert cfg.data.clients_per_round == m and cfg.client.batch_size == many_clients.BATCH
  with pytest.raises(SystemExit, match="built by `python -m experiments.datasets mnist10k`"):
    many_clients.main(["--data", str(tmp_path / "missing.npz")])
  row = dict(method="fedlap_dp", clients=500, per_round=5, n_min=3, n_max=48,
             first_round_s=1.0, round_s=0.5, accounting_s=0.1, peak_rss_mb=900.0,
             host_data_mb=18.8, block_mb=0.19, load=[3.0, 3.1])
  lines = many_clients.table([row]).splitlines()
  assert len(lines) == 3 and lines[2].startswith("| fedlap_dp | 500 | 5 | 3..48 | 1.0 | 0.5 | 0.1")
  assert lines[0].count("|") == lines[2].count("|")


# ---------------------------------------------------------------- privacy audit


@pytest.mark.slow
def test_released_participants_do_not_depend_on_the_secret_seed(sampled_runs, tmp_path):
  """`clients` (metrics.jsonl, privacy_ledger.json) is released; the run's `seed` is secret
  (it drives every noise draw). Participants drawn from the seed would let anyone test seed
  guesses offline and then recompute the noise: they come from the public
  data.participation_seed only."""
  tiny_config, train, overrides, (_, out), _ = sampled_runs
  other = train.train_and_evaluate(
      tiny_config(**{**overrides, "rounds": 2, "seed": 7}), tmp_path / "seed7")
  assert [r["clients"] for r in other["records"]] == [r["clients"] for r in out["records"][:2]]
  moved = train.train_and_evaluate(
      tiny_config(**{**overrides, "rounds": 2, "data.participation_seed": 1}), tmp_path / "p1")
  assert ([r["clients"] for r in moved["records"]]
          == [participation.sample_clients(1, m, 5, 2).tolist() for m in (1, 2)])


@pytest.mark.slow
def test_sampled_dp_workdir_holds_only_dp_outputs_and_public_values(sampled_runs):
  """An attacker's look at a sampled DP run's work dir: besides what a run without sampling
  releases, only the participants (public draw) and values of the public sizes and
  participation (the per-client ledgers and their epsilons)."""
  from test_experiments_run import (PUBLIC_INFO_KEYS, RELEASED_RECORD_KEYS,  # pylint: disable=g-import-not-at-top
                                    WORKDIR_FILES)
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
    assert set(ledger) == {"noise_multiplier", "batch_size", "min_client_size",
                           "steps_per_round", "delta", "participation", "rounds", "steps",
                           "epsilons", "adjacency", "epsilons_add_remove"}
    assert ledger["min_client_size"] == info["client_sizes"][k]  # N_k: public


@pytest.mark.slow
def test_every_noisy_access_of_a_sampled_client_reaches_its_ledger(sampled_runs):
  """Each round charges every participant T = steps_per_round noisy accesses (the worst case),
  and no client accessed its records more often than that; non-participants run nothing."""
  _, _, _, (workdir, out), _ = sampled_runs
  ledgers = accounting.ClientLedgers.from_dict(
      json.loads((workdir / "privacy_ledger.json").read_text()))
  t = ledgers.ledgers[0].steps_per_round
  charged = [0] * 5
  for r in out["records"]:
    assert len(r["real_accesses"]) == len(r["clients"]) == 2
    for k, accesses in zip(r["clients"], r["real_accesses"]):
      assert 1 <= accesses <= t  # the while loop may stop early, never run over
      charged[k] += 1
  for k in range(5):
    assert ledgers.ledgers[k].steps == [t] * charged[k]


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
    assert mask.sum() == sizes[k] and mask[:sizes[k]].all()
    np.testing.assert_array_equal(np.asarray(block.x[j])[mask], xs[k])
    np.testing.assert_array_equal(np.asarray(block.y[j])[mask], ys[k])
