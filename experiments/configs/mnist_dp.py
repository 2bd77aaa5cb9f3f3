"""FedLAP-DP on MNIST: the paper's DP loops and privacy parameters (as for CIFAR-10).

sigma=1, C=1, delta=1e-5, B=256, T=200 per round, 30 rounds.

  python -m experiments.run --config=mnist_dp [--config.seed=1]
"""

from experiments.configs import cifar_dp


def get_config():
  config = cifar_dp.get_config()
  config.data.name = "mnist"
  return config
