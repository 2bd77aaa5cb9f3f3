"""FedLAP vs the gradient-sharing baselines on the quickstart data (digits, 5 clients x 2 classes).

  python -m experiments.run --config=quickstart_compare --workdir=runs/compare
  python -m experiments.report runs/compare/* --out runs/compare_report

A suite of eight runs on the same data, model (ConvNet 32 x 2) and evaluation:

* non-DP, 10 rounds each: FedLAP (the quickstart's), FedAvg, FedProx (mu 0.1),
  SCAFFOLD, FedSGD; baselines with 5 local epochs of Poisson batches (B = 64),
  client lr 0.1 with the cosine schedule.
* DP at matched epsilon: FedLAP-DP (the quickstart's: sigma 1, T = 10 per
  round, 10 rounds), DP-FedAvg and DP-FedProx (C = 0.1, 2 local epochs, lr 1.0).
  Their noise multiplier is calibrated with the same accountant so that epsilon
  after the last round equals FedLAP-DP's (the client sizes come from the
  partition itself, so the match holds for any seed).
"""

import ml_collections

from experiments.configs import default, quickstart
from fedlap_jax import accounting
from fedlap_jax.baselines import steps_per_epoch

NONDP_BASELINES = ("fedavg", "fedprox", "scaffold", "fedsgd")
DP_BASELINES = ("dp_fedavg", "dp_fedprox")
DP_LOCAL_EPOCHS = 2
DP_BASELINE_LR = 1.0


def _client_sizes(cfg) -> list[int]:
  from experiments import data  # pylint: disable=g-import-not-at-top
  dataset = data.load_dataset(cfg.data)
  return [len(idx) for idx in data.client_split(dataset, cfg.data, cfg.seed)]


def _baseline(method: str, base) -> ml_collections.ConfigDict:
  config = quickstart.nondp_config()
  config.method = method
  config.learning_rate = 0.1
  config.client.batch_size = base.client.batch_size
  config.baseline.local_epochs = 5
  config.baseline.prox_mu = 0.1
  return config


def matched_dp_baseline(method: str, fedlap_dp) -> ml_collections.ConfigDict:
  """A DP baseline whose epsilon after the last round equals ``fedlap_dp``'s."""
  sizes = _client_sizes(fedlap_dp)
  b = fedlap_dp.client.batch_size
  fedlap_steps = fedlap_dp.client.iterations * fedlap_dp.client.max_outer * fedlap_dp.client.batch_loop
  target = accounting.epsilon_after_rounds(
      rounds=fedlap_dp.rounds, noise_multiplier=fedlap_dp.dp.noise_multiplier, batch_size=b,
      min_client_size=min(sizes), steps_per_round=fedlap_steps, delta=fedlap_dp.dp.delta)
  steps = DP_LOCAL_EPOCHS * steps_per_epoch(max(sizes), b)
  config = quickstart.nondp_config()
  config.method = method
  config.learning_rate = DP_BASELINE_LR
  config.client.batch_size = b
  config.baseline.local_epochs = DP_LOCAL_EPOCHS
  config.baseline.prox_mu = 0.1
  config.data.normalisation = fedlap_dp.data.normalisation  # DP-safe, as FedLAP-DP
  config.dp.enabled = True
  config.dp.l2_clip_norm = 0.1
  config.dp.delta = fedlap_dp.dp.delta
  config.dp.noise_multiplier = accounting.calibrate_noise_multiplier(
      target, delta=fedlap_dp.dp.delta, rounds=fedlap_dp.rounds, batch_size=b,
      min_client_size=min(sizes), steps_per_round=steps, tol=1e-4)
  return config


def get_config():
  config = ml_collections.ConfigDict()
  config.suite = ml_collections.ConfigDict()
  nondp = quickstart.nondp_config()
  dp = quickstart.dp_config()
  config.suite.fedlap = nondp
  for method in NONDP_BASELINES:
    config.suite[method] = _baseline(method, nondp)
  config.suite.fedlap_dp = dp
  for method in DP_BASELINES:
    config.suite[method] = matched_dp_baseline(method, dp)
  return config
