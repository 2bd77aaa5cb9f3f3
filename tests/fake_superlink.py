"""A fake SuperLink for the ServerApp Grid's object pulls: a reply as the SuperLink lists it,
a Runtime API client serving its objects on a schedule, and a PromptGrid over Flower's own HTTP
Grid pulls (used by the Flower security tests and ``benchmarks.flower_hostile --pulls-only``)."""

from __future__ import annotations

import time
import types


def reply_objects(reply_to: str, arrays: dict, node: int):
  """A reply as the SuperLink lists it (its proto without content, its object tree) and its
  objects by id."""
  from flwr.app import Array, ArrayRecord, Metadata, MetricRecord, RecordDict
  from flwr.app.message import make_message, remove_content_from_message
  from flwr.common.serde import message_to_proto
  from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

  content = RecordDict(
    {
      "update": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
      "metrics": MetricRecord({"partition-id": node}),
    }
  )
  meta = Metadata(
    run_id=1,
    message_id="",
    src_node_id=100 + node,
    dst_node_id=1,
    reply_to_message_id=reply_to,
    group_id="1",
    created_at=time.time(),
    ttl=600,
    message_type="train",
  )
  msg = make_message(meta, content)
  objects = {i: o.deflate() for i, o in get_all_nested_objects(msg).items()}
  msg.metadata.__dict__["_message_id"] = msg.object_id
  proto = message_to_proto(remove_content_from_message(msg))
  return proto, get_object_tree(msg), objects


class FakeSuperLink:
  """A Runtime API client of a SuperLink holding ``replies``; ``available(id, t)`` says whether
  object ``id`` is there ``t`` seconds after the first pull; ``pulled`` counts bytes by id."""

  def __init__(self, replies, available=lambda object_id, t: True, listed=()):
    self.replies, self.available, self.listed = replies, available, listed
    self.objects = {i: b for _, _, objs in replies for i, b in objs.items()}
    self.pulled: dict[str, int] = {}
    self.t0 = None

  def PullMessages(self, request):  # pylint: disable=invalid-name
    from flwr.proto.runtime_pb2 import PullAppMessagesResponse  # pylint: disable=no-name-in-module

    self.t0 = self.t0 or time.monotonic()
    t = time.monotonic() - self.t0
    listed = [r for i, r in enumerate(self.replies) if i >= len(self.listed) or t >= self.listed[i]]
    self.replies = [r for r in self.replies if all(r is not x for x in listed)]
    return PullAppMessagesResponse(
      messages_list=[p for p, _, _ in listed], message_object_trees=[t for _, t, _ in listed]
    )

  def PullObject(self, request):  # pylint: disable=invalid-name
    from flwr.proto.message_pb2 import PullObjectResponse  # pylint: disable=no-name-in-module

    i = request.object_id
    if not self.available(i, time.monotonic() - self.t0):
      return PullObjectResponse(object_found=True, object_available=False)
    self.pulled[i] = self.pulled.get(i, 0) + len(self.objects[i])
    return PullObjectResponse(
      object_found=True, object_available=True, object_content=self.objects[i]
    )

  def ConfirmMessageReceived(self, request):  # pylint: disable=invalid-name
    pass


def prompt_grid_over(superlink):
  """A :class:`fedlap_flower.prompt_grid.PromptGrid` over Flower's HTTP Grid whose Runtime API
  client is ``superlink`` (Flower's own pulls of the replies' objects)."""
  from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
  from flwr.superlink.grid.http_grid import HttpGrid

  grid = HttpGrid.__new__(HttpGrid)  # its pulls, with this client
  grid._run = types.SimpleNamespace(run_id=1)
  grid._client = superlink
  grid.node = Node(node_id=1)
  grid.push_messages = lambda messages: [f"m{i}" for i, _ in enumerate(messages)]
  from fedlap_flower.prompt_grid import PromptGrid

  return PromptGrid(grid, poll=0.05)


def over_http(superlink, chunk: int = 2**16, declare_length: bool = False):
  """Flower's Runtime API client (protobuf over ``httpx``) whose server is ``superlink``, each
  response body sent in ``chunk``-byte pieces (with its ``Content-Length`` if
  ``declare_length``); ``.sent`` counts the body bytes sent by object id."""
  import httpx
  from flwr.proto.message_pb2 import PullObjectRequest  # pylint: disable=no-name-in-module
  from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=no-name-in-module
  from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient

  sent: dict[str, int] = {}
  serve = {
    "/v1/runtime/pull-messages": (PullAppMessagesRequest, superlink.PullMessages),
    "/v1/runtime/pull-object": (PullObjectRequest, superlink.PullObject),
  }

  def handler(request):
    if request.url.path not in serve:  # ConfirmMessageReceived: an empty response
      return httpx.Response(200, content=b"")
    kind, call = serve[request.url.path]
    body = call(kind.FromString(request.content)).SerializeToString()
    key = getattr(kind.FromString(request.content), "object_id", "")

    def pieces():
      for start in range(0, len(body), chunk):
        sent[key] = sent.get(key, 0) + len(body[start : start + chunk])
        yield body[start : start + chunk]

    headers = {"content-length": str(len(body))} if declare_length else {}
    return httpx.Response(200, headers=headers, content=pieces())

  client = RuntimeHttpClient("http://superlink.invalid")
  client._client = httpx.Client(transport=httpx.MockTransport(handler))
  client.sent = sent
  return client
