"""FedLAP on scikit-learn's digits alone: the same as ``--config=quickstart:nondp``.

  python -m experiments.run --config=quickstart_nondp    # -> runs/quickstart_nondp
"""

from experiments.configs import quickstart


def get_config():
  return quickstart.nondp_config()
