"""FedLAP-DP hybrid on Fashion-MNIST (issue 18): ``mnist_dp_hybrid``'s split, C 1 and eta_0 0.3.

The recipe of ``digits_dp_hybrid`` (DP-SGD client path on un-augmented real batches, FedAvg
start, 5 epochs at lr 0.03 on the synthetic sets) with ``mnist_dp_hybrid``'s budget split
(T = 35 per round, 10 rounds, sigma 5.18: epsilon 2.78) and the (C, eta_0) = (1, 0.3) that
won the seed-0 grid on ``fmnist10k``:

* B = 2028 = 0.169 x the smallest client (12,000 records); on a 10,000-image subset with
  1,555-record clients use B = 263 (the same q, sigma and epsilon).

On fmnist10k (ConvNet 32x3, seeds 0-2) it reached 69.5 +- 3.2 % at epsilon 2.79 (H100) and
69.7 +- 1.3 % at 10.18 (CPU), level with DP-FedAvg given the same q and rounds (70.1 +- 1.2
and 69.2 +- 2.3 %); README, "A tuned DP recipe (issue 18)".

  python -m experiments.run --config=fmnist_dp_hybrid [--config.seed=1]
"""

from experiments.configs import digits_dp_hybrid, fmnist_dp, mnist_dp_hybrid

SPLIT = {**mnist_dp_hybrid.SPLIT, "dp.l2_clip_norm": 1.0, "learning_rate": 0.3}


def get_config():
  return digits_dp_hybrid.apply_hybrid_dp(fmnist_dp.get_config(), batch_size=2028, **SPLIT)
