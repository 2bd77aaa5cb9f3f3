"""Baseline fedavg on cifar (see experiments/configs/baselines.py).

  python -m experiments.run --config=cifar_fedavg
"""

from experiments.configs import baselines


def get_config():
  return baselines.get_baseline_config("cifar", "fedavg")
