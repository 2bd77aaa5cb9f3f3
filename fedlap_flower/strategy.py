"""The server strategy: every federated registry method (FedLAP and FedLAP-DP among them) on the library's server steps.

Who is asked (:class:`Participation`): each round waits up
to ``join-timeout`` for all ``K`` clients to be connected (and up to
``round-timeout`` for ``min-clients``), binds every connected node to its
partition (:mod:`fedlap_flower.binding`: by ``partition-keys``, or a query
for the node's ``partition-id``, first come), and asks the nodes holding the
round's clients: all ``K``, or with ``data.clients_per_round = m`` the ``m``
partitions :func:`fedlap_flower.task.participants` draws from the public
``data.participation_seed``, as ``experiments.run`` draws them (logged as
``clients``).

Every reply is untrusted input (:mod:`fedlap_flower.replies`). Each is
parsed inside its own error boundary: whatever one reply holds, the worst it
gets is ``invalid`` with the reason (and the field) in ``client_reports.json``;
the round goes on with the others. Every number a reply carries is bounded
there (:mod:`fedlap_flower.replies`), and a partition's ``num-examples`` is
pinned at its first accepted reply (:meth:`fedlap_flower.binding.PartitionBinding.pin`).
The aggregation has its own error boundary: an update that raises, or
whose parameters hold NaN / Inf (or give a non-finite test loss), is
refused: the previous global model is kept, the round is logged with
``update_refused`` and the run goes on.

:class:`MethodStrategy` runs every method of the Flower app: any federated registry
method (:data:`fedlap_jax.methods.REGISTRY`: FedLAP and FedLAP-DP among them), generic over it
(:mod:`fedlap_flower.method_work`; :data:`fedlap_flower.settings.METHODS`). Its server state is
the method's own (its :attr:`~fedlap_jax.method.Method.init` before round 1, e.g. FedAdam's Adam
state or SCAFFOLD's server variate, saved with ``server_state.npz`` and restored on resume),
without the clients' carried fields (each client keeps its own; the plan and the server step
see public stand-ins of their shapes, :func:`fedlap_flower.method_work.carried_standins`); each
round it runs the method's plan (the key chain and the learning rate of ``experiments.run``),
sends every asked node the global parameters, the plan's message and that client's own inputs
(its keys; under DP none: each client draws its own), and aggregates the updates of the replies
that fit with the method's server step, so a round equals ``experiments.run``'s; the test
evaluation is logged the same way. A reply fits when it holds the method's update in its wire
format (by the wire's names, each array refused by its declared shape and dtype before its
values are read; finite values), passes the bounds of :mod:`fedlap_flower.replies` (which says
why an honest client stays inside each: FedLAP's synthetic set with its labels pinned per
partition, ``r_k`` and model delta; a model reply's ``||w_k - w_g||`` against
``max-update-norm``, never clipped; ``num-examples``; the node's ``partition-id``) and the
method's :attr:`~fedlap_jax.method.Method.check_update`; a round's record holds the method's
:attr:`~fedlap_jax.method.Method.round_record`, if any. With fewer than ``min-clients`` usable
replies the round is logged (``stopped``) and the run stops (:class:`TooFewClients`).
"""

from __future__ import annotations

import json
import math
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedlap_runs import checkpointing
from fedlap_runs.checkpointing import write_json_atomic
from fedlap_flower import binding as binding_lib
from fedlap_flower import (
  federated_runs,
  method_work,
  records,
  replies,
  server_state,
  server_work,
  task,
)
from fedlap_flower import settings as settings_lib
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.method import Wire

# The longest client-supplied text kept in a report (a reason, a status).
MAX_TEXT = 2000
# What the published epsilons are (metrics.jsonl's ``epsilon_kind``): the server cannot verify
# a client's accounting, only that its reply was accepted.
EPSILON_KIND = "self-reported by the clients whose replies were accepted"


# What a run writes in its run-dir; a new run refuses a run-dir holding any of them.
# A round's timing depends on the clients' records (their sizes, a DP round's Poisson
# draws), so it is not covered by the guarantee: its own file, beside the releasable
# metrics.jsonl (docs/privacy.md), as experiments.run keeps it.
TIMING_FILE, TIMING_FIELDS = checkpointing.TIMING_FILE, checkpointing.TIMING_FIELDS
OUTPUTS = (
  "metrics.jsonl",
  TIMING_FILE,
  "client_reports.json",
  "run_info.json",
  "final_params.npz",
  "done",
  server_state.STATE_FILE,
)


class TooFewClients(RuntimeError):
  """A round ended with fewer usable client replies than ``min-clients``."""


def _as_json(value):
  """``value`` as it reads back from JSON (tuples become lists)."""
  return json.loads(json.dumps(value, sort_keys=True, default=str))


