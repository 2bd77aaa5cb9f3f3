"""Configuration of FedLAP / FedLAP-DP as frozen dataclasses.

The configs are hashable, so they are passed to jitted functions as static
arguments: every loop bound below is a compile-time constant, while the
learning rate and the round index are traced values (one compilation serves a
whole run).

Names follow the paper and the authors' implementation:

==================  ==============  ====================================field               paper           meaning
==================  ==============  ====================================``iterations``      ``R_i``         trajectories resampled per round
``max_outer``       (while loop)    bound on the radius-limited while loop
``batch_loop``      --              real batches per while-loop iteration
``boost_loop``      ``R_b``         synthetic updates per real batch
``inner_loop``      ``R_l``         local model epochs on the synthetic set
``image_lr``        ``tau``         SGD learning rate of the synthetic images
``mse_weight``      ``lambda``      weight of the MSE term of ``L_dis``
``radius``          ``r``           trust-region radius
==================  ==============  ====================================
Every constructor validates its fields and raises
:class:`~fedlap_jax.checks.ConfigError` (a ``ValueError``) naming the field,
the value and what is allowed. Nothing is clamped silently.
"""

from __future__ import annotations

import dataclasses

import optax

from fedlap_jax import dsa, optim
from fedlap_jax.checks import (
  is_real,
  nonneg_float,
  nonneg_int,
  one_of,
  positive_float,
  positive_int,
  require,
)
from fedlap_jax.dispatch import WEIGHTINGS, resolve_weighting
from fedlap_jax.dp_config import DpAccesses, DPConfig, poisson_capacity
from fedlap_jax.optim import check_other_than_sgd
from fedlap_jax.synthetic import SYNTHETIC_INITS, check_synthetic_learner
from fedlap_jax.training import LR_SCHEDULES


