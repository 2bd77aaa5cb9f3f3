"""Defaults for every experiment: the paper's non-DP CIFAR-10 FedLAP setting.

Every named config in this folder starts from :func:`get_config` and overrides
a few fields; any field can be overridden on the command line, e.g.
``--config.seed=1 --config.client.ipc=20``.

Sections:

* top level: ``method`` (``fedlap``, a baseline: ``fedavg``, ``fedprox``,
  ``fedsgd``, ``scaffold``, ``dp_fedavg``, ``dp_fedprox``, or a synthetic-data
  system: ``feddm``, ``dsc``, ``dsc_centralized``, ``psg``), ``seed`` (None: drawn
  under DP, :mod:`fedlap_runs.seeds`),
  ``rounds`` (``M``), ``learning_rate`` (``eta_0`` of the cosine schedule; the
  server's constant rate for FedDM / DSC / PSG), ``synthetic_init`` and run-time
  options (checkpoints, plots, evaluation).
* ``data``: dataset, source (``tfds``, ``sklearn``, ``npz:PATH``, ``subset:NAME``), partition.
* ``model``: ``name``, ``convnet`` (``width`` filters, ``depth`` blocks, ``norm``) or
  ``MODULE:ATTR``, a callable taking ``num_classes`` and returning a ``flax.linen.Module``.
* ``client`` / ``server`` / ``dp``: written from the fields and defaults of
  :class:`fedlap_jax.methods.fedlap.config.ClientConfig`,
  :class:`~fedlap_jax.methods.fedlap.config.ServerConfig`
  and :class:`~fedlap_jax.dp_config.DPConfig` (:mod:`fedlap_runs.configs.schema`; the
  dataclasses document each field); ``dp`` adds ``enabled`` (switches DP on) and
  the run's calibration options. :func:`fedlap_runs.library_configs.library_config`
  builds the dataclasses back, so the core's validation runs on the resolved config.
  Three optimisers are sections of the fields of :class:`fedlap_jax.optim.Optimizer` there:
  ``client.model_optimizer`` (FedLAP's client model), ``client.image_optimizer`` (FedLAP's
  synthetic images at ``client.image_lr``; plain SGD there leaves them to
  ``client.image_momentum``) and ``server.optimizer`` (the server's descent of FedLAP, FedDM,
  DSC and PSG; plain SGD there leaves it to ``server.momentum`` and
  ``server.weight_decay``); the other methods refuse a choice in them.
  ``feddm.image_optimizer`` and ``condense.image_optimizer`` are FedDM's and DSC's / PSG's
  images' (plain SGD there leaves them to ``feddm.image_momentum`` /
  ``condense.image_momentum``). ``server.carry_state`` (FedLAP only) carries the server
  optimiser's state across rounds.
* ``baseline``: ``local_epochs``, FedProx's ``prox_mu`` and the server's rate ``server_lr``,
  the arguments of :func:`fedlap_jax.baselines.baseline_config` with its defaults, and the
  optimisers ``client_optimizer`` / ``server_optimizer``, sections of the fields of
  :class:`fedlap_jax.optim.Optimizer` (plain SGD: FedAvg; ``server_optimizer.name=yogi``
  with a ``server_lr`` such as 0.01 is FedYogi), for the gradient-sharing baselines (FedAvg,
  FedProx, ...); the other methods ignore the numbers and refuse a non-default optimiser.
* ``feddm``: FedDM's client loop
  (:class:`fedlap_jax.methods.feddm.distribution_matching.FedDMConfig`);
  ``condense``: DSC's / PSG's one-shot condensation
  (:class:`fedlap_jax.methods.condensation.one_shot.CondensationConfig`). Both also read
  ``client.ipc``, ``client.batch_size`` (real records per batch),
  ``synthetic_init``, the ``server`` section (their server's training) and
  ``learning_rate`` (the server's); PSG reads ``dp``. Builders of their named
  configs: ``fedlap_runs/configs/synthetic_baselines.py``.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from fedlap_jax import baselines, optim
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax import dp_config
from fedlap_jax.methods.fedlap import config as core

from fedlap_runs import method_entries
from fedlap_runs.configs import schema


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.method = "fedlap"  # or a baseline, or feddm / dsc / dsc_centralized / psg
  # The secret seed of every pseudo-random draw (fedlap_runs.seeds). None: a DP run draws one
  # from the operating system's entropy (128 bits) and keeps it in the work dir's config.json
  # (secret; a re-run resumes with it); a run without DP uses 0. A given seed (--config.seed=S)
  # reproduces a run; under DP it is guessable, and the run says its outputs are not private.
  config.seed = config_dict.placeholder(int)
  config.rounds = 200
  config.learning_rate = 0.1
  config.synthetic_init = "real"
  # "cosine" (reference: the last round's rate is ~0) or "cosine_open" (cos(pi (m-1) / M): no
  # zero-rate round, which under DP would spend privacy without moving the model).
  config.lr_schedule = "cosine"
  # "vmap": all clients side by side (FedLAP: batched steps, shared DSA family, masked loops);
  # "map": one after another (a K-th of the memory, same numbers); "shard": blocks of clients
  # on several devices. "auto" (the library's default): "shard" on several devices, else
  # "map" on the CPU (faster there, BENCHMARKS.md) and, for FedLAP on an accelerator, "vmap".
  config.client_backend = "auto"

  config.data = ml_collections.ConfigDict()
  config.data.name = "cifar10"
  config.data.source = "tfds"  # "tfds" | "sklearn" | "npz:PATH" | "subset:NAME"
  config.data.data_dir = config_dict.placeholder(str)  # tfds data_dir (None: tfds default)
  config.data.cache_dir = ""  # "" = ~/.cache/fedlap_jax; "none" = no cache
  config.data.partition = "paper"  # "paper" | "iid" | "dirichlet"
  config.data.dirichlet_alpha = 0.5
  config.data.num_clients = 5
  # Clients per round m, uniform without replacement, drawn from (participation_seed, round);
  # None = all K (every round, every client). Each client's privacy ledger charges only the
  # rounds it took part in (q_k = B / N_k); metrics.jsonl's epsilon is the maximum over clients.
  config.data.clients_per_round = config_dict.placeholder(int)
  # Public seed of the draw (who takes part is released): never the secret `seed`.
  config.data.participation_seed = 0
  # Public seed of the partition (iid, dirichlet) and of the train_fraction subsample: client
  # sizes and classes are released, so they are never drawn from the secret `seed`.
  config.data.partition_seed = 0
  config.data.train_fraction = 1.0
  # Where mean/std come from: "auto" (published constants of mnist / fashion_mnist / cifar10,
  # else the training split) | "published" | "given" (data.mean, data.std per channel, of
  # pixels in [0, 1]) | "test_split" | "train_split". DP runs may not use the training split.
  config.data.normalisation = "auto"
  config.data.mean = config_dict.placeholder(tuple)
  config.data.std = config_dict.placeholder(tuple)
  # "pixels" | "scattering": each image replaced by its scattering once, when loaded (a fixed
  # transform, no privacy cost), for the `scattered_` models.
  config.data.features = "pixels"

  config.model = ml_collections.ConfigDict()
  config.model.name = "convnet"  # or MODULE:ATTR (fedlap_runs.catalog.model_factory)
  config.model.width = 128
  config.model.depth = 3
  config.model.norm = "instance"
  config.model.conv_bias = True  # as the authors; False drops what instance norm cancels

  # client / server / dp: the fields of fedlap_jax.methods.fedlap.config.ClientConfig / ServerConfig
  # / DPConfig with their defaults (the paper's non-DP CIFAR-10 setting; dp: the paper's
  # sigma, C and delta, used once dp.enabled is True). The dataclasses document them.
  config.client = schema.section(
    core.ClientConfig, exclude=("dp", "model_optimizer", "image_optimizer")
  )
  config.server = schema.section(core.ServerConfig, exclude=("optimizer",))
  # FedLAP's client model optimiser and the server's optimiser (FedLAP, FedDM, DSC, PSG):
  # sections of the fields of fedlap_jax.optim.Optimizer, plain SGD by default (the server's
  # SGD is server.momentum / server.weight_decay; server.optimizer names another one, e.g.
  # server.optimizer.name=adam). The other methods refuse a choice there. server.carry_state
  # (FedLAP only) carries the server optimiser's state across rounds (default: afresh each).
  config.client.model_optimizer = schema.section(optim.Optimizer)
  config.client.image_optimizer = schema.section(optim.Optimizer)
  config.server.optimizer = schema.section(optim.Optimizer)

  config.dp = ml_collections.ConfigDict()
  config.dp.enabled = False
  config.dp.update(schema.section(dp_config.DPConfig, **dataclasses.asdict(core.PAPER_DP)))
  # In a suite: the name of another DP run of the suite. experiments.run then sets this
  # run's noise_multiplier, when it starts (from the data's client sizes), so that its
  # epsilon after the last round equals that run's. "" uses noise_multiplier as given.
  config.dp.match_epsilon_of = ""
  # Epsilon (nats, at dp.delta) after the last round: experiments.run sets noise_multiplier,
  # when the run starts, to the smallest sigma whose epsilon is at most this, with the
  # accountant the ledger uses (B / min_k N_k, the method's noisy steps per round, rounds).
  # None uses noise_multiplier as given. Refused with exit 2 if it needs sigma > 100.
  config.dp.target_epsilon = config_dict.placeholder(float)
  # The neighbouring relation whose epsilon target_epsilon / match_epsilon_of calibrate:
  # "replace_one" (the guarantee that holds: client sizes and classes are public) or
  # "add_remove" (the paper's notion, for reproducing its numbers). Every run reports both:
  # "epsilon" (replace-one) and "epsilon_add_remove".
  config.dp.epsilon_for = "replace_one"

  config.baseline = schema.arguments(
    baselines.baseline_config, "local_epochs", "prox_mu", "server_lr"
  )
  config.baseline.client_optimizer = schema.section(optim.Optimizer)
  config.baseline.server_optimizer = schema.section(optim.Optimizer)

  # FedDM (method "feddm") and DSC / PSG (methods "dsc", "dsc_centralized", "psg"): the
  # fields of fedlap_jax.methods.feddm.distribution_matching.FedDMConfig and
  # fedlap_jax.methods.condensation.one_shot.CondensationConfig
  # that are the method's own (ipc, batch sizes, synthetic_init and the server come from
  # client / server / the top level). condense.outer_loop / inner_loop None = the
  # published loops for client.ipc (fedlap_jax.methods.condensation.one_shot.dc_loops);
  # condense.lr_decay multiplies the server's learning rate for the second half of
  # server.max_epochs.
  config.feddm = schema.section(feddm.FedDMConfig, exclude=method_entries.FEDDM_SHARED)
  config.condense = schema.section(
    condensation.CondensationConfig,
    exclude=method_entries.CONDENSE_SHARED,
    outer_loop=None,
    inner_loop=None,
  )
  config.condense.update(
    schema.section(condensation.OneShotConfig, exclude=method_entries.ONESHOT_SHARED)
  )
  # Their synthetic images' optimiser: sections of the fields of fedlap_jax.optim.Optimizer,
  # plain SGD by default (the SGD of feddm.image_momentum / condense.image_momentum; e.g.
  # feddm.image_optimizer.name=adam with feddm.image_momentum=0 steps Adam at feddm.image_lr).
  config.feddm.image_optimizer = schema.section(optim.Optimizer)
  config.condense.image_optimizer = schema.section(optim.Optimizer)

  # Run-time options (may change when a run is resumed).
  # Where compiled XLA programs are kept between runs (fedlap_runs.compilation_cache): ""
  # = $FEDLAP_COMPILATION_CACHE, else ~/.cache/fedlap_jax/jax_compilation_cache; "none" = off.
  config.compilation_cache_dir = ""
  config.checkpoint_every = 5  # rounds; the last round is always saved
  config.keep_checkpoints = 2
  # Test-set images per evaluation step; None: 16 on CPU, 1000 on accelerators.
  config.eval_chunk_size = config_dict.placeholder(int)
  # Rounds whose synthetic sets are saved and plotted (plus the last round).
  config.snapshot_rounds = (1,)
  config.plots = True
  config.progress_bar = True
  # DP runs write only DP outputs and test-set metrics; True adds raw statistics of the
  # clients' records (clip fractions, realised batch sizes, training losses) to
  # metrics.jsonl under "nonprivate", outside the privacy guarantee (for debugging).
  config.debug_nonprivate_stats = False
  # Seconds a round may go on after SIGTERM (schedulers kill ~30 s after it): a round that has
  # not finished by then is abandoned (charged to the privacy ledger as spent) and redone when
  # the run resumes; the process exits with 143 at once. Leave room for a checkpoint save.
  config.termination_grace_seconds = 20.0
  # Display name in reports (experiments.report), e.g. "FedLAP-DP (tuned)"; "" = the method's.
  config.label = ""
  return config
