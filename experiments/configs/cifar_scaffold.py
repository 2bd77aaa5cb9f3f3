"""Baseline scaffold on cifar (see experiments/configs/baselines.py).

  python -m experiments.run --config=cifar_scaffold
"""

from experiments.configs import baselines


def get_config():
  return baselines.get_baseline_config("cifar", "scaffold")
