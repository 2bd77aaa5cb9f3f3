"""PSG on mnist: one-shot DP gradient matching, epsilon 32 (see experiments/configs/synthetic.py).

  python -m experiments.run --config=mnist_psg
"""

from experiments.configs import synthetic


def get_config():
  return synthetic.get_psg_config("mnist")
