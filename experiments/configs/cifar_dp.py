"""FedLAP-DP on CIFAR-10, the paper's DP setting (Figure "dp", Table "perf_comparison").

30 rounds, ipc 10, R_i=4, max_outer=5, batch_loop=10, R_b=5, R_l=2 (so
T = 200 noisy real-data accesses per round); constant radius r=1.5, uniform
client weights; eta_0=0.002; no MSE term; synthetic images from N(0, 1) once and
carried across rounds; sigma=1, C=1, delta=1e-5, B=256 (add/remove epsilon, the
paper's notion, 2.79 after round 1 and 10.18 after round 15 with 10,000 records per
client; ``dp.epsilon_for='add_remove'``, so ``dp.target_epsilon`` calibrates that figure;
the reported ``epsilon`` is the replace-one figure, ``epsilon_add_remove`` the paper's).

  python -m experiments.run --config=cifar_dp [--config.seed=1]
"""

from fedlap_jax.config import paper_dp_config

from experiments.configs import default, schema


def apply_dp(config):
  """Turns a config into the published FedLAP-DP setting (:func:`fedlap_jax.config.paper_dp_config`:
  loops, radius, rounds, learning rate, DP), reporting its add/remove epsilon."""
  schema.write_fedlap(config, paper_dp_config())
  config.dp.epsilon_for = "add_remove"  # the paper's figure (module docstring)
  config.checkpoint_every = 1
  config.snapshot_rounds = (1, 15)
  return config


def get_config():
  return apply_dp(default.get_config())
