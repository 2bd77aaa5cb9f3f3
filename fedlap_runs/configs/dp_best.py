"""Each arm's best DP recipe found on the small-client research sets, at a target epsilon.

  python -m experiments.run --config=mnist_dp_best \\
      --config.data.source=npz:DIR/mnist_small.npz [--config.dp.target_epsilon=4]
  python -m experiments.run --config=mnist_fedavg_dp_best --config.data.source=npz:...

(``fmnist_`` likewise; ``--config=dp_best:DATASET_ARM`` with ``ARM`` ``fedlap`` or
``fedavg``). ``DIR/NAME.npz`` is built from the original IDX files by
``python -m fedlap_runs.datasets NAME --idx IDX_DIR --out DIR`` (8,000 training records,
five clients of two classes, ~1,600 records each); without ``data.source`` the run reads the
whole tfds data set (the paper's regime). The noise is calibrated so that the guarantee
(``dp.epsilon_for='replace_one'``) is ``dp.target_epsilon`` (default 4) after the last round,
delta 1e-5. Both arms share:

* the model: :class:`fedlap_jax.models.ScatterNet` with a linear head, a fixed,
  data-independent scattering front end (J = 2, L = 8; Tramer & Boneh, 2021) in place of the
  paper's ConvNet-128. It learns faster under DP noise than the ConvNet at every setting
  compared (benchmarks/results/dp_recipe.md). The front end is computed once, when the data
  are loaded (``data.features='scattering'``, model ``scattered_linear``: the same model,
  13x faster a round on CPU), so FedLAP-DP's synthetic sets are scattering features, not images;
* Poisson batches of 261 (q = 0.169 of the smallest client), clip C = 0.1, learning rate 1
  with the ``cosine_open`` schedule, 20 rounds: the best of each arm, chosen apart
  (FedLAP-DP's client model steps along the same clipped, noised gradients as DP-FedAvg's).

FedLAP-DP (``DATASET_fedlap``) departs from the paper: the hybrid recipe
(:data:`fedlap_runs.configs.fedlap.HYBRID_RECIPE`: the client's model steps along each
released noisy gradient, the synthetic sets are matched to each; the server starts from the
global model plus the mean client delta and refines it on the synthetic sets), 20 rounds of
T = 35 noisy gradients, without the image augmentations (DSA) that feature maps do not have.
DP-FedAvg (``DATASET_fedavg``): 5 local epochs a round, 20 rounds.

The recipes were chosen on MNIST's validation split (5,000 training images no client
holds), with the same number of runs for each arm; Fashion-MNIST runs MNIST's recipe, which
its own validation runs (learning rate 0.5 and 2, 30 rounds, for both arms) did not change.
"""

from fedlap_runs.configs import baselines, fedlap

DATASETS = ("mnist", "fmnist")
ROUNDS = 20
# What both arms share (flattened field names).
SHARED = {
  "data.features": "scattering",
  "model.name": "scattered_linear",
  "client.batch_size": 261,
  "dp.l2_clip_norm": 0.1,
  "dp.delta": 1e-5,
  "dp.target_epsilon": 4.0,
  "learning_rate": 1.0,
  "lr_schedule": "cosine_open",
  "rounds": ROUNDS,
}
# Each arm: the named config it starts from (a builder and its argument) and what it sets
# beyond SHARED.
ARMS = {
  "fedlap": (
    fedlap.get_config,
    "{}_dp_hybrid",
    {"snapshot_rounds": (1, ROUNDS), "client.dsa_strategy": "", "server.dsa_strategy": ""},
  ),
  "fedavg": (baselines.get_config, "{}_fedavg_dp", {}),
}


def get_config(arg: str):
  """``DATASET_ARM``: ``DATASET`` one of :data:`DATASETS`, ``ARM`` a key of :data:`ARMS`."""
  dataset, _, arm = arg.partition("_")
  if dataset not in DATASETS or arm not in ARMS:
    raise ValueError(
      f"dp_best:{arg} is invalid; allowed: DATASET_ARM with DATASET one of {DATASETS} and "
      f"ARM one of {tuple(ARMS)}"
    )
  build, base, own = ARMS[arm]
  config = build(base.format(dataset))
  config.update_from_flattened_dict({**SHARED, **own})
  return config
