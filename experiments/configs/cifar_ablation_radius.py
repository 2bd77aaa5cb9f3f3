"""Ablation: server radius strategy on non-DP CIFAR-10 (Table "strategy").

  python -m experiments.run --config=cifar_ablation_radius:max   # min | max | median | fixed

``fixed`` runs the server's 100 epochs every round, ignoring approximation
quality (so the client radius calibration is switched off). The work dir
defaults to ``runs/cifar_ablation_radius_<strategy>``.
"""

from experiments.configs import cifar_nondp

STRATEGIES = ("min", "max", "median", "fixed")


def get_config(strategy: str = "min"):
  if strategy not in STRATEGIES:
    raise ValueError(f"cifar_ablation_radius:{strategy} is invalid; allowed: one of {STRATEGIES}")
  config = cifar_nondp.get_config()
  config.server.radius_strategy = strategy
  if strategy == "fixed":
    config.client.calibrate_radius = False
  return config
