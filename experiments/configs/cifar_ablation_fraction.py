"""Ablation: size of the training set on non-DP CIFAR-10 (Table "size").

  python -m experiments.run --config=cifar_ablation_fraction:5   # 5 | 10 | 50 | 100 (percent)

Each class keeps that percentage of its records (5 % -> 500 records per client).
Compare with ``--config.method=fedavg`` for the table's FedAvg row.
"""

from experiments.configs import cifar_nondp

PAPER_PERCENT = (5, 10, 50, 100)


def get_config(percent: str = "100"):
  try:
    value = float(percent)
  except ValueError:
    value = -1.0
  if not 0 < value <= 100:
    raise ValueError(f"cifar_ablation_fraction:{percent} is invalid; allowed: a percentage in "
                     f"(0, 100], the paper uses {PAPER_PERCENT}")
  config = cifar_nondp.get_config()
  config.data.train_fraction = value / 100.0
  return config
