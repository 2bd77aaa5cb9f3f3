"""FedLAP on CIFAR-10 with an IID split (five random disjoint fifths).

The paper reports 62.52 % (FedLAP) vs 73.5 % (FedAvg) here, against 71.91 % in
the non-IID setting.

  python -m experiments.run --config=cifar_iid      # or cifar_iid:dp for FedLAP-DP
"""

from experiments.configs import cifar_dp, cifar_nondp


def get_config(variant: str = "nondp"):
  if variant not in ("nondp", "dp"):
    raise ValueError(f"cifar_iid:{variant} is invalid; allowed: 'nondp' or 'dp'")
  config = cifar_dp.get_config() if variant == "dp" else cifar_nondp.get_config()
  config.data.partition = "iid"
  return config
