"""Quickstart: FedLAP-DP and FedLAP on scikit-learn's bundled digits (real data, offline).

  python -m experiments.run --config=quickstart            # both: runs/quickstart/{fedlap_dp,fedlap}
  python -m experiments.run --config=quickstart:dp         # FedLAP-DP only -> runs/quickstart_dp
  python -m experiments.run --config=quickstart:nondp      # FedLAP only (= --config=quickstart_nondp)
  python -m experiments.run --config=quickstart:dp_loops   # FedLAP-DP with the older loops
  python -m experiments.run --config=quickstart:dp_tuned   # FedLAP-DP, tuned recipe (= digits_dp_tuned)
  python -m experiments.run --config=quickstart:fedadam    # FedAdam (FedAvg's clients, server Adam)

Five clients own two digit classes each (the paper's class order; 274-283
records per client), a ConvNet with 32 filters and 2 blocks on 8x8x1 images,
about a minute for both on 2 idle CPU cores.

* FedLAP-DP (``fedlap_dp``, ``quickstart:dp``): the hybrid recipe,
  ``digits_dp_hybrid`` (DP-SGD client path on un-augmented real batches at
  q = 46 / 274, T = 20 per round, FedAvg start, 5 epochs on the synthetic sets;
  5 rounds, sigma 2.92: ``quickstart:dp``: epsilon 5.116 after 5 rounds (add/remove
  2.777)). How it compares with DP-FedAvg
  at equal epsilon is in docs/results.md. It uploads one model delta per client
  and round besides the synthetic set (the Flower app sends both).
* FedLAP-DP with the older loops (``quickstart:dp_loops``, :func:`dp_config`, the base
  of the digits' named configs and of many tests): sigma=1, C=1, delta=1e-5, B=64
  Poisson (q = 64 / 274), T=10 noisy accesses per round, 10 rounds
  (``quickstart:dp_loops``: epsilon 28.64 after 10 rounds (add/remove 18.89));
  synthetic images from N(0, 1) once; constant radius r=5; eta_0=0.05, tau=100;
  pixels standardised with the statistics of the public test split
  (``data.normalisation='test_split'``).
* FedLAP (``fedlap``): synthetic images re-drawn from real images every round,
  r=5 calibrated per client (30 epochs), server strategy ``min``; eta_0=0.1,
  tau=10, lambda=0.1, 10 rounds.

With no argument the config is a *suite*: ``config.suite.<name>`` holds one
full config per run, and ``experiments.run`` runs them one after another in
``WORKDIR/<name>`` and writes a comparison to ``WORKDIR/report``. Override a
field of one run with ``--config.suite.fedlap_dp.seed=1``.
"""

import dataclasses

import ml_collections

from fedlap_jax.methods import fedavg

from fedlap_runs.configs import default, fedlap

VARIANTS = ("both", "dp", "dp_loops", "dp_tuned", "nondp", "fedadam")
FEDADAM_SERVER_LR = 0.03  # of 0.01, 0.03, 0.1: the best test accuracy after 5 rounds on digits
BATCH_SIZE_Q017 = 46  # Poisson batch of the DP recipes: q = 0.169 x 274, the smallest client


def _common(config):
  config.rounds = 10
  config.data.name = "digits"
  config.data.source = "sklearn"
  config.model.width = 32
  config.model.depth = 2
  c = config.client
  c.ipc = 10
  c.iterations = 1
  c.max_outer = 2
  c.batch_loop = 5
  c.boost_loop = 5
  c.batch_size = 64
  c.radius = 5.0
  config.checkpoint_every = 5
  config.snapshot_rounds = (1, 5)
  return config


def dp_config():
  """FedLAP-DP on digits with the older loops of the project notes (``quickstart:dp_loops``)."""
  config = _common(default.get_config())
  config.learning_rate = 0.05
  config.synthetic_init = "noise"
  c = config.client
  c.inner_loop = 1
  c.mse_weight = 0.0
  c.calibrate_radius = False
  # Digits has no published constants; the training split's statistics would leak.
  config.data.normalisation = "test_split"
  config.server.radius_strategy = "constant"
  config.server.weighting = "uniform"
  config.server.max_epochs = 50
  config.dp.enabled = True
  config.dp.noise_multiplier = 1.0
  config.dp.l2_clip_norm = 1.0
  config.dp.delta = 1e-5
  return config


def nondp_config():
  """FedLAP on digits (the recipe of the project notes)."""
  config = _common(default.get_config())
  config.learning_rate = 0.1
  config.synthetic_init = "real"
  c = config.client
  c.inner_loop = 0
  c.calibrate_radius = True
  c.calibration_epochs = 30
  c.image_lr = 10.0
  config.server.max_epochs = 100
  return config


def hybrid_config():
  """FedLAP-DP on digits with the hybrid recipe (``quickstart:dp``, ``digits_dp_hybrid``:
  :data:`fedlap_runs.configs.fedlap.HYBRID_RECIPE`)."""
  return fedlap.apply_hybrid_dp(dp_config(), batch_size=BATCH_SIZE_Q017)


def tuned_config():
  """FedLAP-DP on digits with the tuned recipe (``quickstart:dp_tuned``, ``digits_dp_tuned``:
  :data:`fedlap_runs.configs.fedlap.TUNED_RECIPE`; sigma 2.38:
  ``quickstart:dp_tuned``: epsilon 4.82 after 3 rounds (add/remove 2.77))."""
  return fedlap.apply_tuned_dp(dp_config(), batch_size=BATCH_SIZE_Q017)


def fedadam_config():
  """FedAdam on digits (``quickstart:fedadam``): FedAvg's clients (the baselines' 5 local
  epochs at eta_0 = 0.1, B = 64) and the server's Adam of ``config.fedadam``
  (:class:`fedlap_jax.methods.fedavg.AdamServer`); 10 rounds."""
  config = default.get_config()
  config.method = "fedadam"
  config.rounds = 10
  config.learning_rate = 0.1
  config.data.name = "digits"
  config.data.source = "sklearn"
  config.model.width = 32
  config.model.depth = 2
  config.client.batch_size = 64
  config.checkpoint_every = 5
  config.fedadam = ml_collections.ConfigDict(
    dataclasses.asdict(fedavg.AdamServer(learning_rate=FEDADAM_SERVER_LR))
  )
  return config


def both_config():
  """The suite of FedLAP-DP (the hybrid recipe) and FedLAP."""
  config = ml_collections.ConfigDict()
  config.suite = ml_collections.ConfigDict()
  config.suite.fedlap_dp = hybrid_config()
  config.suite.fedlap = nondp_config()
  return config


# The config of each variant (VARIANTS, in order).
BUILDERS = {
  "both": both_config,
  "dp": hybrid_config,
  "dp_loops": dp_config,
  "dp_tuned": tuned_config,
  "nondp": nondp_config,
  "fedadam": fedadam_config,
}


def get_config(variant: str = "both"):
  if variant not in BUILDERS:
    raise ValueError(f"quickstart:{variant} is invalid; allowed: one of {VARIANTS}")
  return BUILDERS[variant]()