DSA_FAMILY_DRAWS = ("shared", "per_client")
RADIUS_STRATEGIES = ("min", "max", "median", "mean", "constant", "fixed")
MODEL_STEPS = ("synthetic", "noisy_real")
SERVER_STARTS = ("global", "fedavg_delta")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
  """Local approximation (Algorithms 1 and 3) on one client.

  Defaults are the paper's non-DP CIFAR-10 configuration.

  Attributes:
    ipc: synthetic images per class the client owns.
    iterations: ``R_i``, how many trajectories a round runs: each starts
      again from the global model ``w_g`` (the images carry over), so the
      images are matched along ``R_i`` fresh training paths.
    max_outer: the bound (5) of the while loop of one trajectory: it runs
      while the local model stays within ``radius`` of ``w_g``, at most
      ``max_outer`` iterations.
    batch_loop: real batches per while-loop iteration: each gives one real
      gradient (noisy under DP), the target the images are matched against;
      with ``R_i`` and ``max_outer`` it fixes ``T = R_i * max_outer *
      batch_loop``, the noisy accesses per round the accountant charges.
    boost_loop: ``R_b``, image updates per real gradient: the synthetic
      images take ``R_b`` steps of the matching loss against the same target.
    inner_loop: ``R_l``, epochs of SGD of the local model on the synthetic
      set after each while-loop iteration (how far the model moves along the
      trajectory; 0 keeps it at ``w_g``).
    batch_size: ``B``, expected Poisson batch size of real data: each record
      is drawn with probability ``q = B / N_k``.
    model_batch_size: batch size of model steps on synthetic data (512).
    image_lr: ``tau``, the learning rate of the SGD on the synthetic images
      (100 in the paper); image_momentum: that optimiser's momentum (0.5).
    mse_weight: ``lambda``, the weight of the squared-error term beside the
      cosine distance in the matching loss (0.1 without DP; 0 under DP).
    radius: ``r``, the trust-region radius (L2 over all parameters): a
      trajectory stops once the local model leaves the ball of radius ``r``
      around ``w_g``, and (without calibration) the ``r_k`` the client
      reports, which bounds the server's descent.
    calibrate_radius: if True (non-DP only), measure ``r_k`` on real data.
    calibration_epochs: epochs of the radius calibration (100).
    calibration_eval_size: if set, the real loss during calibration is
      measured on this many records of the client (fixed per round) instead of
      all of them, to bound its cost.
    dsa_strategy: DSA families, e.g. ``"color_crop_cutout_flip_scale_rotate"``;
      ``""`` for none.
    real_dsa_strategy: DSA families applied to the real batches whose
      (noisy) gradients are the matching targets; ``None`` (the paper): the
      same as ``dsa_strategy``, one draw shared by the real and the synthetic
      batch. ``""`` takes the real gradients on the records as they are (as
      DP-FedAvg does) while the synthetic batches keep ``dsa_strategy``; with
      ``model_steps='noisy_real'`` the client's model then steps along the
      gradient of the real data, not of augmented data. Privacy is unchanged:
      each record is still clipped and noised once per access.
    dsa_family_draw: who draws the DSA family of each augmented batch:
      ``"shared"`` (default): one draw per step common to the clients of a
      round, each client still drawing its own parameters of that family
      (clients run side by side then compute one family, not all six);
      ``"per_client"``: every client draws its own family (the random stream
      of earlier versions). Each client sees every family with the same
      probability either way; docs/benchmarks.md compares the accuracy of the
      two.
    poisson_capacity: static buffer for Poisson batches; ``None`` picks
      ``B + 6 sqrt(B) + 4``; at least ``B + 3 sqrt(B)`` (a draw beyond the
      buffer is processed in extra chunks, never dropped; a smaller buffer
      would need them often).
    average_targets: if True, each while-loop iteration averages its
      ``batch_loop`` real gradients (all taken at the same model) and updates
      the images ``boost_loop`` times against that mean, instead of
      ``boost_loop`` times against each gradient. Under DP the mean has
      ``1 / batch_loop`` of the noise variance and costs no privacy
      (post-processing; ``T`` is unchanged).
    model_steps: how the client's model moves between while-loop iterations:
      ``synthetic`` (the paper: ``R_l`` epochs of SGD on the synthetic set)
      or ``noisy_real`` (a departure from the paper: one step
      ``w <- w - eta_m g`` along the iteration's mean noisy real gradient
      ``g``, also after the last iteration; ``inner_loop`` must be 0).
      Needs ``average_targets``. Under DP the trajectory is a function of
      released noisy gradients (post-processing; the next batch is an
      adaptive query, as in DP-SGD): ``(q, sigma, T)`` still bound it. The
      client then also has a model delta to send (``server.start``). With
      ``batch_loop=1``, ``real_dsa_strategy=''`` and a ``radius`` the
      trajectory does not reach, the path is DP-FedAvg's local DP-SGD.
    model_optimizer: the direction of the client model's steps along a trajectory, at the
      round's ``eta_m`` (a :class:`fedlap_jax.optim.Optimizer`; default plain SGD, written
      out: ``w - eta_m g``). Its state starts afresh at each model step of a while-loop
      iteration (carried over that step's ``R_l`` epochs; one ``noisy_real`` step has nothing
      to carry) and is never sent or kept across rounds. The radius calibration keeps plain
      SGD. Another than plain SGD is refused when the model takes no step
      (``model_steps='synthetic'`` with ``inner_loop=0`` or ``max_outer=1``). Privacy is
      unchanged: the steps use released (noisy) values or the synthetic set only.
    image_optimizer: the synthetic images' direction as a config value (a
      :class:`fedlap_jax.optim.Optimizer` other than heavy-ball SGD), stepped at ``image_lr``;
      ``None`` (default): the paper's SGD of ``image_momentum`` (that field is the SGD spec:
      with a spec it must be 0). Its state lives across the round's ``R_i`` trajectories and
      starts afresh each round.
    dp: a :class:`~fedlap_jax.dp_config.DPConfig` for FedLAP-DP, ``None`` for FedLAP
      (:meth:`with_dp` turns it on with the settings DP requires).
  """

  ipc: int = 50
  iterations: int = 1
  max_outer: int = 5
  batch_loop: int = 40
  boost_loop: int = 5
  inner_loop: int = 0
  batch_size: int = 256
  model_batch_size: int = 512
  image_lr: float = 100.0
  image_momentum: float = 0.5
  mse_weight: float = 0.1
  radius: float = 10.0
  calibrate_radius: bool = True
  calibration_epochs: int = 100
  calibration_eval_size: int | None = None
  dsa_strategy: str = "color_crop_cutout_flip_scale_rotate"
  real_dsa_strategy: str | None = None
  dsa_family_draw: str = "shared"
  poisson_capacity: int | None = None
  average_targets: bool = False
  model_steps: str = "synthetic"
  model_optimizer: optim.Optimizer = optim.SGD
  image_optimizer: optim.Optimizer | None = None
  dp: DPConfig | None = None

  def __post_init__(self):
    for f in (
      "ipc",
      "iterations",
      "max_outer",
      "batch_loop",
      "boost_loop",
      "batch_size",
      "model_batch_size",
      "calibration_epochs",
    ):
      positive_int(f, getattr(self, f))
    nonneg_int("inner_loop", self.inner_loop)
    nonneg_float("mse_weight", self.mse_weight)
    positive_float("radius", self.radius)
    if self.calibration_eval_size is not None:
      positive_int("calibration_eval_size", self.calibration_eval_size)
    check_synthetic_learner(self)
    if self.real_dsa_strategy is not None:
      dsa.check_strategy("real_dsa_strategy", self.real_dsa_strategy)
    one_of("dsa_family_draw", self.dsa_family_draw, DSA_FAMILY_DRAWS)
    require(
      isinstance(self.average_targets, bool),
      "average_targets",
      self.average_targets,
      "True or False",
    )
    one_of("model_steps", self.model_steps, MODEL_STEPS)
    require(
      self.model_steps == "synthetic" or self.average_targets,
      "model_steps",
      self.model_steps,
      "'synthetic' unless average_targets=True ('noisy_real' steps "
      "along the mean noisy gradient of each while-loop iteration)",
    )
    require(
      self.model_steps == "synthetic" or self.inner_loop == 0,
      "inner_loop",
      self.inner_loop,
      "0 with model_steps='noisy_real' (the model steps along the noisy gradients; no "
      "local epochs on the synthetic set run)",
    )
    require(
      isinstance(self.model_optimizer, optim.Optimizer),
      "model_optimizer",
      self.model_optimizer,
      "a fedlap_jax.optim.Optimizer",
    )
    require(
      self.model_optimizer == optim.SGD or self.moves_model,
      "model_optimizer",
      self.model_optimizer,
      "plain SGD (the default) with model_steps='synthetic' and inner_loop=0 or max_outer=1 "
      "(the client's model takes no step, so no optimiser would run)",
    )
    if self.dp is not None:
      require(
        not self.calibrate_radius,
        "calibrate_radius",
        self.calibrate_radius,
        "False when dp is set (a radius measured on real data is not private; "
        "use the constant radius r)",
      )

  @property
  def capacity(self) -> int:
    """Static size of the Poisson batch buffer."""
    return self.poisson_capacity or poisson_capacity(self.batch_size)

  @property
  def targets_per_iteration(self) -> int:
    """The matching targets of one while-loop iteration: ``batch_loop`` (one per real
    batch), or 1 with ``average_targets`` (their mean)."""
    return 1 if self.average_targets else self.batch_loop

  @property
  def moves_model(self) -> bool:
    """Whether the client's model steps along a trajectory (``noisy_real``: after every
    while-loop iteration; ``synthetic``: ``R_l > 0`` epochs after each but the last of
    ``max_outer > 1``): only then does ``model_optimizer`` run."""
    if self.model_steps == "noisy_real":
      return True
    return self.inner_loop > 0 and self.max_outer > 1

  @property
  def real_accesses_per_round(self) -> int:
    """Worst-case real batches per round, ``T = R_i * max_outer * batch_loop``."""
    return self.iterations * self.max_outer * self.batch_loop

  def with_dp(self, dp: DPConfig) -> ClientConfig:
    """This client config under DP ``dp``: ``dp`` set and ``calibrate_radius=False`` (a
    radius measured on real data is not private; the constant ``radius`` is used)."""
    require(isinstance(dp, DPConfig), "dp", dp, "a DPConfig")
    return dataclasses.replace(self, dp=dp, calibrate_radius=False)

  def dp_accesses(self) -> DpAccesses | None:
    """FedLAP-DP's noisy accesses: ``T = R_i * max_outer * batch_loop`` real batches of
    expected size ``B`` per round (Algorithm 3); ``None`` without DP."""
    if self.dp is None:
      return None
    return DpAccesses(self.dp, self.batch_size, self.real_accesses_per_round)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
  """Global optimisation (Algorithm 2).

  Attributes:
    radius_strategy: how ``r_g`` is formed from the clients' ``r_k``: ``min``
      (paper), ``max``, ``median``, ``mean``, ``constant`` (= ``r``, for DP) or
      ``fixed`` (always ``max_epochs`` epochs, no radius).
    batch_size: batch size on the union of synthetic sets (512).
    max_epochs: epoch cap (100).
    weighting: ``size`` (N_k / N, paper Eq. 9) or ``uniform`` (1/K, Algorithm 3);
      ``None`` (default): ``uniform`` with DP, ``size`` without (:meth:`resolved`, by the
      method's config: :class:`FedLAPConfig`, FedDM's, DSC's and PSG's). ``size`` is refused
      with DP.
    dsa_strategy: DSA families for server steps.
    learning_rate: base of the server's own cosine schedule over rounds;
      ``None`` (the paper) uses the run's ``eta_m`` (the clients' model
      rate). The server only trains on the synthetic sets it received, so
      under DP its step size is post-processing and costs no privacy.
    start: where the server's descent starts: ``global`` (the paper: the
      global model ``w_g``) or ``fedavg_delta`` (a departure from the paper:
      ``w_g`` plus the weighted mean of the clients' model deltas, then the
      trust-region descent on the synthetic sets from there). Needs
      ``client.model_steps='noisy_real'``; each client then uploads its
      model delta (the model's size) besides its synthetic set.

    momentum: SGD momentum of the server's optimiser (0: plain SGD, FedLAP).
    weight_decay: L2 weight decay added to the gradient (0 for FedLAP; FedDM,
      DSC and PSG train their server model with momentum 0.9, decay 5e-4).
    optimizer: the server's direction as a config value (a :class:`fedlap_jax.optim.Optimizer`
      other than heavy-ball SGD: Adam, Yogi, Adagrad, Nesterov SGD), stepped at the server's
      rate; ``None`` (default): heavy-ball SGD of ``momentum`` and ``weight_decay`` (those two
      fields are the SGD spec: a spec of ``name='sgd'`` without ``nesterov`` is refused, and
      with a spec both must be 0, its own ``weight_decay`` replacing them). Its state starts
      afresh at each round's descent (Algorithm 2) and is carried over that descent's epochs,
      across rounds only with ``carry_state``. :meth:`direction` is the transformation the
      server steps with.
    carry_state: ``False`` (default, the paper's Algorithm 2): the server's optimiser starts
      afresh every round and the state keeps ``opt_state = ()``. ``True`` (FedOpt-style):
      round 1 starts from the optimiser's ``init`` and each round from the state the last
      one ended with, kept in the algorithm state's ``opt_state`` (so checkpointed and
      resumed with it). FedLAP's server only; FedDM, DSC and PSG refuse ``True`` (their
      server trains afresh each round, or once).
  """

  radius_strategy: str = "min"
  batch_size: int = 512
  max_epochs: int = 100
  weighting: str | None = None
  dsa_strategy: str = "color_crop_cutout_flip_scale_rotate"
  learning_rate: float | None = None
  start: str = "global"

  momentum: float = 0.0
  weight_decay: float = 0.0
  optimizer: optim.Optimizer | None = None
  carry_state: bool = False

  def __post_init__(self):
    one_of("radius_strategy", self.radius_strategy, RADIUS_STRATEGIES)
    positive_int("server.batch_size", self.batch_size)
    positive_int("server.max_epochs", self.max_epochs)
    require(
      self.weighting is None or self.weighting in WEIGHTINGS,
      "weighting",
      self.weighting,
      f"None or one of {WEIGHTINGS}",
    )
    dsa.check_strategy("server.dsa_strategy", self.dsa_strategy)
    if self.learning_rate is not None:
      positive_float("server.learning_rate", self.learning_rate)
    one_of("server.start", self.start, SERVER_STARTS)

    require(
      is_real(self.momentum) and 0 <= self.momentum < 1,
      "server.momentum",
      self.momentum,
      "a number in [0, 1)",
    )
    nonneg_float("server.weight_decay", self.weight_decay)
    check_other_than_sgd(
      self.optimizer,
      "server.optimizer",
      (("server.momentum", self.momentum), ("server.weight_decay", self.weight_decay)),
      "server.momentum and server.weight_decay are its spec",
    )
    require(
      isinstance(self.carry_state, bool), "server.carry_state", self.carry_state, "True or False"
    )

  def direction(self) -> optax.GradientTransformation:
    """The server's direction before the rate: ``optimizer``'s
    (:meth:`fedlap_jax.optim.Optimizer.direction`), or without one
    :func:`fedlap_jax.optim.server_direction` of ``momentum`` and ``weight_decay``."""
    if self.optimizer is None:
      return optim.server_direction(self.momentum, self.weight_decay)
    return self.optimizer.direction()

  def resolved(self, private: bool) -> ServerConfig:
    """This config with its weighting resolved (:func:`fedlap_jax.dispatch.resolve_weighting`,
    the one rule: ``None`` is ``uniform`` when ``private``, ``size`` otherwise; ``size`` is
    refused when ``private``). Every method's config that holds a :class:`ServerConfig`
    resolves it here."""
    return dataclasses.replace(self, weighting=resolve_weighting(self.weighting, private))


