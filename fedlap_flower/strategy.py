"""Server strategies: FedLAP / FedLAP-DP, and FedAvg through Flower's own strategy.

:class:`FedLAP` (a ``flwr.serverapp.strategy.Strategy``):

* ``configure_train`` waits up to ``join-timeout`` for all ``K`` clients to be
  connected (and up to ``round-timeout`` for ``min-clients``), then sends every
  connected node the global parameters,
  the round's learning rate ``eta_m`` and, without DP, the round's keys as
  ``experiments.run`` derives them (``(next, k_init, k_clients, k_server) =
  split(state key, 4)``); under DP each client draws its keys from its own
  secret (see :mod:`fedlap_flower.ledger`).
* ``aggregate_train`` sorts the replies: ``ok`` (a synthetic set), ``refused``
  (the client's privacy budget), ``error`` (the ClientApp raised, or Flower
  reports the node unavailable) and ``missing`` (no reply within
  ``round-timeout``). With fewer than ``min-clients`` usable sets it logs the
  round and stops the run (:class:`TooFewClients`). Otherwise it stacks the
  sets in partition order, runs :func:`fedlap_flower.server_work.server_update`
  (radius ``r_g`` from the clients' ``r_k`` by the config's strategy, then
  :func:`fedlap_jax.global_update`), evaluates on the test split and logs the
  round (:class:`RunLog`). With ``server.start='fedavg_delta'`` (the hybrid
  recipe) every ``ok`` reply must also carry the client's model delta (a reply
  without one, or with one that does not match the model, is ``invalid``);
  the descent starts from ``w_g`` plus the usable clients' deltas averaged
  with the server's weights, as ``experiments.run`` does.

:class:`FedAvgBaseline` is Flower's ``FedAvg`` (weighted mean of the clients'
models by ``num-examples``) with the cosine learning rate and the round keys
added to each round's config, and the test evaluation logged the same way.
"""

from __future__ import annotations

import json
import math
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fedlap_flower import records, server_work, task
from fedlap_flower.ledger import write_json_atomic


class TooFewClients(RuntimeError):
  """A round ended with fewer usable client replies than ``min-clients``."""


class RunLog:
  """The server's record of a run in ``run_dir``.

  * ``metrics.jsonl``: one record per round (test accuracy and loss, the
    largest epsilon any client reported, per-client epsilon / radius / status,
    server radius and steps, bytes uploaded (synthetic sets, plus the model
    deltas with ``server.start='fedavg_delta'``, also counted alone in
    ``upload_delta_bytes``), seconds);
  * ``client_reports.json``: everything each client reported, every round
    (rewritten atomically after each round);
  * ``run_info.json``: the settings of the run.
  """

  def __init__(self, run_dir: Path, info: dict):
    self.run_dir = Path(run_dir)
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.reports: list[dict] = []
    self.records: list[dict] = []
    self.t0 = time.time()
    (self.run_dir / "metrics.jsonl").write_text("")
    write_json_atomic(self.run_dir / "run_info.json", info)

  def add_reports(self, reports: list[dict]) -> None:
    self.reports.extend(reports)
    write_json_atomic(self.run_dir / "client_reports.json", self.reports)

  def add_round(self, record: dict) -> None:
    record = {**record, "wall_seconds": time.time() - self.t0}
    self.records.append(record)
    with open(self.run_dir / "metrics.jsonl", "a") as f:
      f.write(json.dumps(record, sort_keys=True) + "\n")
    eps = record.get("epsilon")
    log(INFO, "[fedlap] round %d: test accuracy %.4f, loss %.4f%s, clients ok %s%s",
        record["round"], record["test_accuracy"], record["test_loss"],
        "" if eps is None else f", epsilon {eps:.3f}", record["clients_ok"],
        "".join(f", {k} {v}" for k, v in record.items()
                if k.startswith("clients_") and k != "clients_ok" and v))


def wait_for_nodes(grid: Grid, expected: int, minimum: int, join_timeout: float,
                   timeout: float) -> list[int]:
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
    if len(nodes) >= expected or (waited >= join_timeout and len(nodes) >= minimum) \
        or waited >= timeout:
      return nodes
    time.sleep(1.0)


