"""FedLAP on MNIST: the paper's non-DP loops (as for CIFAR-10), 28x28x1 input.

  python -m experiments.run --config=mnist_nondp [--config.seed=1]
"""

from experiments.configs import cifar_nondp


def get_config():
  config = cifar_nondp.get_config()
  config.data.name = "mnist"
  return config
