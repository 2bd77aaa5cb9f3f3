"""Baseline DP-fedprox on cifar: local DP-SGD, C = 0.1, sigma = 1 (see experiments/configs/baselines.py).

  python -m experiments.run --config=cifar_fedprox_dp
"""

from experiments.configs import baselines


def get_config():
  return baselines.get_baseline_config("cifar", "dp_fedprox")
