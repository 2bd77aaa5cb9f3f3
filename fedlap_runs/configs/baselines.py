"""Gradient-sharing baselines of the paper's Tables 1 and 2, on the same data and model.

One builder, :func:`get_baseline_config`; ``--config=baselines:DATASET_METHOD`` with
``DATASET`` one of ``mnist``, ``fmnist``, ``cifar`` and ``METHOD`` one of ``fedsgd``,
``fedavg``, ``fedprox``, ``scaffold``, ``fedavg_dp``, ``fedprox_dp``; each is also a
``--config`` name of its own:

  python -m experiments.run --config=cifar_fedavg [--config.seed=1]
  python -m experiments.run --config=cifar_fedavg_dp

Settings (REFERENCE_NOTES "Baselines"): 5 local epochs of Poisson batches of
B = 256, client SGD lr 0.1 with the cosine schedule over rounds, server adds the
mean client delta; FedProx mu = 0.1; FedSGD one local batch per round; SCAFFOLD
option II (twice the upload). Non-DP runs last as long as FedLAP's (200 rounds);
DP-FedAvg / DP-FedProx: per-example clip C = 0.1, sigma = 1, delta = 1e-5, 30
rounds, accounted with the same theorem as FedLAP-DP (T = local steps per round).
"""

from fedlap_jax.baselines import BASELINE_FACTS, METHODS

from fedlap_runs.configs import default, fedlap

DATASETS = fedlap.DATASETS


def get_baseline_config(dataset: str, method: str):
  """The config of ``method`` on ``dataset`` (a key of :data:`DATASETS`)."""
  if dataset not in DATASETS:
    raise ValueError(f"dataset={dataset!r} is invalid; allowed: one of {tuple(DATASETS)}")
  if method not in METHODS:
    raise ValueError(f"method={method!r} is invalid; allowed: one of {METHODS}")
  config = default.get_config()
  config.method = method
  config.data.name = DATASETS[dataset]
  config.learning_rate = 0.1
  config.client.batch_size = 256
  if BASELINE_FACTS[method].private:
    config.rounds = 30
    config.dp.enabled = True
    config.dp.noise_multiplier = 1.0
    config.dp.l2_clip_norm = 0.1
    config.dp.delta = 1e-5
  else:
    config.rounds = 200
  return config


def get_config(arg: str):
  """``DATASET_METHOD`` (``cifar_fedavg``) or ``DATASET_METHOD_dp`` (``cifar_fedavg_dp``)."""
  dataset, _, method = arg.partition("_")
  if method.endswith("_dp"):
    method = "dp_" + method[:-3]
  return get_baseline_config(dataset, method)