class RunLog:
  """The server's record of a run in ``run_dir``.

  * ``metrics.jsonl``: one record per round (test accuracy and loss; under DP
    ``epsilon``, the largest epsilon a client reported in an accepted reply so
    far, and ``epsilon_per_client``, this round's accepted replies' epsilons,
    both labelled by ``epsilon_kind`` as the clients' own reports (a refusal's
    figures stay in ``client_reports.json``); this round's radius / status per
    client, the round's clients, server radius and steps,
    bytes uploaded (the updates' arrays: ``upload_bytes`` their values,
    ``upload_wire_bytes`` as sent), ``update_refused`` when the update was not finite);
  * ``timing.jsonl`` (:data:`TIMING_FILE`): per round, ``round_seconds`` and
    ``wall_seconds`` (since the server started). Timing is not covered by the
    guarantee, so it is kept apart from the releasable ``metrics.jsonl``;
  * ``client_reports.json``: everything each client reported, every round,
    and why a reply was not used (rewritten atomically after each round);
  * ``run_info.json``: the settings of the run (with ``resumed``: the rounds
    after which it was resumed);
  * ``server_state.npz``: the state after the last completed round
    (:mod:`fedlap_flower.server_state`).

  A new run (``RunLog(run_dir, info)``) refuses a ``run_dir`` that holds any
  of these (:data:`OUTPUTS`): it would overwrite another run's results.
  :meth:`resume` continues the run in ``run_dir`` after round ``m``.
  """

  def __init__(self, run_dir: Path, info: dict, *, _resumed: tuple | None = None):
    self.run_dir = Path(run_dir)
    self.t0 = time.time()
    if _resumed is not None:
      self.records, self.reports = _resumed
      return
    found = [n for n in OUTPUTS if (self.run_dir / n).exists()]
    if found:
      raise settings_lib.SettingsError(
        "run-dir",
        str(self.run_dir),
        "a directory without a run's outputs, or resume = true",
        message=f"run-dir={str(self.run_dir)!r} holds the outputs of a run ({found}); a new "
        "run would overwrite them. Allowed: another run-dir, or resume = true to continue "
        "that run after its last completed round",
      )
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.reports: list[dict] = []
    self.records: list[dict] = []
    (self.run_dir / "metrics.jsonl").write_text("")
    (self.run_dir / TIMING_FILE).write_text("")
    write_json_atomic(self.run_dir / "run_info.json", info)

  @classmethod
  def check_resumable(cls, run_dir: Path, info: dict) -> dict:
    """Refuses to resume ``run_dir`` unless it holds an unfinished run of ``info``'s config;
    returns that run's ``run_info.json``.

    Raises:
      fedlap_flower.settings.SettingsError: naming ``resume``: no run there, a finished one,
        or a run of other ``config_values`` (another config, overrides or seed).
    """
    run_dir = Path(run_dir)

    def refuse(why: str):
      raise settings_lib.SettingsError(
        "resume",
        True,
        "resume = true for the unfinished run of run-dir with the same config and overrides",
        message=f"resume=true is invalid: run-dir={str(run_dir)!r} {why}",
      )

    path = run_dir / "run_info.json"
    if not path.exists():
      refuse("holds no run to resume; allowed: resume = false for a new run")
    if (run_dir / "done").exists():
      refuse("holds a finished run; allowed: another run-dir for a new run")
    stopped = json.loads(path.read_text())
    if _as_json(stopped.get("config_values")) != _as_json(info["config_values"]):
      refuse(
        "holds a run of another experiment (run_info.json's config_values differ); allowed: "
        "the config and overrides of that run"
      )
    return stopped

  @classmethod
  def resume(cls, run_dir: Path, info: dict, completed: int) -> "RunLog":
    """Continues the run in ``run_dir`` after round ``completed``: its log keeps the rounds
    up to it (a round cut short after them is dropped) and ``run_info.json`` notes the resume.

    Call :meth:`check_resumable` first.
    """
    run_dir = Path(run_dir)
    kept = checkpointing.truncate_metrics(run_dir / "metrics.jsonl", completed)
    checkpointing.truncate_metrics(run_dir / TIMING_FILE, completed)
    path = run_dir / "client_reports.json"
    reports = json.loads(path.read_text()) if path.exists() else []
    reports = [r for r in reports if r.get("round", 0) <= completed]
    write_json_atomic(path, reports)
    old = json.loads((run_dir / "run_info.json").read_text())
    write_json_atomic(
      run_dir / "run_info.json", {**info, "resumed": [*old.get("resumed", []), completed]}
    )
    log(INFO, "[fedlap] resuming %s after round %d", run_dir, completed)
    return cls(run_dir, info, _resumed=(kept, reports))

  def add_reports(self, reports: list[dict]) -> None:
    self.reports.extend(reports)
    write_json_atomic(self.run_dir / "client_reports.json", self.reports)

  def add_round(self, record: dict) -> None:
    """Appends a round's record to ``metrics.jsonl``, its timing fields to ``timing.jsonl``."""
    timing = {"round": record["round"], "wall_seconds": time.time() - self.t0}
    timing.update((k, record[k]) for k in TIMING_FIELDS if k in record)
    record = {k: v for k, v in record.items() if k not in TIMING_FIELDS}
    self.records.append(record)
    # timing.jsonl first: metrics.jsonl decides resumes
    checkpointing.append_metrics(self.run_dir / TIMING_FILE, timing)
    checkpointing.append_metrics(self.run_dir / "metrics.jsonl", record)
    eps = record.get("epsilon")
    log(
      INFO,
      "[fedlap] round %d: test accuracy %.4f, loss %.4f%s, clients ok %s%s%s",
      record["round"],
      record["test_accuracy"],
      record["test_loss"],
      "" if eps is None else f", epsilon {eps:.3f} (self-reported)",
      record["clients_ok"],
      "".join(
        f", {k} {v}"
        for k, v in record.items()
        if k.startswith("clients_") and k != "clients_ok" and v
      ),
      f"; UPDATE REFUSED: {record['update_refused']}" if record.get("update_refused") else "",
    )


