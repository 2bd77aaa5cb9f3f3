"""A federated method as one value: its config, its two steps, its privacy, its wire format.

In the style of FedJAX's ``FederatedAlgorithm`` (one value per algorithm; the runner does not
know its name), split where the front ends need the halves apart: the jitted round
(:mod:`fedlap_jax.rounds`) runs :attr:`Method.plan`, every client's :attr:`Method.client_step`
and :attr:`Method.server_step` in one program; a remote client runs ``client_step`` alone and
a remote server ``server_step`` alone. The registry of the project's methods is
:data:`fedlap_jax.methods.REGISTRY`; a method of one's own is a :class:`Method` value passed to
:func:`fedlap_jax.rounds.algorithm` directly.

A round of method ``M`` with state ``s`` over stacked clients ``D`` (leaves ``(K, N_max, ...)``):

1. ``plan = M.plan(s, K, config)``: the round's keys and the server's message (the same for
   every client: the global model, the rates) and the per-client inputs ``own`` (leaves with a
   leading ``(K,)`` axis: the clients' keys, the server's noise starts);
2. ``M.client_step(own[k], model, plan.message, carried[k], D[k], config, client_axis=...)``
   for every client ``k`` (``carried``: the state fields :attr:`Method.carried` names, leaves
   ``(K, ...)``), giving stacked :class:`ClientResult` s;
3. ``M.server_step(plan.server_key, model, s, plan.message, results, config, facts)``: the new
   state (its params and server-side fields) and the round's metrics; the round then writes
   the clients' carried state, ``round + 1`` and ``plan.next_key``.

The state of every method is its own NamedTuple with fields ``params``, ``round`` (int32,
rounds done) and ``key`` (the chain key) besides its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import jax
import numpy as np

from fedlap_jax import accounting
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData
from fedlap_jax.types import PyTree


class ModelFns(NamedTuple):
  """The model as functions (hashable by identity: a jit static).

  ``apply_fn(params, x) -> logits`` (every method); ``embed_fn(params, x) -> (features,
  logits)`` (FedDM); ``init_fn(key) -> params`` of a fresh network (DSC, PSG).
  """

  apply_fn: Callable
  embed_fn: Callable | None = None
  init_fn: Callable | None = None


class RunFacts(NamedTuple):
  """Public facts of a run that a method sizes itself by (host side).

  Attributes:
    image_shape: ``(H, W, C)``.
    num_clients: ``K``.
    num_params: parameters of the model.
    max_classes_per_client: classes of the client holding the most (synthetic set slots).
    max_client_size: ``N_max``, records of the largest client (``None``: unknown).
    clients_per_round: ``m`` clients per round (``None``: all ``K``).
  """

  image_shape: tuple[int, ...]
  num_clients: int
  num_params: int
  max_classes_per_client: int
  max_client_size: int | None = None
  clients_per_round: int | None = None


class RoundPlan(NamedTuple):
  """What the server decides before its clients run (:attr:`Method.plan`).

  Attributes:
    next_key: the state key of the next round.
    server_key: the key of the server step (``None``: it draws nothing).
    message: what every client receives whole (the global model, the round's rates, ...).
    own: per-client inputs, leaves with a leading ``(K,)`` axis (the clients' keys, ...).
  """

  next_key: jax.Array
  server_key: jax.Array | None
  message: PyTree
  own: PyTree


class ClientResult(NamedTuple):
  """What one client's step returns (leaves ``(K, ...)`` once stacked by the round).

  Attributes:
    update: what it sends the server (:class:`Wire` describes it).
    carried: its state kept for the next round, one entry per :attr:`Method.carried` field
      (a tuple; ``()`` when the method carries none).
    metrics: its diagnostics.
  """

  update: PyTree
  carried: tuple
  metrics: PyTree


class RoundFacts(NamedTuple):
  """What the server step knows of the round's clients.

  Attributes:
    num_records: ``(K',)`` the clients' ``N_k`` (size weighting).
    take_part: static ``(m, K)``: ``m`` of ``K`` clients run this round (SCAFFOLD's server
      variate scales by ``m / K``).
  """

  num_records: jax.Array
  take_part: tuple[int, int]


class ClientStep(Protocol):
  def __call__(
    self,
    own: PyTree,
    model: ModelFns,
    message: PyTree,
    carried: tuple,
    data: ClientData,
    config: Any,
    *,
    client_axis: str | None = None,
  ) -> ClientResult:
    """One client's work: pure and jit-compatible (``model``, ``config`` static)."""
    ...


class ServerStep(Protocol):
  def __call__(
    self,
    key: jax.Array | None,
    model: ModelFns,
    state: Any,
    message: PyTree,
    results: ClientResult,
    config: Any,
    facts: RoundFacts,
  ) -> tuple[Any, Any]:
    """``(state with the server's new fields, the round's metrics)``; ``results`` stacked."""
    ...


# -- the wire format ---------------------------------------------------------------------------


class WireField(NamedTuple):
  """One array a client sends: its name (the update's path), shape and dtype."""

  name: str
  shape: tuple[int, ...]
  dtype: str


def _path_name(path) -> str:
  return ".".join(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path)


@dataclasses.dataclass(frozen=True)
class Wire:
  """What a client of a method sends each round: the arrays by name, shape and dtype.

  Pure NumPy / JAX (no transport library): a front end packs :meth:`names`' arrays in its own
  records and checks a reply with :meth:`check` (a ``{name: array}`` mapping) before the
  server step sees it.

  Attributes:
    fields: every array of an honest reply.
    pinned: names fixed for the run and sent once (FedLAP's synthetic labels and mask): left
      out of :meth:`floats`.
  """

  fields: tuple[WireField, ...]
  pinned: tuple[str, ...] = ()

  @classmethod
  def of(cls, update: PyTree, *, pinned: tuple[str, ...] = ()) -> "Wire":
    """The wire format of a client update (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    leaves = jax.tree_util.tree_flatten_with_path(update)[0]
    fields = tuple(
      WireField(_path_name(p) or "update", tuple(int(d) for d in leaf.shape), str(leaf.dtype))
      for p, leaf in leaves
    )
    return cls(fields, pinned)

  def names(self) -> tuple[str, ...]:
    return tuple(f.name for f in self.fields)

  def floats(self) -> int:
    """Numbers one reply carries, the pinned arrays left out (they travel once)."""
    return int(sum(np.prod(f.shape) for f in self.fields if f.name not in self.pinned))

  def check(self, reply: Mapping[str, Any]) -> None:
    """Refuses a malformed reply: a missing or unexpected array, a wrong shape or dtype, a
    non-finite value.

    Raises:
      ConfigError: naming the reply's field.
    """
    check(reply, self)


NON_FINITE = "a non-finite value"
"""The ``value`` of :meth:`Wire.check`'s refusal of an array holding NaN or Inf."""


def check(reply: Mapping[str, Any], expected: Wire) -> None:
  """:meth:`Wire.check` of ``reply`` against ``expected``."""
  if not isinstance(reply, Mapping):
    raise ConfigError("reply", type(reply).__name__, f"a mapping of {expected.names()}")
  names = set(expected.names())
  for name in sorted(set(reply) - names):
    raise ConfigError(name, "an unexpected array", f"only {expected.names()}")
  for f in expected.fields:
    if f.name not in reply:
      raise ConfigError(f.name, "missing", f"an array of shape {f.shape} and dtype {f.dtype}")
    a = np.asarray(reply[f.name])
    if a.dtype != np.dtype(f.dtype):
      raise ConfigError(f.name, str(a.dtype), f"dtype {f.dtype}")
    if tuple(a.shape) != f.shape:
      raise ConfigError(f.name, tuple(a.shape), f"shape {f.shape}")
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
      raise ConfigError(f.name, NON_FINITE, "finite numbers")


def synthetic_upload(ipc: int, facts: RunFacts) -> int:
  """``ipc * max_classes_per_client * prod(image_shape)``: a synthetic set's images."""
  return int(ipc * facts.max_classes_per_client * np.prod(facts.image_shape))


def synthetic_wire(ipc: int, facts: RunFacts) -> Wire:
  """A synthetic set of ``ipc`` images per class (its labels and mask pinned): FedDM, DSC, PSG."""
  s = int(ipc * facts.max_classes_per_client)
  return Wire.of(
    {
      "x": jax.ShapeDtypeStruct((s, *facts.image_shape), np.float32),
      "y": jax.ShapeDtypeStruct((s,), np.int32),
      "mask": jax.ShapeDtypeStruct((s,), np.bool_),
    },
    pinned=("y", "mask"),
  )


def json_floats(a) -> list:
  """``a``'s values as a flat list of floats, ``None`` for NaN / Inf (JSON has neither): the
  numbers of a :attr:`Method.round_record` and of a front end's records."""
  return [v if math.isfinite(v) else None for v in np.asarray(a, np.float64).ravel().tolist()]


# -- the method ----------------------------------------------------------------------------------


PRIVACY = ("required", "optional", "never")


def _no_data_change(clients: ClientData, config: Any) -> ClientData:
  del config
  return clients


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: one object per method, a jit static
class Method:
  """One federated method (see the module docstring).

  Attributes:
    name: the registry key, the experiment config's ``method``.
    label: ``label(dp) -> display name`` (``"FedLAP-DP"``).
    config_type: its library config class (frozen, hashable: a jit static).
    init: ``(key, params, clients, config, facts) -> state`` before round 1 (host-side checks).
    plan: ``(state, num_clients, config) -> RoundPlan``.
    client_step: :class:`ClientStep`.
    server_step: :class:`ServerStep`.
    carried: the state fields the client steps read and write (leaves ``(K, ...)``).
    client_init: ``(key, params, data, config, facts, *, index) -> carried`` of one client
      before round 1, from its own records ``data`` (leaves ``(N, ...)``) and the run's public
      facts alone: client ``index``'s slot of :attr:`init`'s :attr:`carried` fields (a tuple,
      leaves without the client axis) when ``key`` is the key :attr:`init` is given. What a
      client that keeps its own state computes (a federated front end); ``None`` for a method
      that carries nothing, or whose front ends hold every client's state.
    reads_carried: ``config -> bool``: whether a round's client step reads what the client's
      last round left in its :attr:`carried` fields (``None``: always, if it has any). FedLAP
      under ``synthetic_init='real'`` draws its images afresh from real records every round
      and keeps only its fixed labels, so a client that keeps its own state starts every
      round from :attr:`client_init` instead and keeps nothing (:meth:`carries`).
    per_client_fields: ``config -> fields`` whose leading axis is the run's ``K`` clients
      (what a round over sampled clients gathers and scatters; :attr:`carried` unless the
      clients are pooled).
    upload_floats: ``(config, facts) -> floats one client sends per round``.
    wire: ``(config, params, facts) -> Wire`` of a client's update.
    batch_size: ``config -> B``, the expected Poisson batch of real records.
    side_by_side: its clients may run side by side under ``vmap`` (``client_backend='auto'``).
    privacy: ``"required"`` (the method is DP: a config without DP is refused), ``"never"``
      (it has no DP variant) or ``"optional"`` (DP by its config: FedLAP-DP).
    privacy_note: why a config's ``dp`` setting is refused, appended to the refusal.
    dp_twin: ``(method, why)``: the method a config with DP needs instead (``None``: none).
    federated: ``False`` when the round is one client pooling every client's records (DSC
      centralized; its clients always run ``map``).
    prepare_clients: ``(clients, config) -> clients`` the round runs on (DSC centralized pools).
    algorithm_name: ``config -> FederatedAlgorithm.name`` (FedLAP with DP is ``fedlap_dp``).
    extends: the registry method whose library config this one builds on (``None``: its own).
    extend: ``(base config, own section values) -> config`` for ``extends``.
    own_section: the dataclass of the method's own experiment section (``extends`` only).
    update_bound: ``(config, facts) -> (message -> float) | None``: for a model-sending
      method, the largest ``||y_k - x||`` an honest client sends in the round of ``message``
      (but with a stated false-refusal probability), which a server refuses a reply above;
      ``None`` (or a ``None`` result): no bound follows from the config (no clipping, or a
      client optimiser it cannot bound).
    check_update: ``(config, facts) -> (message, update) -> None``: refuses a client's update
      (one client's, no client axis) that no honest client sends in the round of ``message``,
      beyond what its :class:`Wire` checks (names, shapes, dtypes, finite values): FedLAP's
      radius range and, under DP, its model delta's norm. Raises
      :class:`~fedlap_jax.checks.ConfigError` naming the update's field. ``None`` (or a
      ``None`` result: no bound follows from the config): the wire's checks (and
      :attr:`update_bound`) are all.
    round_record: ``metrics -> {name: JSON value}``: the public numbers of a round's metrics
      that the server step computes (the server's radius and steps, the round's rate; not the
      clients' own diagnostics): what a front end logs of the round. ``None``: none.
  """

  name: str
  label: Callable[[bool], str]
  config_type: type[Any]
  init: Callable[..., Any]
  plan: Callable[[Any, int, Any], RoundPlan]
  client_step: ClientStep
  server_step: ServerStep
  upload_floats: Callable[[Any, RunFacts], int]
  wire: Callable[[Any, PyTree, RunFacts], Wire]
  batch_size: Callable[[Any], int]
  carried: tuple[str, ...] = ()
  client_init: Callable[..., tuple] | None = None
  reads_carried: Callable[[Any], bool] | None = None
  per_client_fields: Callable[[Any], tuple[str, ...]] | None = None
  side_by_side: bool = False
  privacy: str = "never"
  privacy_note: str = ""
  dp_twin: tuple[str, str] | None = None
  federated: bool = True
  prepare_clients: Callable[[ClientData, Any], ClientData] = _no_data_change
  algorithm_name: Callable[[Any], str] | None = None
  extends: str | None = None
  extend: Callable[[Any, Mapping[str, Any]], Any] | None = None
  own_section: type | None = None
  update_bound: Callable[[Any, RunFacts], Callable[[Any], float] | None] | None = None
  check_update: Callable[[Any, RunFacts], Callable[[Any, Any], None] | None] | None = None
  round_record: Callable[[Any], dict] | None = None

  def __post_init__(self):
    if self.privacy not in PRIVACY:
      raise ConfigError("privacy", self.privacy, f"one of {PRIVACY}")

  def mechanism(self, config: Any) -> accounting.DpMechanism | None:
    """The method's DP mechanism (``None`` without DP): what its config declares
    (:meth:`fedlap_jax.accounting.DpMechanism.from_config`)."""
    return accounting.DpMechanism.from_config(config)

  def carries(self, config: Any) -> bool:
    """Whether a client's state under ``config`` carries from one round to the next: it has
    :attr:`carried` fields and its step reads them (:attr:`reads_carried`)."""
    return bool(self.carried) and (self.reads_carried is None or bool(self.reads_carried(config)))

  def client_state_fields(self, config: Any) -> tuple[str, ...]:
    """:attr:`per_client_fields` of ``config``."""
    return self.carried if self.per_client_fields is None else self.per_client_fields(config)

  def name_of(self, config: Any) -> str:
    """The :class:`~fedlap_jax.algorithm.FederatedAlgorithm` name under ``config``."""
    return self.name if self.algorithm_name is None else self.algorithm_name(config)

  def __repr__(self) -> str:
    return f"Method({self.name!r})"
