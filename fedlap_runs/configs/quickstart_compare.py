"""FedLAP vs every comparison system of the paper on the quickstart data (digits, 5 clients x 2 classes).

  python -m experiments.run --config=quickstart_compare --workdir=runs/compare
  python -m experiments.run --config=quickstart_compare:add_remove   # matched on the paper's notion
  python -m experiments.report runs/compare/* --out runs/compare_report

A suite of twelve runs on the same data (normalised with the statistics of the
public test split, as FedLAP-DP needs), model (ConvNet 32 x 2) and evaluation:

* non-DP, 10 rounds each: FedLAP (the quickstart's), FedAvg, FedProx (mu 0.1),
  SCAFFOLD, FedSGD; baselines with 5 local epochs of Poisson batches (B = 64),
  client lr 0.1 with the cosine schedule.
* DP at matched epsilon: FedLAP-DP (the quickstart's: sigma 1, T = 10 per
  round, 10 rounds), DP-FedAvg and DP-FedProx (C = 0.1, 2 local epochs, lr 1.0).
  Their noise multiplier is calibrated with the same accountant so that the
  epsilon after the last round equals FedLAP-DP's (``dp.match_epsilon_of``): the
  guarantee (replace-one, given the public client sizes) by default, the paper's
  add/remove figure with ``quickstart_compare:add_remove`` (``dp.epsilon_for`` of every
  DP run alike). The client sizes come from the partition itself, so
  :mod:`experiments.run` does this when the suite starts, and the match holds for any
  seed.
* the synthetic-data systems, shrunk to seconds each (the published loops are
  in ``fedlap_runs/configs/synthetic_baselines.py``): FedDM (10 rounds, ipc 10, 50
  image iterations per round at ``rho = 2``, about FedDM's ``rho = 5`` relative
  to the smaller model's parameter norm, 12 vs 28; server 100 epochs); DSC
  one-shot federated and centralized (ipc 10, 10 fresh networks of the
  published ipc-10 loops, server 300 epochs); PSG (ipc 10, 5 fresh networks,
  ``T = 500`` noisy accesses per client, C = 0.1, its epsilon matched to
  FedLAP-DP's, server 300 epochs).
"""

import ml_collections

from fedlap_jax.methods.condensation.one_shot import DC_LOOPS
from fedlap_jax.baselines import DP_METHODS, METHODS
from fedlap_jax.methods import REGISTRY

from fedlap_runs.configs import quickstart, synthetic_baselines

NONDP_BASELINES = tuple(m for m in METHODS if REGISTRY[m].privacy == "never")
DP_BASELINES = DP_METHODS
DP_LOCAL_EPOCHS = 2
DP_BASELINE_LR = 1.0
# The argument of get_config: the notion every DP run's epsilon is matched on (dp.epsilon_for).
EPSILON_FOR = ("replace_one", "add_remove")


def _baseline(method: str, base) -> ml_collections.ConfigDict:
  config = quickstart.nondp_config()
  config.method = method
  config.learning_rate = 0.1
  config.client.batch_size = base.client.batch_size
  return config


def matched_dp_baseline(
  method: str, fedlap_dp, name: str = "fedlap_dp"
) -> ml_collections.ConfigDict:
  """A DP baseline whose epsilon after the last round equals that of the suite's run ``name``.

  ``fedlap_dp`` is that run's config. The noise multiplier is left to
  :func:`fedlap_runs.calibration.match_epsilons` (``dp.match_epsilon_of``), which needs
  the client sizes of the data.
  """
  b = fedlap_dp.client.batch_size
  config = quickstart.nondp_config()
  config.method = method
  config.learning_rate = DP_BASELINE_LR
  config.client.batch_size = b
  config.baseline.local_epochs = DP_LOCAL_EPOCHS
  return _matched_dp(config, fedlap_dp, name)


def _matched_dp(config, fedlap_dp, name: str) -> ml_collections.ConfigDict:
  """``config`` made private like the suite's run ``name`` (``fedlap_dp``): its DP-safe
  normalisation and delta, clip 0.1, the noise matched to its epsilon."""
  config.data.normalisation = fedlap_dp.data.normalisation  # DP-safe, as FedLAP-DP
  config.dp.enabled = True
  config.dp.l2_clip_norm = 0.1
  config.dp.delta = fedlap_dp.dp.delta
  config.dp.match_epsilon_of = name
  return config


def feddm_config() -> ml_collections.ConfigDict:
  """FedDM on the quickstart data: 10 rounds of 50 distribution-matching iterations."""
  config = quickstart.nondp_config()
  config.method = "feddm"
  config.synthetic_init = "real"
  f = config.feddm
  f.image_updates = 50
  f.rho = 2.0
  f.image_lr = 1.0
  f.dsa_strategy = ""
  synthetic_baselines.server(config, epochs=100)
  return config


def oneshot_config(method: str, *, networks: int, batch_loop: int) -> ml_collections.ConfigDict:
  """DSC (``dsc``, ``dsc_centralized``) or PSG (``psg``, without its DP fields) on the quickstart data."""
  config = quickstart.nondp_config()
  config.method = method
  config.rounds = 1
  config.synthetic_init = "noise"
  config.checkpoint_every = 1
  config.snapshot_rounds = (1,)
  c = config.condense
  c.networks = networks
  c.outer_loop, c.inner_loop = DC_LOOPS[config.client.ipc]
  c.batch_loop = batch_loop
  c.model_batch_size = 256
  c.image_lr = 0.1
  c.net_lr = 0.01
  c.dsa_strategy = ""
  synthetic_baselines.server(config, epochs=300)
  return config


def psg_config(fedlap_dp, name: str = "fedlap_dp") -> ml_collections.ConfigDict:
  """PSG with its epsilon matched to the suite's run ``name`` (``fedlap_dp`` its config)."""
  config = oneshot_config("psg", networks=5, batch_loop=10)
  return _matched_dp(config, fedlap_dp, name)


def get_config(epsilon_for: str = "replace_one"):
  """The suite; ``epsilon_for`` (one of :data:`EPSILON_FOR`) is the notion every DP run is
  matched on."""
  if epsilon_for not in EPSILON_FOR:
    raise ValueError(
      f"quickstart_compare:{epsilon_for} is invalid; allowed: one of {EPSILON_FOR} (the "
      "epsilon every DP run is matched on)"
    )
  config = ml_collections.ConfigDict()
  config.suite = ml_collections.ConfigDict()
  nondp = quickstart.nondp_config()
  dp = quickstart.dp_config()
  config.suite.fedlap = nondp
  for method in NONDP_BASELINES:
    config.suite[method] = _baseline(method, nondp)
  config.suite.fedlap_dp = dp
  for method in DP_BASELINES:
    config.suite[method] = matched_dp_baseline(method, dp)
  config.suite.feddm = feddm_config()
  config.suite.dsc = oneshot_config("dsc", networks=10, batch_loop=1)
  config.suite.dsc_centralized = oneshot_config("dsc_centralized", networks=10, batch_loop=1)
  config.suite.psg = psg_config(dp)
  # One normalisation for every run, the DP-safe one of FedLAP-DP (statistics of the public test
  # split): the same preprocessing in every column, and one "digits" row in the report.
  for run in config.suite.values():
    run.data.normalisation = dp.data.normalisation
    if run.dp.enabled:
      run.dp.epsilon_for = epsilon_for
  return config
