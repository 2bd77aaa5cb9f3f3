"""The one run builder of both front ends: config -> library config -> calibrated mechanism ->
model -> initial state and keys.

``experiments.run`` (through :func:`experiments.train.train_and_evaluate`), :mod:`experiments.audit`
and the Flower app's server and clients build a run here, so each computes what the others do:

1. :func:`plan`: the config's static checks (:func:`fedlap_runs.library_configs.validate_config`,
   which builds the method's library config where it needs no data), the data
   (:func:`load_data`: loaded once, or given: a Flower client's own records) and what it tells
   (:class:`Facts`), the data's checks, the library config (built once; again only with a
   calibrated sigma), the method's DP mechanism and, with ``calibrate``, the noise multiplier
   that meets ``dp.target_epsilon`` (:mod:`fedlap_runs.calibration`);
2. :func:`init`: the model and the run's keys from the seed: ``k_model, k_alg =
   split(run_key(seed))`` (:func:`fedlap_runs.seeds.run_key`), a ConvNet initialised with
   ``k_model`` (or the model ``config.model.name`` names); the method's ``init`` is given ``k_alg``;
3. :func:`clients`, :func:`algorithm` and the algorithm's ``init``: the stacked clients, the
   :class:`~fedlap_jax.algorithm.FederatedAlgorithm` and the state before round 1
   (:func:`build_run` does all three for a whole run).

No method's name is read here: what differs between methods is their entry in
:mod:`fedlap_runs.method_entries`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import algorithm as algorithm_lib
from fedlap_jax import sharding
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import stack_clients
from fedlap_jax.dispatch import resolve_client_backend
from fedlap_jax.models import count_params, init_convnet

from fedlap_runs import calibration, catalog
from fedlap_runs import data as data_lib
from fedlap_runs import library_configs, method_entries, seeds


class Facts(NamedTuple):
  """What the data tells the algorithm (public facts of the run).

  Attributes:
    image_shape: ``(H, W, C)``; num_classes: of the dataset.
    client_sizes: records per client, ``None`` where they are not known (a Flower server whose
      clients hold their own records).
    max_classes_per_client: the most classes a client holds (``None``: not known).
    max_client_size: records of the largest client (``None``: not known).
  """

  image_shape: tuple
  num_classes: int
  client_sizes: tuple | None = None
  max_classes_per_client: int | None = None
  max_client_size: int | None = None


class Data(NamedTuple):
  """The records a run builds from: the whole dataset and its partition (``dataset``,
  ``client_indices``; ``None`` for a Flower client holding only its own records) and
  their :class:`Facts`."""

  dataset: Any
  client_indices: list | None
  facts: Facts


class Plan(NamedTuple):
  """A run before its seed: what the config and the data decide.

  Attributes:
    cfg: the config (under ``calibrate``, a copy with the calibrated ``dp.noise_multiplier``).
    entry: the method's :class:`fedlap_runs.method_entries.Entry`.
    data: the run's :class:`Data`.
    config: the method's frozen library config (static in every jit).
    mechanism: its :class:`~fedlap_jax.accounting.DpMechanism`; ``None`` without DP.
    calibration: the log line of the calibration of ``dp.target_epsilon`` (``None``: not
      calibrated here).
  """

  cfg: Any
  entry: method_entries.Entry
  data: Data
  config: Any
  mechanism: Any
  calibration: str | None = None

  @property
  def facts(self) -> Facts:
    return self.data.facts

  def budget(self) -> calibration.DpBudget:
    """What the run spends (its mechanism at the smallest client's rate), for calibration.

    Raises:
      ConfigError: naming ``dp.target_epsilon``: the run has no DP, or the client sizes are
        not known (a Flower client holding only its own records, or a server whose data is
        its own: the rate ``q = B / min_k N_k`` needs the smallest client's record count).
    """
    sizes = self.facts.client_sizes
    target = self.cfg.dp.get("target_epsilon")
    if self.mechanism is None:
      raise ConfigError("dp.target_epsilon", target, "None without DP (dp.enabled=False)")
    if not sizes:
      allowed = (
        "None where the clients' record counts are not known (set dp.noise_multiplier): "
        "calibrating to a target needs min_k N_k, the smallest client's record count, which "
        "only the config's named data and partition make public to every party"
      )
      raise ConfigError(
        "dp.target_epsilon",
        target,
        allowed,
        message=f"dp.target_epsilon={target!r} cannot be calibrated here: this party does "
        f"not hold the federation's client sizes; allowed: {allowed}",
      )
    return calibration.budget(self.cfg, self.mechanism, sizes)


def load_data(cfg) -> Data:
  """The config's dataset and partition (:func:`fedlap_runs.data.load_split`) and their
  :class:`Facts`.

  Raises:
    ConfigError: the data does not load or does not split as configured.
    fedlap_runs.data.DataUnavailableError: tfds data missing and no network.
  """
  dataset, indices = data_lib.load_split(cfg.data)
  sizes = tuple(int(len(i)) for i in indices)
  facts = Facts(
    tuple(dataset.image_shape),
    int(dataset.num_classes),
    sizes,
    max(len(np.unique(dataset.y_train[i])) for i in indices),
    max(sizes),
  )
  return Data(dataset, indices, facts)


def plan(cfg, *, data: Data | None = None, calibrate: bool = False, config: Any = None) -> Plan:
  """Checks ``cfg``, loads its data (unless given) and builds its library config and mechanism.

  Args:
    cfg: the resolved config (``seed`` is not read here).
    data: the run's records (default: :func:`load_data`); a :class:`Data` without
      ``dataset`` (a Flower client's own records) skips the checks that need the partition.
    calibrate: set ``dp.noise_multiplier`` from ``dp.target_epsilon`` (on a copy of ``cfg``)
      at the smallest client of ``data`` (:meth:`fedlap_runs.calibration.DpBudget.calibrate`).
      Without it a target is left to the caller (``experiments.run`` calibrates a suite's runs
      together, :func:`fedlap_runs.calibration.calibrate_noise`; :func:`with_config` then
      rebuilds).
    config: ``cfg``'s library config as :func:`fedlap_runs.library_configs.validate_config`
      returned it, when the caller checked ``cfg`` (default: checked and built here).

  Raises:
    ConfigError: naming the field, the value and what is allowed.
  """
  entry = method_entries.entry(cfg.method)
  if config is None:
    config = library_configs.validate_config(cfg)
  if calibrate:
    calibration.outside_a_suite(cfg)
  data = load_data(cfg) if data is None else data
  if config is None:  # a method whose static step count needs the largest client
    config = library_configs.library_config(cfg, max_client_size=data.facts.max_client_size)
  mechanism = entry.mechanism(config)
  if data.dataset is not None:
    library_configs.validate_data(cfg, data.dataset, data.client_indices, mechanism=mechanism)
  out = Plan(cfg, entry, data, config, mechanism)
  target = cfg.dp.get("target_epsilon")
  if not calibrate or target is None:
    return out
  spent = out.budget()
  sigma = spent.calibrate(target, field="dp.target_epsilon")
  cfg = copy.deepcopy(cfg)
  cfg.dp.noise_multiplier = sigma
  line = calibration.line("", "dp.target_epsilon", target, sigma, spent)
  return with_config(out, cfg)._replace(calibration=line)


def with_config(p: Plan, cfg) -> Plan:
  """``p`` for ``cfg``, the same run with another ``dp.noise_multiplier`` (a calibrated one):
  the library config and mechanism built again."""
  config = library_configs.library_config(cfg, max_client_size=p.facts.max_client_size)
  return p._replace(cfg=cfg, config=config, mechanism=p.entry.mechanism(config))


# -- the model and the keys ---------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def apply_fn_of(module):
  """One ``apply_fn(params, x) -> logits`` per (hashable) Flax module, so jits are shared."""
  return lambda params, x: module.apply({"params": params}, x)


class Model(NamedTuple):
  """The run's model: the Flax ``module``, its ``apply_fn``, the initial ``params``."""

  module: Any
  apply_fn: Any
  params: Any
  num_params: int


class Init(NamedTuple):
  """What the seed decides: the model and ``k_alg``, the algorithm's key (``init`` and its key
  chain)."""

  model: Model
  k_alg: jax.Array


def init_model(model_cfg, image_shape, num_classes: int, key: jax.Array) -> Model:
  """The model ``model_cfg.name`` names (:func:`fedlap_runs.catalog.model_factory`; the
  ConvNet of ``model_cfg`` for ``convnet``), initialised with ``key``.

  A model's variables other than its parameters (BatchNorm statistics) keep their initial
  values: ``apply_fn`` drops what a call writes to them. Under DP the library refuses such a model
  (:class:`fedlap_jax.per_example.NotDpSafe`).
  """
  factory = catalog.model_factory(model_cfg.get("name", "convnet"))
  if factory is None:
    module, params = init_convnet(
      key,
      tuple(image_shape),
      int(num_classes),
      width=model_cfg.width,
      depth=model_cfg.depth,
      norm=model_cfg.norm,
      conv_bias=model_cfg.conv_bias,
    )
    return Model(module, apply_fn_of(module), params, count_params(params))
  module = factory(int(num_classes))
  if not isinstance(module, nn.Module):
    raise ConfigError(
      "model.name",
      model_cfg.name,
      catalog.MODEL_ALLOWED,
      message=f"model.name={model_cfg.name!r} returned {type(module).__name__}, not a "
      f"flax.linen.Module; allowed: {catalog.MODEL_ALLOWED}",
    )
  variables = jax.jit(module.init)(key, jnp.zeros((1, *image_shape), jnp.float32))
  params = variables["params"]
  state = {c: v for c, v in variables.items() if c != "params"}
  apply_fn = (
    (lambda p, x: module.apply({"params": p, **state}, x, mutable=list(state))[0])
    if state
    else apply_fn_of(module)
  )
  return Model(module, apply_fn, params, count_params(params))


def init(p: Plan, seed: int) -> Init:
  """The model and keys of seed ``seed``: ``k_model, k_alg = split(run_key(seed))``."""
  k_model, k_alg = jax.random.split(seeds.run_key(seed))
  return Init(init_model(p.cfg.model, p.facts.image_shape, p.facts.num_classes, k_model), k_alg)


# -- the clients and the algorithm ----------------------------------------------------------


def samples_clients(cfg) -> bool:
  """True when a round runs fewer than all clients (``data.clients_per_round < K``).

  Such a run keeps the clients' data on the host and moves each round's sampled
  block to the device (:mod:`fedlap_jax.participation`); ``None`` or ``K``
  keep every client on the device and run today's round.
  """
  m = cfg.data.get("clients_per_round")
  return m is not None and m < cfg.data.num_clients


def client_backend(cfg) -> str:
  """The resolved ``client_backend`` of ``cfg``'s method
  (:func:`fedlap_jax.dispatch.resolve_client_backend`)."""
  entry = method_entries.entry(cfg.method)
  return resolve_client_backend(cfg.client_backend, side_by_side=entry.side_by_side)


def clients(p: Plan):
  """Every client's records stacked ``(K, N_max, ...)``: on the device (placed on the mesh
  under ``client_backend='shard'``), or on the host when clients are sampled."""
  dataset, indices, cfg = p.data.dataset, p.data.client_indices, p.cfg
  out = stack_clients(
    [dataset.x_train[i] for i in indices],
    [dataset.y_train[i] for i in indices],
    pixel_scale=dataset.pixel_scale,
    pixel_offset=dataset.pixel_offset,
    on_host=samples_clients(cfg),
    num_classes=dataset.num_classes,  # labels outside [0, K) are refused here, on the host
  )
  if resolve_client_backend(cfg.client_backend) == "shard" and not samples_clients(cfg):
    out = sharding.put_clients(out)  # once: each device keeps its block for the run
  return out


def algorithm(p: Plan, model: Model) -> algorithm_lib.FederatedAlgorithm:
  """The run's :class:`~fedlap_jax.algorithm.FederatedAlgorithm` (its method's entry builds
  it). Algorithms of equal settings share their compiled rounds, so the seeds of a sweep or a
  resumed run compile nothing new."""
  return p.entry.algorithm(
    p.config, model, p.facts, client_backend=client_backend(p.cfg), cfg=p.cfg
  )


class Run(NamedTuple):
  """Everything a run (or a later audit of its checkpoints) builds from its config.

  Attributes:
    plan: the :class:`Plan` (config, data, library config, mechanism).
    dataset: the :class:`fedlap_runs.data.Dataset` (images as stored, with their normalisation).
    client_indices: training-record indices of each client.
    clients: stacked :class:`~fedlap_jax.client_data.ClientData` ``(K, N_max, ...)``;
      host NumPy arrays when clients are sampled (:func:`samples_clients`), else on the device.
    model: the Flax module (the ConvNet by default); apply_fn: ``apply_fn(params, x) -> logits``.
    num_params: parameter count of the model.
    algorithm: the :class:`~fedlap_jax.algorithm.FederatedAlgorithm`.
    state: the state before round 1 (also the restore template of checkpoints).
  """

  plan: Plan
  dataset: Any
  client_indices: list
  clients: Any
  model: Any
  apply_fn: Any
  num_params: int
  algorithm: algorithm_lib.FederatedAlgorithm
  state: Any


def build_run(cfg, *, seed: int | None = None, built: Plan | None = None) -> Run:
  """Data, partition, model, algorithm and initial state of a config.

  Deterministic in the seed (``seed``, else ``cfg.seed``, resolved without a work dir:
  :func:`fedlap_runs.seeds.resolve`, 0 without DP, a fresh draw under DP) and the public
  ``cfg.data.partition_seed`` (the partition), so the initial state is a valid template for
  restoring the run's checkpoints, e.g. in :mod:`experiments.audit`. ``built``: the run's
  :class:`Plan` if made already (else :func:`plan`).

  Raises:
    ConfigError: the config, or the data does not fit it.
  """
  p = plan(cfg) if built is None else built
  if seed is None:
    seed = seeds.resolve(cfg.get("seed"), private=bool(cfg.dp.enabled), workdir=None).value
  start = init(p, seed)
  stacked = clients(p)
  alg = algorithm(p, start.model)
  m = start.model
  return Run(
    p,
    p.data.dataset,
    list(p.data.client_indices),
    stacked,
    m.module,
    m.apply_fn,
    m.num_params,
    alg,
    alg.init(start.k_alg, m.params, stacked),
  )
