"""Helpers for the Flower tests: an in-process Grid, tiny configs, the reference run.

:class:`InProcessGrid` delivers the ServerApp's messages to the real
``ClientApp`` object in this process (one ``Context`` per node, as a SuperNode
keeps it), so the app's whole protocol runs in seconds without SuperLink,
SuperNodes or Ray; the engines themselves are tested with real processes in
``test_flower_engines.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid

# A 1-block ConvNet of width 8 and tiny loops: the tests check the protocol, not the learning.
SMALL_MODEL = "model.width=8 model.depth=1"
TINY = (
  f"rounds=2 {SMALL_MODEL} client.batch_loop=1 client.boost_loop=1 client.max_outer=1 "
  "client.calibration_epochs=2 client.dsa_strategy='' server.dsa_strategy='' "
  "server.max_epochs=2 eval_chunk_size=128"
)
NUM_CLIENTS = 5
# Client sampling: 20 clients of 70 digits each (iid), 5 a round, one synthetic image a class.
SAMPLED = (
  TINY + " data.num_clients=20 data.clients_per_round=5 data.partition=iid "
  "client.batch_size=16 client.ipc=1"
)


class InProcessGrid(Grid):
  """A Grid whose nodes are ``ClientApp`` calls in this process (see the module docstring).

  ``offline`` holds node ids that neither appear in ``get_node_ids`` nor answer;
  ``silent`` holds nodes that are listed but never answer (a crashed node).
  ``replies`` holds the train replies, ``query_replies`` the answers to the
  strategy's partition-id queries; ``node_infos`` (node id -> ``NodeInfo``)
  replaces what ``get_nodes`` reports for a node (its key, when it connected).
  """

  def __init__(self, client_app, run_config: dict, node_configs: dict[int, dict], run_id: int = 7):
    self.client_app = client_app
    self.contexts = {
      n: Context(
        run_id=run_id,
        node_id=n,
        node_config=dict(c),
        state=RecordDict(),
        run_config=dict(run_config),
      )
      for n, c in node_configs.items()
    }
    self.offline: set[int] = set()
    self.silent: set[int] = set()
    self.sent: list[Message] = []
    self.replies: list[Message] = []
    self.query_replies: list[Message] = []
    self.node_infos: dict = {}
    self._run = None

  def set_run(self, run) -> None:
    self._run = run

  @property
  def run(self):
    return self._run

  def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
    return Message(
      content=content,
      dst_node_id=dst_node_id,
      message_type=message_type,
      group_id=group_id,
      ttl=ttl,
    )

  def get_node_ids(self):
    return [n for n in self.contexts if n not in self.offline]

  def get_nodes(self):
    from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

    return [self.node_infos.get(n, NodeInfo(node_id=n)) for n in self.get_node_ids()]

  def push_messages(self, messages):
    raise NotImplementedError("the strategies use send_and_receive")

  def pull_messages(self, message_ids):
    raise NotImplementedError("the strategies use send_and_receive")

  def answer(self, msg):
    """The node's ClientApp's reply to ``msg`` (an error reply if it raises)."""
    try:
      return self.client_app(msg, self.contexts[msg.metadata.dst_node_id])
    except Exception as e:  # pylint: disable=broad-except  (as a SuperNode reports it)
      return Message(Error(code=2, reason=f"{type(e).__name__}: {e}"), reply_to=msg)

  def send_and_receive(self, messages, *, timeout=None):
    replies = []
    for msg in messages:
      self.sent.append(msg)
      node = msg.metadata.dst_node_id
      if node in self.offline or node in self.silent:
        continue
      replies.append(self.answer(msg))
    for reply in replies:
      is_query = reply.metadata.message_type == "query"
      (self.query_replies if is_query else self.replies).append(reply)
    return replies


@contextlib.contextmanager
def task_identity():
  """The process identity Flower's Message constructor expects (as the ServerApp process has)."""
  from flwr.supercore.task_identity import TaskIdentity

  old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
  TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
  try:
    yield
  finally:
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def node_configs(num: int = NUM_CLIENTS, *, state_root=None, **extra) -> dict[int, dict]:
  """Node ids 101.. -> ``partition-id`` / ``num-partitions`` (+ ``extra`` for every node);
  with ``state_root``, each node's own ``state-dir`` ``<state_root>/client-<k>``."""
  return {
    101 + k: {
      "partition-id": k,
      "num-partitions": num,
      **extra,
      **({} if state_root is None else {"state-dir": f"{state_root}/client-{k}"}),
    }
    for k in range(num)
  }


