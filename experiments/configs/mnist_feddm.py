"""FedDM on mnist: FedLAP's non-DP partition, ipc 50, 200 rounds (see experiments/configs/synthetic.py).

  python -m experiments.run --config=mnist_feddm
"""

from experiments.configs import synthetic


def get_config():
  return synthetic.get_feddm_config("mnist")
