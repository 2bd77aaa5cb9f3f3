"""FedLAP-DP on Fashion-MNIST with the tuned DP recipe of issue 18 (see ``cifar_dp_tuned``).

B = 2028 = 0.169 x the smallest client (12,000 records), T = 20 per round, 3 rounds,
sigma 2.38: epsilon 2.79 after round 3. For the 1,500-record clients of a 10,000-image
subset use B = 256 (``--config.client.batch_size=256``, same sigma and epsilon).

  python -m experiments.run --config=fmnist_dp_tuned [--config.seed=1]
"""

from experiments.configs import cifar_dp_tuned, fmnist_dp


def get_config():
  return cifar_dp_tuned.apply_tuned_dp(fmnist_dp.get_config(), batch_size=2028)
