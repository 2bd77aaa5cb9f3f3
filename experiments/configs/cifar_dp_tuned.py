"""FedLAP-DP on CIFAR-10 with the tuned DP recipe of issue 18 (not the paper's loops).

The paper's privacy parameters (C=1, delta=1e-5) and model, with loops that spend
the same kind of budget differently (every change is either a different
(q, sigma, T) that the accountant counts, or post-processing of the released
noisy gradients):

* q ~ 0.17: B = 1,690 for the paper's 10,000 records per client (paper: B = 256,
  q = 0.0256); T = 20 noisy accesses per round (R_i 1 x max_outer 2 x
  batch_loop 10; paper 200), rounds = 3 (paper 30), sigma = 2.38: epsilon 2.79
  after round 3 (the paper's round-1 epsilon). Fewer, larger batches give
  cleaner matching targets at the same epsilon.
* ``client.average_targets``: the images are matched R_b = 50 times against the
  mean of each while-loop iteration's 10 noisy gradients (all at the same model:
  1/10 of the noise variance; post-processing).
* the client's model steps: R_l = 5 epochs at eta_0 = 0.2, client radius 10;
  ``lr_schedule='cosine_open'`` (no zero-rate last round, which would spend
  a third of the budget without moving the model); server at most 30 epochs
  (the server overfits the synthetic images with more).

Tuned with a width-32 ConvNet on 1,500-record clients (MNIST 10k, q = 256 /
1,513), checked on Fashion-MNIST and digits; README "A tuned DP recipe" has the
evidence and where it does not beat DP-FedAvg. For another epsilon or client
size keep q ~ 0.17 and recalibrate sigma (``experiments.run`` logs epsilon).

  python -m experiments.run --config=cifar_dp_tuned [--config.seed=1]
"""

from experiments.configs import cifar_dp

# The recipe (issue 18); sigma is for epsilon 2.79 after ROUNDS rounds at q ~ 0.17, T = 20.
ROUNDS = 3
NOISE_MULTIPLIER = 2.38
SAMPLING_RATE = 0.169   # B / min N_k the recipe was tuned at


# The recipe as overrides of a DP config (flattened field names).
RECIPE = {
    "rounds": ROUNDS, "learning_rate": 0.2, "lr_schedule": "cosine_open",
    "client.iterations": 1, "client.max_outer": 2, "client.batch_loop": 10,
    "client.average_targets": True, "client.boost_loop": 50, "client.inner_loop": 5,
    "client.radius": 10.0, "server.max_epochs": 30,
    "dp.noise_multiplier": NOISE_MULTIPLIER, "snapshot_rounds": (1, ROUNDS),
}


def apply_tuned_dp(config, batch_size: int):
  """Turns a DP config (``cifar_dp.apply_dp``) into the tuned recipe with Poisson batch ``batch_size``."""
  config.update_from_flattened_dict({**RECIPE, "client.batch_size": batch_size})
  return config


def get_config():
  return apply_tuned_dp(cifar_dp.get_config(), batch_size=1690)  # 0.169 x 10,000
