"""FedLAP-DP on scikit-learn's digits with the tuned DP recipe (the quickstart's FedLAP-DP run
with ``cifar_dp_tuned.apply_tuned_dp``).

Five clients of 274-283 records, ConvNet 32 x 2, B = 46 (q = 0.17), T = 20 per round,
3 rounds, sigma 2.38: epsilon 2.79 after round 3 (``cifar_dp_tuned`` has the recipe).

  python -m experiments.run --config=digits_dp_tuned [--config.seed=1]
"""

from experiments.configs import cifar_dp_tuned, quickstart


def get_config():
  return cifar_dp_tuned.apply_tuned_dp(quickstart.dp_config(), batch_size=46)  # 0.169 x 274
