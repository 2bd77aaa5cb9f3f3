"""DSC on fmnist: one-shot gradient matching (see experiments/configs/synthetic.py).

  python -m experiments.run --config=fmnist_dsc                # centralized, ipc 50 (Table 1)
  python -m experiments.run --config=fmnist_dsc:federated10    # [centralized|federated][10|50]
"""

from experiments.configs import synthetic


def get_config(variant: str = ""):
  return synthetic.get_dsc_config("fmnist", variant)