class ReplayGrid(InProcessGrid):
  """An :class:`InProcessGrid` whose nodes answer train messages with given contents.

  ``script`` maps node ids to the ``RecordDict`` each sends back (as a reply
  to the server's message of that round); nodes in ``silent`` or missing from
  ``script`` do not answer. ``first`` (a node id) puts that node's reply
  first. Query messages go to the real ClientApp.
  """

  def __init__(
    self,
    client_app,
    run_config: dict,
    node_configs: dict[int, dict],
    script: dict,
    first: int | None = None,
  ):
    super().__init__(client_app, run_config, node_configs)
    self.script = script
    self.first = first

  def send_and_receive(self, messages, *, timeout=None):
    messages = list(messages)
    if any(m.metadata.message_type == "query" for m in messages):
      return super().send_and_receive(messages, timeout=timeout)
    replies = []
    for msg in messages:
      self.sent.append(msg)
      node = msg.metadata.dst_node_id
      if node in self.silent or node not in self.script:
        continue
      reply = Message(content=self.script[node], reply_to=msg)
      replies.insert(0, reply) if node == self.first else replies.append(reply)
    self.replies.extend(replies)
    return replies


def serve_with(grid, run_config: dict) -> list[dict]:
  """Runs the ServerApp on ``grid`` in process; returns the per-round records.

  JAX's persistent compilation cache stays off (the ClientApp would turn it on
  for the whole test process). The server allows the user models its environment allows, as
  :func:`fedlap_flower.server_app.main` does.
  """
  from fedlap_flower import server_app, settings

  old = os.environ.get("FEDLAP_FLOWER_JAX_CACHE")
  os.environ["FEDLAP_FLOWER_JAX_CACHE"] = "off"
  try:
    with task_identity():
      return server_app.serve(grid, settings.run_settings(run_config, settings.allowed_models()))
  finally:
    if old is None:
      del os.environ["FEDLAP_FLOWER_JAX_CACHE"]
    else:
      os.environ["FEDLAP_FLOWER_JAX_CACHE"] = old


def run_inprocess(
  run_config: dict,
  nodes: dict[int, dict] | None = None,
  grid_hook=None,
  *,
  state_root=None,
  run_id: int = 7,
):
  """Runs the ServerApp against the ClientApp in process; returns ``(records, grid)``.

  Without ``nodes``, node ``k`` gets :func:`node_configs`, with ``state_root`` its own
  ``state-dir = <state_root>/client-<k>`` (the run config names no client directory).
  ``run_id``: the Flower run id the clients see (a resumed run is a new Flower run).
  """
  from fedlap_flower import client_app

  nodes = nodes or node_configs(state_root=state_root)
  grid = InProcessGrid(client_app.app, run_config, nodes, run_id=run_id)
  if grid_hook is not None:
    grid_hook(grid)
  return serve_with(grid, run_config), grid


def reference_result(config: str, overrides: str, workdir: Path, models=None) -> dict:
  """``experiments.run``'s result for the same config (no plots, no progress bar): its
  ``records`` and final ``state`` (:func:`experiments.train.train_and_evaluate`); ``models``:
  the models it may name (:func:`fedlap_flower.settings.load_config`; None: the catalog's)."""
  from experiments import train
  from fedlap_flower import settings

  cfg, label = settings.load_config(config, overrides, models)
  cfg.unlock()
  cfg.plots = False
  cfg.progress_bar = False
  return train.train_and_evaluate(cfg, workdir, config_name=label)


def reference_run(config: str, overrides: str, workdir: Path, models=None) -> list[dict]:
  """``experiments.run``'s records for the same config (no plots, no progress bar)."""
  return reference_result(config, overrides, workdir, models)["records"]


def read_jsonl(path: Path) -> list[dict]:
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