def _metric(content, key, default=None):
  for rec in content.metric_records.values():
    if key in rec:
      return rec[key]
  return default


class FedLAP(Strategy):
  """FedLAP / FedLAP-DP over Flower messages (see the module docstring)."""

  def __init__(self, *, cfg, fedlap_config, apply_fn, evaluate, min_clients: int,
               round_timeout: float, join_timeout: float, unsafe_dp_keys_from_server: bool,
               run_log: RunLog, model_bytes: int):
    self.cfg = cfg
    self.fc = fedlap_config
    self.apply_fn = apply_fn
    self.evaluate = evaluate
    self.num_clients = int(cfg.data.num_clients)
    self.min_clients = min_clients
    self.round_timeout = round_timeout
    self.join_timeout = join_timeout
    self.dp = fedlap_config.client.dp is not None
    self.server_keys = (not self.dp) or unsafe_dp_keys_from_server
    self.with_deltas = fedlap_config.server.start == "fedavg_delta"
    self.run_log = run_log
    self.model_bytes = model_bytes
    self._chain = task.initial_chain_key(cfg.seed)
    self._round: dict[str, Any] = {}
    self._partition_of: dict[int, int] = {}
    self._params = None

  def summary(self) -> None:
    log(INFO, "\t├──> FedLAP%s: %d clients (min %d per round), %s keys, radius strategy %s",
        "-DP" if self.dp else "", self.num_clients, self.min_clients,
        "server" if self.server_keys else "client-secret",
        self.fc.server.radius_strategy)
    if self.dp and self.server_keys:
      log(WARNING, "UNSAFE (test only): DP clients draw their noise from keys the server "
          "chose; a server that knows them can remove the noise")

  def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                      grid: Grid) -> Iterable[Message]:
    nodes = wait_for_nodes(grid, self.num_clients, self.min_clients, self.join_timeout,
                           self.round_timeout)
    self._chain, k_init, k_clients, k_server = task.round_keys(self._chain)
    lr = task.learning_rate(self.cfg, server_round)
    self._params = records.record_to_params(arrays)
    self._round = {"server_round": server_round, "k_server": k_server, "lr": lr,
                   "server_lr": task.server_learning_rate(self.fc, server_round),
                   "nodes": nodes, "t0": time.time()}
    conf = ConfigRecord({"server-round": server_round, "learning-rate": lr,
                         "num-clients": self.num_clients,
                         "keys": "server" if self.server_keys else "client"})
    if self.server_keys:
      conf["key-init"] = task.key_to_words(k_init)
      conf["key-clients"] = task.key_to_words(k_clients)
    content = RecordDict({"arrays": arrays, "config": conf})
    self._round["messages"] = [Message(content=content, message_type=MessageType.TRAIN,
                                       dst_node_id=n) for n in nodes]
    return self._round["messages"]

  def _parse(self, server_round: int, replies: list[Message]) -> tuple[list, list[dict]]:
    """``(usable [(partition, synthetic, radius, num_examples, epsilon, delta)], reports)``.

    ``delta`` is the client's model delta with ``server.start='fedavg_delta'``,
    else ``None``.
    """
    usable, reports, seen = [], [], set()
    replied = set()
    # The Grid gives the sent messages their ids; an error the SuperLink returns for an
    # unavailable node comes from the SuperLink and names the message it answers.
    destination = {m.metadata.message_id: m.metadata.dst_node_id
                   for m in self._round.get("messages", []) if m.metadata.message_id}
    for msg in replies:
      node = int(destination.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))
      replied.add(node)
      report = {"round": server_round, "node_id": node,
                "partition_id": self._partition_of.get(node)}
      if msg.has_error():
        report.update(status="error", reason=msg.error.reason, code=int(msg.error.code))
        reports.append(report)
        continue
      content = msg.content
      metrics = {k: v for rec in content.metric_records.values() for k, v in rec.items()}
      status = dict(content.config_records.get("status", {}))
      pid = metrics.get("partition-id")
      report.update(partition_id=pid, metrics=metrics, keys=status.get("keys"),
                    status=status.get("status", "ok"))
      if status.get("reason"):
        report["reason"] = status["reason"]
      if pid is not None:
        self._partition_of[node] = int(pid)
      if report["status"] == "ok":
        try:
          if not (isinstance(pid, int) and 0 <= pid < self.num_clients):
            raise ValueError(f"partition-id={pid!r} is not in [0, {self.num_clients - 1}]")
          if pid in seen:
            raise ValueError(f"a second reply for partition {pid}")
          synthetic = records.record_to_synthetic(content.array_records["synthetic"])
          radius = float(metrics["radius"])
          if not math.isfinite(radius) or radius <= 0:
            raise ValueError(f"radius={radius!r}")
          delta = None
          if self.with_deltas:
            if "delta" not in content.array_records:
              raise ValueError("no model delta; server.start='fedavg_delta' needs one from "
                               "every client")
            delta = records.record_to_delta(content.array_records["delta"], self._params)
        except (KeyError, ValueError) as e:
          report.update(status="invalid", reason=str(e))
        else:
          seen.add(pid)
          sent = [content.array_records["synthetic"]]
          if self.with_deltas:
            sent.append(content.array_records["delta"])
            report["upload_delta_bytes"] = records.raw_bytes(content.array_records["delta"])
          report["upload_bytes"] = sum(records.raw_bytes(r) for r in sent)
          report["upload_wire_bytes"] = sum(records.wire_bytes(r) for r in sent)
          usable.append((pid, synthetic, radius, metrics.get("num-examples"),
                         metrics.get("epsilon"), delta))
      reports.append(report)
    for node in self._round.get("nodes", []):
      if node not in replied:
        reports.append({"round": server_round, "node_id": node,
                        "partition_id": self._partition_of.get(node), "status": "missing",
                        "reason": f"no reply within round-timeout={self.round_timeout:g} s"})
    return sorted(usable, key=lambda u: u[0]), reports

  def aggregate_train(self, server_round: int, replies: Iterable[Message]
                      ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    usable, reports = self._parse(server_round, list(replies))
    self.run_log.add_reports(reports)
    by_status: dict[str, list] = {}
    for r in reports:
      by_status.setdefault(r["status"], []).append(r["partition_id"] if r["partition_id"]
                                                   is not None else f"node {r['node_id']}")
    for r in reports:
      if r["status"] != "ok":
        log(WARNING, "[fedlap] round %d: client %s (node %d) %s: %s", server_round,
            r["partition_id"], r["node_id"], r["status"], r.get("reason", ""))
    epsilons = {r["partition_id"]: r["metrics"]["epsilon"] for r in reports
                if "epsilon" in r.get("metrics", {})}
    base = {"round": server_round, "learning_rate": self._round["lr"],
            "clients_ok": [u[0] for u in usable],
            **{f"clients_{s}": v for s, v in by_status.items() if s != "ok"},
            "epsilon": max(epsilons.values()) if epsilons else None,
            "epsilon_per_client": {str(k): v for k, v in sorted(epsilons.items(),
                                                                key=lambda kv: str(kv[0]))},
            "model_bytes": self.model_bytes}
    if len(usable) < self.min_clients:
      msg = (f"round {server_round}: {len(usable)} usable client replies, fewer than "
             f"min-clients={self.min_clients} ({json.dumps({k: v for k, v in base.items() if k.startswith('clients_')})}); "
             f"the run stops. See {self.run_log.run_dir / 'client_reports.json'}")
      self.run_log.add_round({**base, "test_accuracy": math.nan, "test_loss": math.nan,
                              "stopped": msg,
                              "round_seconds": time.time() - self._round["t0"]})
      raise TooFewClients(msg)
    pids, sets, radii, sizes, _, deltas = zip(*usable)
    stacked = server_work.stack_synthetic(sets)
    weights = server_work.client_weights(self.fc.server.weighting, sizes)
    params, sm = server_work.server_update(
        self._round["k_server"], self.apply_fn, self._params, stacked, weights,
        np.asarray(radii), self._round["server_lr"], self.fc,
        deltas=server_work.stack_deltas(deltas) if self.with_deltas else None)
    loss, acc = self.evaluate(params)
    r_g = float(sm.radius)
    upload = sum(r.get("upload_bytes", 0) for r in reports)
    self.run_log.add_round({
        **base, "test_accuracy": acc, "test_loss": loss,
        "client_radius": {str(p): r for p, r in zip(pids, radii)},
        "server_radius": r_g if math.isfinite(r_g) else None,
        "server_epochs": int(sm.epochs), "server_steps": int(sm.steps),
        "upload_bytes": upload,
        "upload_wire_bytes": sum(r.get("upload_wire_bytes", 0) for r in reports),
        **({"upload_delta_bytes": sum(r.get("upload_delta_bytes", 0) for r in reports)}
           if self.with_deltas else {}),
        "round_seconds": time.time() - self._round["t0"]})
    metrics = MetricRecord({"test-accuracy": acc, "test-loss": loss,
                            "clients-ok": len(usable), "upload-bytes": upload})
    if base["epsilon"] is not None:
      metrics["epsilon"] = float(base["epsilon"])
    return records.params_to_record(params), metrics

  def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                         grid: Grid) -> Iterable[Message]:
    return []  # evaluation on the server's test split happens in aggregate_train

  def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                         ) -> MetricRecord | None:
    return None


