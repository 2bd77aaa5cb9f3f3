"""Baseline fedavg on fmnist (see experiments/configs/baselines.py).

  python -m experiments.run --config=fmnist_fedavg
"""

from experiments.configs import baselines


def get_config():
  return baselines.get_baseline_config("fmnist", "fedavg")