def check_fresh_server(server: ServerConfig, method: str, why: str) -> None:
  """Refuses ``server.carry_state=True`` for ``method``, whose server does not carry its
  optimiser's state across rounds (``why``: what it does instead).

  Raises:
    ConfigError: naming ``server.carry_state``, the value and what is allowed.
  """
  require(
    server.carry_state is False,
    "server.carry_state",
    server.carry_state,
    f"False for method={method!r} ({why}; only FedLAP's server carries its state)",
  )


def fixed_epochs_server(max_epochs: int) -> ServerConfig:
  """The server's training of a fresh model on synthetic sets for ``max_epochs`` epochs.

  The setting the FedDM and DSC/PSG code evaluates synthetic sets with: no
  radius (``fixed``), batch 256, uniform weights, no DSA, SGD with momentum 0.9
  and weight decay 5e-4. The default ``server`` of
  :class:`~fedlap_jax.methods.feddm.distribution_matching.FedDMConfig` (500 epochs) and
  :class:`~fedlap_jax.methods.condensation.one_shot.OneShotConfig` (300 epochs).
  """
  return ServerConfig(
    radius_strategy="fixed",
    batch_size=256,
    max_epochs=max_epochs,
    weighting="uniform",
    dsa_strategy="",
    momentum=0.9,
    weight_decay=5e-4,
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FedLAPConfig:
  """A whole FedLAP / FedLAP-DP run.

  Attributes:
    client: :class:`ClientConfig`.
    server: :class:`ServerConfig`.
    rounds: ``M``, communication rounds; also the length of the cosine
      learning-rate schedule.
    learning_rate: ``eta_0``, the first round's learning rate of the model
      steps (clients' local SGD and, unless ``server.learning_rate`` is set,
      the server's); round ``m`` uses the cosine schedule's ``eta_m``.
    synthetic_init: ``real`` (non-DP: real images, re-drawn every round) or
      ``noise`` (N(0, 1) once, carried across rounds; required under DP).
    lr_schedule: ``cosine`` (the reference; its last round runs at the floor, 1 % of
      ``eta_0``) or ``cosine_open`` (the last round's rate above the floor up to 15 rounds;
      see :func:`fedlap_jax.training.cosine_learning_rate`).
  """

  client: ClientConfig = dataclasses.field(default_factory=ClientConfig)
  server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
  rounds: int = 200
  learning_rate: float = 0.1
  synthetic_init: str = "real"
  lr_schedule: str = "cosine"

  def __post_init__(self):
    positive_int("rounds", self.rounds)
    positive_float("learning_rate", self.learning_rate)
    one_of("synthetic_init", self.synthetic_init, SYNTHETIC_INITS)
    one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
    require(
      self.server.start == "global" or self.client.model_steps == "noisy_real",
      "server.start",
      self.server.start,
      "'global' unless client.model_steps='noisy_real' (only then do the clients have "
      "a model delta to send)",
    )
    if self.client.dp is not None:
      require(
        self.synthetic_init == "noise",
        "synthetic_init",
        self.synthetic_init,
        "'noise' when DP is on (initialising from real images would publish them)",
      )
      require(
        self.server.radius_strategy in ("constant", "fixed"),
        "radius_strategy",
        self.server.radius_strategy,
        "'constant' or 'fixed' when DP is on (other strategies use r_k measured on real data)",
      )
    elif self.server.radius_strategy not in ("constant", "fixed"):
      require(
        self.client.calibrate_radius,
        "calibrate_radius",
        self.client.calibrate_radius,
        f"True when radius_strategy={self.server.radius_strategy!r} (it needs "
        "per-client r_k); or use radius_strategy='constant'",
      )

    # The weighting under DP and without (refused here: size under DP).
    object.__setattr__(self, "server", self.server.resolved(self.client.dp is not None))

  @property
  def dp(self) -> DPConfig | None:
    return self.client.dp

  def dp_accesses(self) -> DpAccesses | None:
    """The client's noisy accesses (:meth:`ClientConfig.dp_accesses`)."""
    return self.client.dp_accesses()

  def with_dp(self, dp: DPConfig) -> FedLAPConfig:
    """This run under DP ``dp`` (FedLAP-DP), in one call: every coupled setting DP requires.

    Changes exactly: ``client`` to :meth:`ClientConfig.with_dp` (``dp``, no
    radius calibration), ``synthetic_init='noise'`` (real-image starts would
    publish records), ``server.radius_strategy='constant'`` unless it is
    already ``'constant'`` or ``'fixed'`` (the others use radii measured on
    real data) and ``server.weighting='uniform'`` (the ``1/K`` average the
    analysis covers). Everything else (loops, ``B``, learning rates, rounds)
    stays as it is; :func:`paper_dp_config` is the paper's whole DP setting.

    Example::

      config = FedLAPConfig(rounds=10).with_dp(
          DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5))
    """
    require(isinstance(dp, DPConfig), "dp", dp, "a DPConfig")
    strategy = self.server.radius_strategy
    server = dataclasses.replace(
      self.server,
      radius_strategy=strategy if strategy in ("constant", "fixed") else "constant",
      weighting="uniform",
    )
    return dataclasses.replace(
      self, client=self.client.with_dp(dp), server=server, synthetic_init="noise"
    )


def paper_nondp_config(**overrides) -> FedLAPConfig:
  """The published non-DP CIFAR-10 configuration (200 rounds, ipc 50)."""
  cfg = FedLAPConfig(
    client=ClientConfig(
      ipc=50,
      iterations=1,
      max_outer=5,
      batch_loop=40,
      boost_loop=5,
      inner_loop=0,
      radius=10.0,
      mse_weight=0.1,
      calibrate_radius=True,
    ),
    server=ServerConfig(radius_strategy="min", weighting="size"),
    rounds=200,
    learning_rate=0.1,
    synthetic_init="real",
  )
  return dataclasses.replace(cfg, **overrides)


# The paper's record-level DP parameters (CIFAR-10, Section "Experiments"): sigma 1, C 1,
# delta 1e-5.
PAPER_DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)


def paper_dp_config(**overrides) -> FedLAPConfig:
  """The published DP CIFAR-10 configuration (30 rounds, ipc 10, sigma 1, C 1).

  The one statement of the paper's FedLAP-DP setting: the experiment configs
  (``fedlap_runs/configs``) are written from it.
  """
  cfg = FedLAPConfig(
    client=ClientConfig(
      ipc=10,
      iterations=4,
      max_outer=5,
      batch_loop=10,
      boost_loop=5,
      inner_loop=2,
      radius=1.5,
      mse_weight=0.0,
      calibrate_radius=False,
      dp=PAPER_DP,
    ),
    server=ServerConfig(radius_strategy="constant", weighting="uniform"),
    rounds=30,
    learning_rate=0.002,
    synthetic_init="noise",
  )
  return dataclasses.replace(cfg, **overrides)