class FedAvgBaseline(FedAvg):
  """Flower's FedAvg with the cosine learning rate and round keys in every round's config."""

  def __init__(self, *, cfg, evaluate, min_clients: int, round_timeout: float,
               join_timeout: float, run_log: RunLog, model_bytes: int):
    super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=min_clients,
                     min_available_nodes=min_clients)
    self.cfg = cfg
    self.evaluate = evaluate
    self.min_clients = min_clients
    self.round_timeout = round_timeout
    self.join_timeout = join_timeout
    self.run_log = run_log
    self.model_bytes = model_bytes
    self._chain = task.initial_chain_key(cfg.seed)
    self._t0 = time.time()
    self._nodes: list[int] = []

  def configure_train(self, server_round, arrays, config, grid):
    self._nodes = wait_for_nodes(grid, int(self.cfg.data.num_clients), self.min_clients,
                                 self.join_timeout, self.round_timeout)
    self._chain, _, k_clients, _ = task.round_keys(self._chain)
    config = ConfigRecord(dict(config))
    config["learning-rate"] = task.learning_rate(self.cfg, server_round)
    config["num-clients"] = int(self.cfg.data.num_clients)
    config["keys"] = "server"
    config["key-clients"] = task.key_to_words(k_clients)
    config["server-round"] = server_round
    self._t0 = time.time()
    record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
    return self._construct_messages(record, self._nodes, MessageType.TRAIN)

  def aggregate_train(self, server_round, replies):
    replies = list(replies)
    ok = [m for m in replies if not m.has_error()]
    reports = []
    for m in replies:
      r = {"round": server_round, "node_id": int(m.metadata.src_node_id)}
      if m.has_error():
        r.update(status="error", reason=m.error.reason)
      else:
        r.update(status="ok", partition_id=_metric(m.content, "partition-id"),
                 upload_bytes=records.raw_bytes(m.content.array_records["arrays"]))
      reports.append(r)
    self.run_log.add_reports(reports)
    if len(ok) < self.min_clients:
      raise TooFewClients(f"round {server_round}: {len(ok)} usable client replies, fewer than "
                          f"min-clients={self.min_clients}")
    arrays, metrics = super().aggregate_train(server_round, ok)
    loss, acc = self.evaluate(records.record_to_params(arrays))
    self.run_log.add_round({
        "round": server_round, "test_accuracy": acc, "test_loss": loss, "epsilon": None,
        "clients_ok": sorted(r["partition_id"] for r in reports if r["status"] == "ok"),
        "upload_bytes": sum(r.get("upload_bytes", 0) for r in reports),
        "model_bytes": self.model_bytes, "round_seconds": time.time() - self._t0})
    return arrays, metrics
