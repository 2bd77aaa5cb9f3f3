"""FedLAP on CIFAR-10, the paper's non-DP setting (Table "perf_comparison").

200 rounds, ipc 50 (upload 100 x 3072 floats per client and round, 0.96x the
320,010 parameters of ConvNet-128), R_i=1, max_outer=5, batch_loop=40, R_b=5,
R_l=0; r=10 calibrated per client, server strategy ``min``; eta_0=0.1 (cosine),
tau=100 with momentum 0.5, lambda=0.1; synthetic images re-drawn from real data
every round; 5 clients with 2 classes each.

  python -m experiments.run --config=cifar_nondp [--config.seed=1]
"""

from experiments.configs import default


def get_config():
  return default.get_config()
