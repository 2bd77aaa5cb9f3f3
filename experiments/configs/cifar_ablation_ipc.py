"""Ablation: synthetic images per class on non-DP CIFAR-10 (Figure "ablation_ipc").

  python -m experiments.run --config=cifar_ablation_ipc:20   # 10 | 20 | 50 | 100 | 150 | 200

The paper's values are 10, 20, 50 (the main setting), 100, 150 and 200; any
integer >= 1 is accepted.
"""

from experiments.configs import cifar_nondp

PAPER_IPC = (10, 20, 50, 100, 150, 200)


def get_config(ipc: str = "50"):
  try:
    value = int(ipc)
  except ValueError:
    raise ValueError(f"cifar_ablation_ipc:{ipc} is invalid; allowed: an integer, the paper "
                     f"uses {PAPER_IPC}") from None
  config = cifar_nondp.get_config()
  config.client.ipc = value
  return config
