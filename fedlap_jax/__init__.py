"""fedlap_jax: FedLAP-DP in JAX.

Federated learning by sharing differentially private loss approximations
(Wang et al., PoPETs 2024): clients send small synthetic sets whose gradients
match those of their (privatised) real data; the server trains on their union
inside a trust region.

The core is model-agnostic: every function takes ``apply_fn(params, x) ->
logits`` and a parameter pytree. Importing this package does not import
TensorFlow; :mod:`fedlap_jax.accounting` imports ``dp_accounting`` lazily.

Main entry points:

* :func:`local_approx` -- Algorithms 1 / 3 on one client.
* :func:`global_update` -- Algorithm 2 on the server.
* :func:`client_step`, :func:`server_step_with_state` -- a round's two halves (what a
  client computes and sends, a :class:`ClientUpdate`; what the server does
  with them), shared by every front end; :func:`round_learning_rates`.
* :data:`REGISTRY` (:mod:`fedlap_jax.methods`) -- every method as one :class:`Method` value;
  :func:`rounds.algorithm` / :func:`rounds.make_round_fn` -- the one jitted round over any
  method, its model (:class:`ModelFns`) and its run's facts (:class:`RunFacts`,
  :func:`rounds.run_facts`); :func:`init_state` -- FedLAP's state before round 1.
* :meth:`FedLAPConfig.with_dp`, :meth:`ClientConfig.with_dp` -- DP on in one call;
  :func:`paper_dp_config` -- the paper's DP setting.
* :func:`stack_clients`, :func:`pad_client`, :func:`client_synthetic` -- client
  data padded to a fixed capacity (one compilation for every client) and a
  client's first synthetic set.
* :func:`matching_distance` -- ``L_dis``.
* :mod:`fedlap_jax.synthetic` -- synthetic-set layout and first images
  (:func:`synthetic_labels`, :func:`noise_images`, :func:`real_images`), shared
  by every method that sends synthetic sets.
* :func:`poisson_gradient` (with its query :class:`PoissonGradient`) -- the one DP
  gradient every method's access to records goes through; :func:`poisson_sample` -- its draw.
* :mod:`fedlap_jax.accounting` -- :class:`DpMechanism`, its epsilons (replace-one by PLD,
  add/remove by RDP) and the ledgers.
* :class:`ConvNet` -- the paper's model.
* :mod:`fedlap_jax.baselines` -- the gradient-sharing baselines (FedAvg, ...);
  :mod:`fedlap_jax.methods.feddm.distribution_matching` -- FedDM;
  :mod:`fedlap_jax.methods.condensation.one_shot` -- DSC and
  PSG (one-shot): the paper's comparison systems on the same primitives.
* :class:`ConfigError` -- every refused setting, with ``field``, ``value``, ``allowed``.
"""

from fedlap_jax import accounting, algorithm, dsa, methods, rounds, synthetic
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax.algorithm import FederatedAlgorithm
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.client import (
  ClientUpdate,
  LocalApproxMetrics,
  client_step,
  local_approx,
)
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  check_labels,
  num_classes_of,
  pad_client,
  pixel_normalisation,
  stack_clients,
)
from fedlap_jax.methods.fedlap.config import (
  ClientConfig,
  FedLAPConfig,
  ServerConfig,
  paper_dp_config,
  paper_nondp_config,
)
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.dsa import augment
from fedlap_jax.methods.fedlap.state import (
  FedLAPState,
  RoundMetrics,
  init_state,
  round_learning_rates,
)
from fedlap_jax.matching import matching_distance, matching_step
from fedlap_jax.method import Method, ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.models import ConvNet, count_params, init_convnet
from fedlap_jax.privacy import (
  PoissonBatch,
  PoissonGradient,
  clipped_gradient_sum,
  per_example_gradients,
  poisson_gradient,
  poisson_sample,
  real_gradient,
)
from fedlap_jax.methods.fedlap.radius import calibrate_radius, server_radius
from fedlap_jax.methods.fedlap.server import ServerMetrics, global_update, server_step_with_state
from fedlap_jax.synthetic import (
  class_batch,
  class_blocks,
  client_synthetic,
  initial_synthetic,
  noise_images,
  real_images,
  synthetic_labels,
)
from fedlap_jax.training import cosine_learning_rate, evaluate, tree_distance

__version__ = "0.1.0"

__all__ = [
  "ClientConfig",
  "ClientData",
  "ClientUpdate",
  "ConfigError",
  "client_step",
  "server_step_with_state",
  "round_learning_rates",
  "FederatedAlgorithm",
  "algorithm",
  "ConvNet",
  "DPConfig",
  "FedLAPConfig",
  "FedLAPState",
  "condensation",
  "feddm",
  "Method",
  "methods",
  "ModelFns",
  "REGISTRY",
  "rounds",
  "RunFacts",
  "LocalApproxMetrics",
  "PoissonBatch",
  "PoissonGradient",
  "RoundMetrics",
  "ServerConfig",
  "ServerMetrics",
  "SyntheticSet",
  "accounting",
  "augment",
  "calibrate_radius",
  "clipped_gradient_sum",
  "cosine_learning_rate",
  "count_params",
  "dsa",
  "evaluate",
  "global_update",
  "init_convnet",
  "init_state",
  "local_approx",
  "matching_distance",
  "matching_step",
  "paper_dp_config",
  "paper_nondp_config",
  "per_example_gradients",
  "pixel_normalisation",
  "poisson_gradient",
  "poisson_sample",
  "real_gradient",
  "class_batch",
  "class_blocks",
  "initial_synthetic",
  "noise_images",
  "real_images",
  "server_radius",
  "stack_clients",
  "pad_client",
  "num_classes_of",
  "check_labels",
  "client_synthetic",
  "synthetic",
  "synthetic_labels",
  "tree_distance",
]