def wait_for_nodes(
  grid: Grid, expected: int, minimum: int, join_timeout: float, timeout: float
) -> list[int]:
  """The connected node ids a round starts with.

  Waits until all ``expected`` clients are connected, at most ``join_timeout``
  seconds; then, if fewer than ``minimum`` are there, until ``minimum`` are, at
  most ``timeout`` seconds in all (the round then starts with whatever is there
  and stops for too few replies).
  """
  t0 = time.time()
  while True:
    nodes = sorted(grid.get_node_ids())
    waited = time.time() - t0
    if (
      len(nodes) >= expected
      or (waited >= join_timeout and len(nodes) >= minimum)
      or waited >= timeout
    ):
      return nodes
    time.sleep(1.0)


def _text(value: Any) -> str:
  text = value if isinstance(value, str) else replies.short(value, MAX_TEXT)
  return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def _why(e: Exception) -> str:
  """A dropped reply's reason: ``FIELD: message`` for a check, ``Type: message`` otherwise."""
  head = e.field if isinstance(e, replies.InvalidReply) else type(e).__name__
  return _text(f"{head}: {e}")


def _loggable(metrics: dict) -> dict:
  """A reply's metrics for the reports: numbers as they are, lists summarised."""
  out = {}
  for k, v in list(metrics.items())[:64]:
    k = _text(k)[:100]
    if isinstance(v, (bool, int, float)):
      out[k] = v if not isinstance(v, float) or math.isfinite(v) else repr(v)
    else:
      out[k] = f"<{type(v).__name__} of {len(v) if hasattr(v, '__len__') else '?'}>"
  return out


def _finite(params) -> bool:
  return all(bool(np.isfinite(np.asarray(leaf)).all()) for leaf in jax.tree.leaves(params))


def _check_pinned(binding: binding_lib.PartitionBinding, pid: int, num_examples) -> None:
  """Refuses a ``num-examples`` other than the one pinned for partition ``pid``."""
  if num_examples is None:
    return
  try:
    binding.check_pinned(pid, "num-examples", num_examples)
  except ValueError as e:
    raise replies.InvalidReply("num-examples", str(e)) from None


def _check_pinned_labels(pinned, synthetic) -> None:
  """Refuses a synthetic set whose ``y`` / ``mask`` differ from ``pinned`` (the partition's
  first accepted ones; ``None``: none yet)."""
  if pinned is not None and not (
    np.array_equal(pinned[0], synthetic.y) and np.array_equal(pinned[1], synthetic.mask)
  ):
    raise replies.InvalidReply(
      "y",
      "y / mask differ from this partition's earlier replies; "
      "allowed: the synthetic labels fixed for the run",
    )


def _check_update(check, message, update) -> None:
  """A method's bounds on one client's update (:attr:`fedlap_jax.method.Method.check_update`,
  ``None``: none) in the round of ``message``; a refusal names the update's field."""
  if check is None:
    return
  try:
    check(message, update)
  except ConfigError as e:
    raise replies.InvalidReply(str(e.field), str(e)) from None


def _round_record(method, metrics) -> dict:
  """The public numbers of a round's server step (:attr:`fedlap_jax.method.Method.round_record`):
  ``{}`` for a method without them or a round whose update was refused (``metrics`` None)."""
  if method.round_record is None or metrics is None:
    return {}
  return method.round_record(metrics)


def _synthetic_sets(update) -> list:
  """The synthetic sets an update holds (:class:`fedlap_jax.SyntheticSet` nodes)."""
  is_set = lambda t: isinstance(t, SyntheticSet)  # noqa: E731
  return [t for t in jax.tree.leaves(update, is_leaf=is_set) if is_set(t)]


def _guarded_update(run: Callable, previous, evaluate, what: str, no_metrics):
  """``(params, metrics, refused, loss, accuracy)`` of ``run() -> (params, metrics)``.

  The aggregation's error boundary: every reply was checked on its own, but
  should ``run`` still raise, or give NaN / Inf parameters or test loss, the
  update is refused (``refused``: why), ``previous`` is kept (with
  ``no_metrics``) and the run goes on.
  """
  try:
    params, metrics = run()
  except Exception as e:  # pylint: disable=broad-except  (the aggregation's error boundary)
    params, metrics, why = None, no_metrics, _text(f"the {what} raised {type(e).__name__}: {e}")
  else:
    why = None if _finite(params) else f"the {what} holds NaN or Inf parameters"
  if why is None:
    loss, acc = evaluate(params)
    if math.isfinite(loss):
      return params, metrics, None, loss, acc
    why = f"the test loss after the {what} is {loss}"
  loss, acc = evaluate(previous)
  return previous, no_metrics, why + "; the previous global model is kept", loss, acc


def _reply_node(msg: Message, destination: dict) -> int:
  """The node a reply answers for: the destination of the message it replies to."""
  return int(destination.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))


def _destinations(messages) -> dict:
  # The Grid gives the sent messages their ids; an error the SuperLink returns for an
  # unavailable node comes from the SuperLink and names the message it answers.
  return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}


