"""Baseline fedavg on mnist (see experiments/configs/baselines.py).

  python -m experiments.run --config=mnist_fedavg
"""

from experiments.configs import baselines


def get_config():
  return baselines.get_baseline_config("mnist", "fedavg")
