"""Named baseline configs and the FedLAP-vs-baselines quickstart suite (matched epsilon)."""

import pytest

from fedlap_runs import calibration, configs, flags, library_configs
from fedlap_runs.configs import baselines, quickstart_compare
from fedlap_jax import accounting
from fedlap_jax.baselines import steps_per_epoch

NAMES = [
  f"{ds}_{m}"
  for ds in ("mnist", "fmnist", "cifar")
  for m in ("fedsgd", "fedavg", "fedprox", "scaffold", "fedavg_dp", "fedprox_dp")
]


@pytest.mark.parametrize("name", NAMES)
def test_named_baseline_config_validates_with_published_settings(name):
  cfg = configs.load(name)
  library_configs.validate_config(cfg)
  dp = name.endswith("_dp")
  assert cfg.method == ("dp_" if dp else "") + name.split("_")[1]
  assert cfg.dp.enabled == dp
  assert (cfg.client.batch_size, cfg.baseline.local_epochs, cfg.learning_rate) == (256, 5, 0.1)
  assert cfg.baseline.prox_mu == 0.1
  if dp:
    assert (cfg.rounds, cfg.dp.l2_clip_norm, cfg.dp.noise_multiplier) == (30, 0.1, 1.0)
  path, label = flags.resolve_config_arg(name)
  assert path.startswith(str(flags.CONFIG_DIR)) and label == name


def test_unknown_baseline_names_are_refused():
  with pytest.raises(ValueError, match="dataset='svhn'"):
    baselines.get_baseline_config("svhn", "fedavg")
  with pytest.raises(ValueError, match="method='fednova'"):
    baselines.get_baseline_config("mnist", "fednova")


def test_quickstart_compare_matches_epsilon_of_fedlap_dp():
  suite = calibration.match_epsilons(quickstart_compare.get_config()).suite  # on the guarantee
  assert set(suite.keys()) == {
    "fedlap",
    "fedavg",
    "fedprox",
    "scaffold",
    "fedsgd",
    "fedlap_dp",
    "dp_fedavg",
    "dp_fedprox",
    "feddm",
    "dsc",
    "dsc_centralized",
    "psg",
  }
  for key in suite.keys():
    library_configs.validate_config(suite[key])
  fl = suite.fedlap_dp
  sizes = calibration.client_sizes(fl)
  t_fedlap = fl.client.iterations * fl.client.max_outer * fl.client.batch_loop
  eps_fedlap = accounting.epsilon_after_rounds(
    rounds=fl.rounds,
    noise_multiplier=fl.dp.noise_multiplier,
    batch_size=fl.client.batch_size,
    min_client_size=min(sizes),
    steps_per_round=t_fedlap,
    delta=fl.dp.delta,
    adjacency="replace_one",  # the guarantee, which the suite matches
  )
  for key in ("dp_fedavg", "dp_fedprox"):
    c = suite[key]
    t = c.baseline.local_epochs * steps_per_epoch(max(sizes), c.client.batch_size)
    eps = accounting.epsilon_after_rounds(
      rounds=c.rounds,
      noise_multiplier=c.dp.noise_multiplier,
      batch_size=c.client.batch_size,
      min_client_size=min(sizes),
      steps_per_round=t,
      delta=c.dp.delta,
      adjacency="replace_one",  # the guarantee, which the suite matches
    )
    assert eps <= eps_fedlap and eps == pytest.approx(eps_fedlap, rel=2e-3)
    assert t != t_fedlap  # the match comes from sigma, not from equal step counts
  # PSG, one round of T = iterations * outer_loop * batch_loop noisy accesses, at the same epsilon.
  c = suite.psg
  t = c.condense.networks * c.condense.outer_loop * c.condense.batch_loop
  eps = accounting.epsilon_after_rounds(
    rounds=1,
    noise_multiplier=c.dp.noise_multiplier,
    batch_size=c.client.batch_size,
    min_client_size=min(sizes),
    steps_per_round=t,
    delta=c.dp.delta,
    adjacency="replace_one",  # the guarantee, which the suite matches
  )
  assert c.rounds == 1 and t == 500
  assert eps <= eps_fedlap and eps == pytest.approx(eps_fedlap, rel=2e-3)


def test_quickstart_compare_config_reads_no_data(monkeypatch):
  """The config file only describes the suite; the data is read when the suite runs."""
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  def no_io(*args, **kwargs):
    raise AssertionError("get_config() loaded a dataset")

  monkeypatch.setattr(data_lib, "load_dataset", no_io)
  suite = quickstart_compare.get_config().suite
  assert suite.dp_fedavg.dp.match_epsilon_of == "fedlap_dp"
  with pytest.raises(AssertionError, match="loaded a dataset"):
    calibration.match_epsilons(quickstart_compare.get_config())


@pytest.mark.parametrize(
  "run_name, other, field",
  [
    ("dp_fedavg", "nosuch", "suite.dp_fedavg.dp.match_epsilon_of"),
    ("dp_fedavg", "fedavg", "suite.dp_fedavg.dp.match_epsilon_of"),  # no DP there
    ("fedavg", "fedlap_dp", "suite.fedavg.dp.enabled"),  # no DP here
  ],
)
def test_match_epsilon_of_names_another_dp_run(run_name, other, field):
  config = quickstart_compare.get_config()
  config.suite[run_name].dp.match_epsilon_of = other
  with pytest.raises(library_configs.ConfigError) as err:
    calibration.match_epsilons(config)
  assert err.value.field == field and repr(other) in str(err.value)