def _node_facts(grid: Grid, nodes: list[int]) -> dict[int, binding_lib.NodeFacts]:
  """What the SuperLink says about ``nodes`` (key fingerprint, connection time)."""
  facts = {n: binding_lib.NodeFacts(n) for n in nodes}
  try:
    infos = list(grid.get_nodes())
  except Exception:  # pylint: disable=broad-except  (a Grid without node details)
    return facts
  for info in infos:
    node = int(info.node_id)
    if node not in facts:
      continue
    fingerprint = ""
    if info.public_key:
      try:
        fingerprint = binding_lib.key_fingerprint(bytes(info.public_key))
      except (ValueError, TypeError):
        fingerprint = ""
    facts[node] = binding_lib.NodeFacts(node, fingerprint, str(info.last_activated_at or ""))
  return facts


def collect_replies(
  round_state: dict,
  server_round: int,
  replies_in: list[Message],
  parse_one: Callable[[Message, int, dict], tuple | None],
  round_timeout: float,
) -> tuple[list[tuple], list[dict]]:
  """``(usable, reports)`` of one round's replies, each in its own error boundary.

  A reply must come from a node asked this round (``round_state["asked"]``,
  node -> partition), once; ``parse_one(msg, node, report)`` returns the usable
  tuple (partition first) or ``None`` (a client's refusal, reported by it), and
  raises on anything invalid: the reply is then reported ``invalid`` with the
  reason and left out. A node asked that did not reply is reported
  ``missing``. ``usable`` is in partition order, the order of
  ``experiments.run``'s stacked clients (or sampled block); ``reports`` starts
  with ``round_state["reports"]`` (the round's configure step).
  """
  asked = round_state.get("asked", {})
  destination = _destinations(round_state.get("messages", []))
  usable, reports, replied = [], list(round_state.get("reports", [])), set()
  for msg in replies_in:
    report = {"round": server_round, "node_id": None, "partition_id": None}
    try:
      node = _reply_node(msg, destination)
      report.update(node_id=node, partition_id=asked.get(node))
      if node not in asked:
        raise replies.InvalidReply(
          "node", f"a reply from node {node}, which was not asked this round"
        )
      if node in replied:
        raise replies.InvalidReply("node", f"a second reply from node {node}")
      replied.add(node)
      got = parse_one(msg, node, report)
      if got is not None:
        report["status"] = "ok"
        usable.append(got)
    except Exception as e:  # pylint: disable=broad-except  (one reply's error boundary)
      report.update(status="invalid", reason=_why(e), field=getattr(e, "field", None))
      for k in ("upload_bytes", "upload_wire_bytes"):
        report.pop(k, None)
    reports.append(report)
  for node in sorted(asked):
    if node not in replied:
      reports.append(
        {
          "round": server_round,
          "node_id": node,
          "partition_id": asked[node],
          "status": "missing",
          "reason": f"no reply within round-timeout={round_timeout:g} s",
        }
      )
  return sorted(usable, key=lambda u: u[0]), reports


class Participation:
  """Which nodes a round asks: partition binding and client sampling (module docstring)."""

  def __init__(
    self, cfg, *, partition_keys, min_clients: int, round_timeout: float, join_timeout: float
  ):
    self.cfg = cfg
    self.num_clients = int(cfg.data.num_clients)
    self.binding = binding_lib.PartitionBinding(self.num_clients, partition_keys)
    self.min_clients = min_clients
    self.round_timeout = round_timeout
    self.join_timeout = join_timeout

  def _ask_partitions(self, grid: Grid, server_round: int, nodes: list[int], facts: dict):
    """Queries ``nodes`` for their ``partition-id``; ``(claims, reports)``."""
    messages = [
      Message(
        content=RecordDict(
          {"config": ConfigRecord({"server-round": server_round, "ask": "partition-id"})}
        ),
        message_type=MessageType.QUERY,
        dst_node_id=n,
      )
      for n in nodes
    ]
    answers = list(grid.send_and_receive(messages, timeout=self.round_timeout))
    destination = _destinations(messages)
    claims, reports, answered = [], [], set()
    for msg in answers:
      report = {
        "round": server_round,
        "node_id": None,
        "partition_id": None,
        "stage": "partition-id query",
      }
      try:
        node = _reply_node(msg, destination)
        report["node_id"] = node
        if node not in facts or node in answered:
          raise replies.InvalidReply(
            "node", f"an answer from node {node}, which was not asked (or answered twice)"
          )
        answered.add(node)
        if msg.has_error():
          report.update(status="error", reason=_text(msg.error.reason))
          reports.append(report)
          continue
        metrics = dict(msg.content.metric_records["metrics"])
        claims.append((facts[node], replies.check_partition(metrics, self.num_clients)))
      except Exception as e:  # pylint: disable=broad-except  (one reply's error boundary)
        report.update(status="invalid", reason=_why(e), field=getattr(e, "field", None))
        reports.append(report)
    for node in nodes:
      if node not in answered:
        reports.append(
          {
            "round": server_round,
            "node_id": node,
            "partition_id": None,
            "stage": "partition-id query",
            "status": "missing",
            "reason": f"no answer within round-timeout={self.round_timeout:g} s",
          }
        )
    return claims, reports

  def select(self, grid: Grid, server_round: int) -> tuple[dict[int, int], list[int], list[dict]]:
    """``(asked {node: partition}, the round's clients, reports of nodes left out)``."""
    nodes = wait_for_nodes(
      grid, self.num_clients, self.min_clients, self.join_timeout, self.round_timeout
    )
    facts = _node_facts(grid, nodes)
    self.binding.release_absent(nodes)
    reports: list[dict] = []
    unbound = [n for n in nodes if self.binding.partition_of(n) is None]
    refused: dict[int, str] = {}
    claimed: dict[int, int] = {}
    if self.binding.by_key:
      refused = self.binding.bind_by_key([facts[n] for n in unbound])
    elif unbound:
      claims, reports = self._ask_partitions(grid, server_round, unbound, facts)
      claimed = {f.node_id: pid for f, pid in claims}
      refused = self.binding.claim(claims)
    for node, reason in sorted(refused.items()):
      reports.append(
        {
          "round": server_round,
          "node_id": node,
          "partition_id": claimed.get(node),
          "stage": "partition binding",
          "status": "invalid",
          "reason": reason,
          "field": "partition-keys" if self.binding.by_key else "partition-id",
        }
      )
    chosen = task.participants(self.cfg, server_round).tolist()
    asked = {}
    for pid in chosen:
      node = self.binding.node_of(pid)
      if node is not None:
        asked[node] = pid
    return asked, chosen, reports


class MethodStrategy(FedAvg):
  """Flower's FedAvg messages around a federated registry method (the module docstring;
  :mod:`fedlap_flower.method_work`): the server's state, plan and step are the method's.

  Its state is the method's (:attr:`~fedlap_jax.method.Method.init` before round 1) without
  the clients' carried fields: each client keeps its own, and the plan and the server step see
  public stand-ins of their shapes (:func:`fedlap_flower.method_work.carried_standins`). Each
  round it asks the round's clients (:class:`Participation`), runs the method's plan
  (:meth:`_plan_round`), checks each reply by the method's wire (:meth:`_parse_one`) and, on
  the replies that fit, runs its server step in an error boundary (:meth:`_server_update`).

  After every round it saves its state in the run-dir (:mod:`fedlap_flower.server_state`:
  the parameters, the key chain, the method's own state fields, what it pinned);
  :meth:`restore` takes it back, and the rounds Flower numbers ``1, 2, ...`` are then rounds
  ``m + 1, m + 2, ...`` of the run (:attr:`rounds_done` is added to them).
  """

  rounds_done = 0

  def __init__(
    self,
    *,
    cfg,
    method,
    method_config,
    facts,
    model,
    k_alg,
    template,
    evaluate,
    min_clients: int,
    round_timeout: float,
    join_timeout: float,
    model_bytes: int,
    federated_run: str,
    unsafe_dp_keys_from_server: bool = False,
    max_epsilon: float = math.inf,
    partition_keys=None,
    max_classes_stated: int = 0,
    max_update_norm: float | str | None = "",
    num_classes: int = 10,
    max_image_abs: float = replies.IMAGE_RANGE_FACTOR,
  ):
    """The run's experiment config ``cfg``, its method and library config, its
    :class:`~fedlap_jax.method.RunFacts`, the model (:class:`~fedlap_jax.method.ModelFns`;
    ``template``: its parameters' layout, the parameter records travel packed), the algorithm
    key ``k_alg`` (the method's init), the test evaluation, the run config's limits and the
    federated run's identity (under which the clients keep their carried state);
    ``max_classes_stated``: the run config's ``max-classes-per-client``; ``max_update_norm``:
    its ``max-update-norm`` (:func:`fedlap_flower.replies.update_norm_rule`); ``num_classes``
    and ``max_image_abs`` bound a synthetic set. The server sets :attr:`run_log` once the
    run-dir is written, after the checks here.

    Raises:
      fedlap_jax.checks.ConfigError: a run config the method's wire cannot take (naming the
        field).
    """
    super().__init__(
      fraction_train=1.0,
      fraction_evaluate=0.0,
      min_train_nodes=min_clients,
      min_available_nodes=min_clients,
    )
    self.cfg = cfg
    self.federated_run = federated_run
    self.model = model
    self.template = template
    self.evaluate = evaluate
    self.min_clients = min_clients
    self.round_timeout = round_timeout
    self.join_timeout = join_timeout
    self.run_log: RunLog | None = None  # the server sets it once the run-dir is written
    self.model_bytes = model_bytes
    self.max_epsilon = float(max_epsilon)
    # DP at the edge: each client charges its own ledger and draws its own keys.
    self.mechanism = method.mechanism(method_config)
    self.dp = self.mechanism is not None
    self.server_keys = (not self.dp) or unsafe_dp_keys_from_server
    self.method = method
    self.mc = method_config
    self.participation = Participation(
      self.cfg,
      partition_keys=partition_keys,
      min_clients=min_clients,
      round_timeout=round_timeout,
      join_timeout=join_timeout,
    )
    self.check_update = (
      None if method.check_update is None else method.check_update(method_config, facts)
    )
    full = method_work.initial_state(method, method_config, template, k_alg, facts)
    # The clients keep their carried state; the plan and step see public stand-ins.
    self._standins = method_work.carried_standins(full, method)
    self.state = method_work.server_state(full, method)
    self._labels: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._epsilon: dict[int, float] = {}
    self._round: dict[str, Any] = {}
    self.facts = facts
    self.wire = method.wire(method_config, template, facts)
    # The largest ||w_k - w_g|| of a round's reply (replies.update_norm_rule; None: none).
    self.update_bound = replies.update_norm_rule(max_update_norm, method, method_config, facts)
    self.update_template = self._update_template(facts)
    self.packed = method_work.is_model(self.update_template, template)
    if not self.packed and max_update_norm not in ("", None):
      raise ConfigError(
        "max-update-norm",
        max_update_norm,
        "'' (the default) or 'none'",
        message=f"max-update-norm={max_update_norm!r} bounds ||w_k - w_g|| of a reply that is "
        f"the client's model; method={method.name!r} sends another update (its wire: "
        f"{', '.join(self.wire.names())}), so the bound would check nothing. Allowed: '' (the "
        "default) or 'none'",
      )
    # A synthetic set's checks (FedLAP's): ipc slots per class, S = ipc * the most classes.
    self.limits = None
    sets = _synthetic_sets(self.update_template)
    if sets and facts.max_classes_per_client < 1:
      raise ConfigError(
        "data",
        "data the server does not know the clients' classes of",
        f"the config's named data and partition, or {method_work.MAX_CLASSES_KEY}",
        message=f"method={method.name!r} sends synthetic sets of ipc slots per class of the "
        "client owning the most classes, a fact of the config's named partition; this "
        "server reads its own data and knows no client's classes. Allowed: the config's "
        f"named data (no server data file), the run config's {method_work.MAX_CLASSES_KEY} "
        "(the most classes a client holds), or a method that sends no synthetic set",
      )
    if not sets and max_classes_stated:
      raise ConfigError(
        method_work.MAX_CLASSES_KEY,
        max_classes_stated,
        "0 (not stated)",
        message=f"{method_work.MAX_CLASSES_KEY}={max_classes_stated!r} sizes a synthetic set; "
        f"method={method.name!r} sends none (its wire: {', '.join(self.wire.names())}), so "
        "it would size nothing. Allowed: 0 (not stated)",
      )
    if sets:
      s = int(sets[0].x.shape[0])
      self.limits = replies.SyntheticLimits(
        tuple(facts.image_shape),
        int(num_classes),
        s // max(1, facts.max_classes_per_client),
        float(max_image_abs),
      )
    if sorted(Wire.of(self.update_template).fields) != sorted(self.wire.fields):
      raise ConfigError(
        "method",
        method.name,
        "a method whose client step returns the update its wire declares",
        message=f"method={method.name!r}: its client step returns "
        f"{Wire.of(self.update_template).fields}, its wire declares {self.wire.fields}",
      )
    self._t0 = time.time()

  def _plan_round(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> dict:
    """The round's clients and the method's plan for them: ``asked`` (node -> partition),
    ``chosen``, ``reports`` (nodes left out), the global ``params``, the round's ``state``
    (with the chosen clients' stand-ins) and its ``plan``."""
    asked, chosen, reports = self.participation.select(grid, server_round)
    params = records.record_to_params(arrays, self.template)
    state = method_work.with_standins(
      self.state._replace(params=params, round=jnp.int32(server_round - 1)),
      self._standins,
      len(chosen),
    )
    plan = method_work.plan_fn(self.method, len(chosen), self.mc)(state)
    return {
      "asked": asked,
      "chosen": chosen,
      "reports": reports,
      "arrays": arrays,
      "params": params,
      "state": state,
      "plan": plan,
      "epsilon_bound": (self.max_epsilon, "the run's max-epsilon"),
      "run_epsilon_bound": self._run_epsilon_bound(server_round - self.rounds_done),
    }

  def _run_epsilon_bound(self, rounds: int) -> tuple[float, str]:
    """The largest ``run-epsilon`` (the epsilon of this Flower run's charges alone) a reply may
    report after ``rounds`` rounds of this Flower run, and what it is: the most those rounds
    of the run's mechanism give any client, whatever its ``N_k`` and its earlier runs."""
    if self.mechanism is None:
      return math.inf, ""
    return (
      self.mechanism.epsilon_bound(rounds),
      f"the most {rounds} rounds of the run's mechanism give a client",
    )

  def _delivered_round(self, node: int) -> int:
    """The last round whose server update took the reply of ``node``'s partition (0: none), from
    the run log's rounds (those a resumed run keeps: each update made and the ``clients_ok``
    it took), sent as :data:`fedlap_flower.federated_runs.DELIVERED_KEY`: its client continues
    its carried state from that round."""
    pid = self._round["asked"][node]
    taken = (
      int(r["round"])
      for r in self.run_log.records
      if not r.get("update_refused") and not r.get("stopped") and pid in r.get("clients_ok", ())
    )
    return max(taken, default=0)

  def _server_update(self, server_round: int, updates: list, num_records: list, what: str):
    """The method's server step on the usable ``updates`` (partition order) in the error
    boundary of :func:`_guarded_update`; the state moves on to the next round's key either way.
    ``(params, metrics, refused, loss, accuracy)`` (``metrics`` ``None``: refused)."""
    plan, state = self._round["plan"], self._round["state"]
    take_part = (len(self._round["chosen"]), int(self.cfg.data.num_clients))

    def update():
      new, metrics = server_work.method_update(
        self.method, self.model, self.mc, take_part, plan, state, updates, num_records
      )
      return new.params, (new, metrics)

    params, (new_state, metrics), refused, loss, acc = _guarded_update(
      update, self._round["params"], self.evaluate, what, (state, None)
    )
    self.state = method_work.server_state(
      new_state._replace(round=jnp.int32(server_round), key=plan.next_key), self.method
    )
    return params, metrics, refused, loss, acc

  def _save_state(self, server_round: int, params) -> None:
    extra = method_work.tree_to_arrays(self.state._replace(params=None, key=None, round=None))
    server_state.save(
      self.run_log.run_dir,
      server_state.ServerState(
        server_round,
        params,
        self.state.key,
        self._labels,
        self._epsilon,
        self.participation.binding.pins,
        extra,
      ),
    )

  def restore(self, state: server_state.ServerState) -> None:
    """Continues after ``state.round`` with the method's state and what it pinned."""
    self.rounds_done = int(state.round)
    template = self.state._replace(params=None, key=None, round=None)
    rest = method_work.arrays_to_tree(state.extra, template)
    self.state = rest._replace(
      params=state.params, key=state.chain, round=self.state.round + int(state.round)
    )
    self._epsilon = dict(state.epsilon)
    self._labels = dict(state.labels)
    self.participation.binding.restore_pins(state.pins)

  def _update_template(self, facts):
    """The structure of a client's update, from one client's public stand-ins (traced with
    :func:`jax.eval_shape`; nothing compiled or run)."""
    state = method_work.with_standins(self.state, self._standins, 1)

    def one_client(state):
      plan = self.method.plan(state, 1, self.mc)
      return plan.message, jax.tree.map(lambda a: a[0], plan.own)

    message, own = jax.eval_shape(one_client, state)
    carried = tuple(jax.tree.map(lambda a: a[0], v) for v in self._standins.values())
    return method_work.update_template(
      self.method,
      self.model,
      self.mc,
      message,
      own,
      carried,
      method_work.shape_only_client(self.method, self.mc, facts),
    )

  def configure_train(self, server_round, arrays, config, grid):
    server_round += self.rounds_done
    if hasattr(grid, "limit_replies"):  # a reply is bounded by what the update takes
      grid.limit_replies(
        sum(int(np.prod(f.shape)) * np.dtype(f.dtype).itemsize for f in self.wire.fields),
        len(self.wire.fields),
      )
    self._round = self._plan_round(server_round, arrays, grid)
    asked, chosen, plan = self._round["asked"], self._round["chosen"], self._round["plan"]
    message_arrays = method_work.tree_to_arrays(method_work.without_model(plan.message))
    messages = []
    for node in sorted(asked):
      slot = chosen.index(asked[node])
      own = method_work.tree_to_arrays(jax.tree.map(lambda a: a[slot], plan.own))
      conf = ConfigRecord(dict(config))
      conf["server-round"] = server_round
      conf["num-clients"] = int(self.cfg.data.num_clients)
      conf["keys"] = "server" if self.server_keys else "client"
      conf[federated_runs.MESSAGE_KEY] = self.federated_run
      conf[federated_runs.DELIVERED_KEY] = self._delivered_round(node)
      content = RecordDict(
        {
          self.arrayrecord_key: arrays,
          self.configrecord_key: conf,
          "message": records.arrays_record(message_arrays),
        }
      )
      if self.server_keys:  # under DP the clients draw their own keys
        content["own"] = records.arrays_record(own)
      messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node))
    self._t0 = time.time()
    self._round.update(max_update_norm=self.update_bound(plan.message), messages=messages)
    return messages

  def _parse_one(self, msg: Message, node: int, report: dict):
    """One reply into ``report``; an ``ok`` reply's ``(partition, update, num_examples)``."""
    if msg.has_error():
      report.update(status="error", reason=_text(msg.error.reason))
      return None
    content = msg.content
    status = dict(content.config_records["status"]) if "status" in content.config_records else {}
    state = status.get("status", "ok")
    if state not in ("ok", "refused"):
      raise replies.InvalidReply(
        "status", f"status={replies.short(state)} is invalid; allowed: 'ok' or 'refused'"
      )
    if "metrics" not in content.metric_records:
      raise replies.InvalidReply("reply", "a reply without its 'metrics' record")
    metrics = dict(content.metric_records["metrics"])
    report["metrics"] = _loggable(metrics)
    if state == "refused":  # its metrics stay in the report; nothing of it is published
      report["partition_id"] = replies.check_partition(
        metrics, int(self.cfg.data.num_clients), self._round["asked"].get(node)
      )
      report["status"] = "refused"
      if status.get("reason"):
        report["reason"] = _text(status["reason"])
      return None
    update_key = self.arrayrecord_key if self.packed else "update"
    allowed = {update_key, "metrics", "status"}
    extra = sorted(set(content.keys()) - allowed)
    if extra or update_key not in content.array_records:
      raise replies.InvalidReply(
        "reply",
        f"the reply holds records {replies.short(sorted(content.keys()))}; "
        f"allowed: {update_key!r}, 'metrics' and 'status'",
      )
    known = (
      {"partition-id", "epsilon", "run-epsilon", "max-epsilon", "dp-steps"}
      if self.dp
      else {self.weighted_by_key, "partition-id"}
    )
    unknown = sorted(set(metrics) - known)
    if unknown:
      raise replies.InvalidReply(
        "metrics", f"metrics {replies.short(unknown)} are unknown; allowed: {sorted(known)}"
      )
    report["partition_id"] = replies.check_partition(
      metrics, int(self.cfg.data.num_clients), self._round["asked"].get(node)
    )
    # Under DP a client sends no record count (the weighting is uniform: its config's rule).
    num_examples = None if self.dp else replies.check_num_examples(metrics, required=True)
    _check_pinned(self.participation.binding, report["partition_id"], num_examples)
    eps = replies.check_epsilon(metrics, self.dp, *self._round["epsilon_bound"])
    replies.check_epsilon(metrics, self.dp, *self._round["run_epsilon_bound"], key="run-epsilon")
    record = content.array_records[update_key]
    if self.packed:  # the model, packed
      # the packing, then the method's own wire format (names, shapes, dtypes, finite values)
      update = records.record_to_like(record, self._round["params"], "model", wire=self.wire)
      bound = self._round.get("max_update_norm")
      if bound is not None:  # in the report, refused or not
        report.update(
          update_norm=replies.update_norm(update, self._round["params"]), max_update_norm=bound
        )
        replies.check_update_norm(report["update_norm"], bound)
    else:  # the method's update by the names of its wire
      arrays = records.record_to_wire(record, self.wire)
      update = method_work.arrays_to_tree(arrays, self.update_template)
    for synthetic in _synthetic_sets(update):  # FedLAP's checks of a synthetic set
      x, y, mask = (np.asarray(a) for a in synthetic)
      replies.check_synthetic(x, y, mask, self.limits)
      _check_pinned_labels(self._labels.get(report["partition_id"]), SyntheticSet(x, y, mask))
    _check_update(self.check_update, self._round["plan"].message, update)
    report.update(
      status="ok",
      upload_bytes=records.raw_bytes(record),
      upload_wire_bytes=records.wire_bytes(record),
    )
    return report["partition_id"], update, num_examples, eps

  def aggregate_train(self, server_round, replies_in):
    server_round += self.rounds_done
    ok, reports = collect_replies(
      self._round, server_round, list(replies_in), self._parse_one, self.round_timeout
    )
    self.run_log.add_reports(reports)
    by_status: dict[str, list] = {}
    for r in reports:
      if r["status"] != "ok":
        by_status.setdefault(r["status"], []).append(
          r["partition_id"] if r["partition_id"] is not None else f"node {r['node_id']}"
        )
        log(  # %r: a reason a client wrote cannot forge log lines
          WARNING,
          "[fedlap] round %d: client %s (node %s) %s: %r",
          server_round,
          r["partition_id"],
          r["node_id"],
          r["status"],
          r.get("reason", ""),
        )
    chosen = self._round["chosen"]
    unheld = [p for p in chosen if self.participation.binding.node_of(p) is None]
    sampled = self.cfg.data.get("clients_per_round") is not None
    base = {
      "round": server_round,
      **({"clients": chosen} if sampled else {}),
      "clients_ok": [u[0] for u in ok],  # the usable replies, in partition order
      **{f"clients_{s}": v for s, v in by_status.items()},
      **({"partitions_unheld": unheld} if unheld else {}),
      **({"epsilon_kind": EPSILON_KIND} if self.dp else {}),
      "model_bytes": self.model_bytes,
    }
    if len(ok) < self.min_clients:
      clients = {k: v for k, v in base.items() if k.startswith("clients_")}
      msg = (
        f"round {server_round}: {len(ok)} usable client replies, fewer than "
        f"min-clients={self.min_clients} ({json.dumps(clients)}); the run stops. See "
        f"{self.run_log.run_dir / 'client_reports.json'}"
      )
      self.run_log.add_round(
        {
          **base,
          "test_accuracy": math.nan,
          "test_loss": math.nan,
          "epsilon": max(self._epsilon.values()) if self._epsilon else None,
          "stopped": msg,
          "round_seconds": time.time() - self._t0,
        }
      )
      raise TooFewClients(msg)
    for pid, update, n, _ in ok:
      if n is not None:
        self.participation.binding.pin(pid, "num-examples", n)
      for synthetic in _synthetic_sets(update)[:1]:  # its labels are fixed for the run
        self._labels.setdefault(pid, (np.asarray(synthetic.y), np.asarray(synthetic.mask)))
    # Published: the epsilons of accepted replies only, each the client's own report.
    this_round = {u[0]: u[3] for u in ok if u[3] is not None}
    for pid, eps in this_round.items():
      self._epsilon[pid] = max(self._epsilon.get(pid, 0.0), eps)
    params, metrics, refused, loss, acc = self._server_update(
      server_round,
      [u[1] for u in ok],
      [1 if u[2] is None else u[2] for u in ok],  # unread under DP's uniform weights
      "aggregate",
    )
    arrays = self._round["arrays"] if refused else records.params_to_record(params)
    upload = sum(r.get("upload_bytes", 0) for r in reports)
    self.run_log.add_round(
      {
        **base,
        "test_accuracy": acc,
        "test_loss": loss,
        "epsilon": max(self._epsilon.values()) if self._epsilon else None,
        "epsilon_per_client": {str(k): v for k, v in sorted(this_round.items())},
        **({"update_refused": refused} if refused else {}),
        **_round_record(self.method, metrics),
        "upload_bytes": upload,
        "upload_wire_bytes": sum(r.get("upload_wire_bytes", 0) for r in reports),
        "round_seconds": time.time() - self._t0,
      }
    )
    self._save_state(server_round, self.state.params)
    metrics = MetricRecord(
      {"test-accuracy": acc, "test-loss": loss, "clients-ok": len(ok), "upload-bytes": upload}
    )
    if self._epsilon:
      metrics["epsilon"] = float(max(self._epsilon.values()))
    return arrays, metrics
