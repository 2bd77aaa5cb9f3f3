"""The ``ClientApp``: one client's partition, its privacy ledger and its round.

A train message runs, on this client only, one round of the run's registry method
(:mod:`fedlap_flower.method_work`: FedLAP and FedLAP-DP, FedSGD, FedAvg, FedProx, SCAFFOLD,
FedAdam, DP-FedAvg, DP-FedProx, FedDM, DSC, PSG), generic over it:

1. settings (:mod:`fedlap_flower.settings`), the client's run and data
   (:func:`fedlap_flower.task.client_run`, built as ``experiments.run`` builds a run:
   the library config, the DP mechanism with ``dp.target_epsilon`` calibrated at the
   named partition's smallest client, the model; cached per process). A client holding its
   own records (``data-path``) does not know the federation's client sizes: it refuses a
   ``dp.target_epsilon``;
2. its carried state, if the method has one (FedLAP's synthetic set, SCAFFOLD's ``c_k``):
   computed from its own records before its first round
   (:attr:`fedlap_jax.method.Method.client_init`), then kept in its state directory (its node
   config's ``state-dir``) under the federated run's identity, which a resumed run keeps
   (:mod:`fedlap_flower.federated_runs`). A round starts from the state after the last round
   whose server update took the client's reply, which the message names, so a client whose
   reply a round did not take -- its message lost, itself cut short, its reply lost or late --
   continues as one not drawn for it; missing, altered, of another round, or a round back
   before one it computed, the round is refused, before the ledger is touched;
3. under DP (the method's mechanism), in the client's state directory
   (:mod:`fedlap_flower.ledger`): refuse the round (reply ``status = refused`` with the
   reason) if the run's ``dp.delta`` exceeds the client's ``max-delta`` (default
   ``min(1e-5, 1 / N_k)``) or the epsilon after it would exceed the client's
   ``max-epsilon`` (with the epsilons), else record it first. The ledger composes the
   method's mechanism (:meth:`fedlap_jax.method.Method.mechanism`) at the client's own
   ``N_k``; its epsilon is the replace-one figure. Every key the client's step draws holds
   128 fresh bits of the operating system's entropy
   (:func:`fedlap_flower.ledger.fresh_round_key`) -- the server never learns them (unless
   the test-only unsafe mode is on *and* this client's environment consents), and no state
   on disk can make them repeat. What the server's message holds stays public: FedLAP-DP's
   DSA family key (which augmentations a round's matching uses, drawn before any record is
   read) is the message's, as in ``experiments.run``;
4. the method's client step (``experiments.run``'s client,
   :attr:`fedlap_jax.method.Method.client_step`) on the global parameters, the message, the
   client's own inputs (the server's, or its own keys under DP) and its carried state;
5. the reply: its update in the method's wire format (:meth:`fedlap_jax.method.Method.wire`:
   a model packed in ``"arrays"``; any other update as its named arrays in ``"update"``:
   FedLAP's synthetic set ``synthetic.x / .y / .mask``, ``r_k`` as ``radius`` and, with
   ``client.model_steps='noisy_real'``, the model delta ``model_delta.*``), and
   ``num-examples``, or under DP its epsilon, this run's part of it and DP steps only. Under
   DP FedLAP's model delta is post-processing: the client's model steps only along the
   round's released noisy gradients, starting from the public ``w_g``, so it is a function of
   released values and public state, and the ledger charges the same ``T`` noisy accesses per
   round as without it. Under DP nothing else leaves the client: no clip fractions, batch sizes, matching
   losses, record counts (``debug_nonprivate_stats``, experiments.run's switch for writing
   raw statistics locally, changes nothing here).

With ``data.clients_per_round = m < K`` a client takes part only in the
rounds the public participation seed draws it for
(:func:`fedlap_flower.task.participants`): asked in another round it refuses
before its ledger is touched, so it charges only the rounds it computes. The
``j``-th of the round's ``m`` clients takes slot ``j`` of the plan's own inputs
(:func:`fedlap_flower.task.key_slot`), as ``experiments.run`` does.

A query message asks for the client's ``partition-id`` (the server binds the
partition to this node, :mod:`fedlap_flower.binding`); the reply carries only
that.
"""

from __future__ import annotations

import contextlib
import functools
import math
from logging import WARNING

import jax
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from fedlap_flower import federated_runs, method_work, records, settings, task
from fedlap_flower import ledger as ledger_lib
from fedlap_flower.ledger import BudgetExceeded, ClientState
from fedlap_jax.checks import ConfigError
from fedlap_jax.method import ModelFns, Wire

app = ClientApp()


@functools.lru_cache(maxsize=4)
def _run(items: tuple, models: tuple) -> settings.RunSettings:
  """The run config ``items`` checked, with the ``models`` this node computes."""
  return settings.run_settings(dict(items), models)


def _run_of(context: Context) -> tuple[tuple, tuple]:
  """``(run items, allowed models)`` of a task: the run config and this node's own
  ``models`` (:func:`fedlap_flower.settings.allowed_models`)."""
  items = tuple(sorted(settings.with_defaults(context.run_config).items()))
  return items, settings.allowed_models(context.node_config)


@functools.lru_cache(maxsize=1)
def _named_plan(run_items: tuple, models: tuple):
  """The run's plan over the config's named data and partition (:func:`task.named_plan`:
  loaded and calibrated once per process and run, for every partition it serves; the
  dataset of one run at a time is kept)."""
  return task.named_plan(_run(run_items, models).cfg)


# A simulation worker serves many clients: keep every partition it met (all K of a run
# together hold the training set once, as experiments.run does).
@functools.lru_cache(maxsize=128)
def _setup(run_items: tuple, models: tuple, pid: int, num: int, data_path) -> task.ClientRun:
  """What a client process builds once per (run config, partition): the run's library config
  and (calibrated) DP mechanism, the model, the partition (:func:`task.client_run`)."""
  plan = None if data_path is not None else _named_plan(run_items, models)
  return task.client_run(_run(run_items, models).cfg, pid, num, data_path, plan=plan)


def _reply(msg: Message, metrics: dict, status: dict) -> Message:
  content = RecordDict({"metrics": MetricRecord(metrics), "status": ConfigRecord(status)})
  return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
  """One round of this client (see the module docstring).

  Computed in a worker thread while the process's main thread waits in short steps, so the
  handler Flower's ClientApp process installs for SIGTERM ends the process at once rather
  than after the round (:func:`fedlap_runs.termination.call_interruptibly`). The ledger is
  charged, atomically, before the round draws any noise: a round cut short stays charged.
  """
  from fedlap_runs import termination  # pylint: disable=g-import-not-at-top

  return termination.call_interruptibly(_train, msg, context)


def _train(msg: Message, context: Context) -> Message:
  task.enable_compilation_cache()
  run_items, models = _run_of(context)
  run = _run(run_items, models)
  node = settings.node_settings(context.node_config, run)
  setup = _setup(run_items, models, node.partition_id, node.num_partitions, node.data_path)
  conf = msg.content["config"]
  why = _round_refused(conf.get("server-round"), run)
  if why is not None:
    status = {"status": "refused", "reason": why, "keys": str(conf.get("keys", ""))[:20]}
    return _reply(msg, {"partition-id": node.partition_id}, status)
  return _train_method(msg, context, conf, run, node, setup)


@app.query()
def query(msg: Message, context: Context) -> Message:
  """This node's ``partition-id`` (its node config, checked against the run config)."""
  run = _run(*_run_of(context))
  node = settings.node_settings(context.node_config, run)
  return Message(
    content=RecordDict({"metrics": MetricRecord({"partition-id": node.partition_id})}), reply_to=msg
  )


def _round_refused(value, run) -> str | None:
  """Why this client refuses a train message's ``server-round`` (``None``: it does not): not an
  integer round of the run, ``1 .. rounds`` (a round beyond the run would also move the client's
  carried state past every real round, which it then refuses as a step back)."""
  rounds = int(run.cfg.rounds)
  ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= rounds
  if ok:
    return None
  return (
    f"server-round={repr(value)[:40]} is invalid; allowed: an integer round of this run, "
    f"1 to {rounds} (the run config's rounds)"
  )


def _not_drawn(run, node, server_round: int) -> str:
  return (
    f"partition {node.partition_id} is not among round {server_round}'s clients "
    f"{task.participants(run.cfg, server_round).tolist()} (data.clients_per_round="
    f"{run.cfg.data.get('clients_per_round')}, public data.participation_seed="
    f"{run.cfg.data.get('participation_seed', 0)}); allowed: the rounds it is drawn for"
  )


def _method_templates(method, config, params, facts):
  """``(message, own, carried)`` of one client of a round as ``jax.ShapeDtypeStruct`` leaves:
  the structures a server's message, own inputs and this client's kept state are read back
  against (:func:`fedlap_flower.method_work.arrays_to_tree`). Traced, not computed, once per
  (method, config, facts, parameter shapes): :func:`method_work.round_templates`."""
  leaves, treedef = jax.tree.flatten(jax.tree.map(method_work.shape_of, params))
  return method_work.round_templates(method, config, facts, treedef, tuple(leaves))


def _model_fns(model, image_shape) -> ModelFns:
  from fedlap_runs import method_entries  # pylint: disable=g-import-not-at-top

  return method_entries.model_fns(model, image_shape)


def _last_round(run, node, server_round: int) -> int | None:
  """The last round before ``server_round`` this client was drawn for (``None``: none)."""
  drawn = [r for r in range(1, server_round) if task.key_slot(run.cfg, r, node.partition_id)]
  return drawn[-1] if drawn else None


def _federated_run(state, conf, context, run) -> str:
  """The federated run this task's carried state belongs to: the ``federated-run`` the server
  sent, taken only as :func:`fedlap_flower.federated_runs.admit` takes it (32 hex digits, of
  this experiment, one per Flower run). Call it holding ``state.locked()``.

  Raises:
    fedlap_flower.federated_runs.RefusedRun: it is not taken (the reason).
  """
  digest = federated_runs.config_digest(run.cfg.to_dict())
  return federated_runs.admit(
    state, conf.get(federated_runs.MESSAGE_KEY), int(context.run_id), digest
  )


def _kept_state(state, run_key: str, server_round: int, delivered, prev, wire, what: str):
  """The round ``server_round`` of federated run ``run_key`` starts from and what this client
  kept after it: ``(start, arrays, None)``; ``(None, None, None)`` from its initial state;
  ``(None, None, why)`` refused.

  The start is ``delivered``, the last round whose server update took this client's reply, as
  the server's message says (:data:`fedlap_flower.federated_runs.DELIVERED_KEY`; 0: none, the
  initial state). That is ``prev``, its last drawn round before this one, unless the server
  has no reply of it since: the message never reached it, it was cut short (killed,
  restarted) mid-round, its reply was lost or late, or the server refused the round's
  update. The client then continues as one not drawn for those rounds, from the state the
  server's model has seen.

  Refused, never started afresh nor from a state the server did not take (a re-initialised
  SCAFFOLD variate or synthetic set would silently be another run's numbers): a round before
  one this client already computed in this run (a server cannot take a client back to its
  first round); a ``delivered`` that is not an integer before ``server_round``, or is before
  the one an earlier message of the run named (:func:`fedlap_flower.federated_runs.delivered`);
  its state missing, altered (:meth:`ClientState.load_carried`) or of another round. A round
  redone after a stop is the round after the server's last saved one, and starts from the
  state it started from.
  """
  held = state.carried_rounds(run_key)
  if held and held[-1] > server_round:
    why = (
      f"this client computed round {held[-1]} of federated run {run_key}; round "
      f"{server_round} would take its carried state ({what}) back before it (refused: a "
      "round starts from the state of the client's last round before it). Allowed: round "
      f"{held[-1]} or later"
    )
    return None, None, why
  key = federated_runs.DELIVERED_KEY
  ok = isinstance(delivered, int) and not isinstance(delivered, bool)
  if not ok or not 0 <= delivered < server_round:
    why = (
      f"{key}={repr(delivered)[:40]} is invalid; allowed: the last round before "
      f"{server_round} whose update took this client's reply, 0 to {server_round - 1}"
    )
    return None, None, why
  try:
    earlier = federated_runs.delivered(state, run_key)
  except federated_runs.RefusedRun as e:
    return None, None, str(e)
  if delivered < earlier:
    why = (
      f"{key}={delivered} is refused: an earlier message of federated run {run_key} said "
      f"round {earlier} took this client's reply, and a client's carried state ({what}) does "
      f"not go back before it. Allowed: {earlier} or later"
    )
    return None, None, why
  if delivered == 0:
    return None, None, None
  try:
    kept = state.load_carried(run_key, delivered, wire)
  except ConfigError as e:
    return None, None, str(e)
  if kept is None:
    rounds = f"the states of rounds {held}" if held else "none"
    why = (
      f"this client's carried state ({what}) after round {delivered} of federated run "
      f"{run_key}, whose update took its reply, is missing from its state-dir "
      f"{state.directory} (it holds {rounds}); refusing to start it afresh or from an older "
      "state (the method's numbers would silently differ). Allowed: the state directory as "
      "this client left it after its last round of this run"
    )
    return None, None, why
  federated_runs.record_delivered(state, run_key, delivered)
  if prev is not None and delivered < prev:
    log(
      WARNING,
      "[fedlap] round %d starts from this client's state after round %d, the last whose "
      "update took its reply: the server has none of round %d (the message never reached "
      "it, the client was cut short, or its reply was lost, late or refused)",
      server_round,
      delivered,
      prev,
    )
  return delivered, kept, None


def _keep_state(state, run_key: str, server_round: int, start, arrays) -> None:
  """Keeps the state after ``server_round``; drops those no later round starts from (all but
  this one, which the next round's update may take, and ``start``'s, from which a redo of
  ``server_round`` starts: no update of a round between them took this client's reply)."""
  state.save_carried(run_key, server_round, arrays)
  state.drop_carried(
    run_key, [r for r in state.carried_rounds(run_key) if r not in (start, server_round)]
  )


def _carried_state(
  method, config, setup, facts, node, state, run_key, conf, prev, server_round, template
):
  """This client's carried state for ``server_round`` and the round it starts from: what it
  kept after the last round whose update took its reply, as the server's message ``conf``
  says (:func:`_kept_state`), else (none yet; start ``None``) its slot of the method's init
  (:attr:`fedlap_jax.method.Method.client_init`, from its own records).
  ``(start, carried, None)`` or ``(None, None, why)``.
  """
  what = ", ".join(method.carried)
  wire = Wire.of(jax.tree.map(method_work.shape_of, template))
  delivered = conf.get(federated_runs.DELIVERED_KEY)
  start, kept, why = _kept_state(state, run_key, server_round, delivered, prev, wire, what)
  if why is not None:
    return None, None, why
  if kept is not None:
    return start, method_work.arrays_to_tree(kept, template), None
  carried, why = _initial_carried(method, config, setup, facts, node)
  return None, carried, why


def _initial_carried(method, config, setup, facts, node):
  """``(carried, None)``: this client's slot of the method's init
  (:attr:`fedlap_jax.method.Method.client_init`, from its own records and the run's public
  facts); ``(None, why)``: its records do not fit them."""
  try:
    carried = method.client_init(
      setup.k_alg, setup.model.params, setup.partition.data, config, facts, index=node.partition_id
    )
  except ConfigError as e:
    return None, f"this client cannot start its carried state ({', '.join(method.carried)}): {e}"
  return tuple(carried), None


def _train_method(msg, context, conf, run, node, setup) -> Message:
  """The run's registry method (:mod:`fedlap_flower.method_work`): its client step on the
  server's message, this client's own inputs and its carried state (kept in its state
  directory, :func:`_carried_state`); the reply is its update (its model packed in
  ``"arrays"``, any other update as its named arrays in ``"update"``). Under DP (the method's
  mechanism, :meth:`fedlap_jax.method.Method.mechanism`, calibrated by the run builder) the
  client charges its own ledger first and draws its keys from its own entropy."""
  method = method_work.method_of(run.cfg)
  config, params0, part = setup.plan.config, setup.model.params, setup.partition
  mechanism = setup.plan.mechanism
  dp = mechanism is not None
  keys = conf["keys"]
  server_round = int(conf["server-round"])
  metrics = {"partition-id": node.partition_id}

  def refuse(reason, **extra):
    return _reply(msg, {**metrics, **extra}, {"status": "refused", "reason": reason, "keys": keys})

  denied = _refused_before_state(run, node, mechanism, part, keys, server_round)
  if denied:
    return refuse(denied)
  try:
    facts = method_work.run_facts(
      run.cfg, setup.plan.facts, setup.model.num_params, run.max_classes_per_client
    )
  except ConfigError as e:
    return refuse(str(e))
  if setup.plan.facts.max_classes_per_client is None and run.max_classes_per_client:
    beyond = method_work.classes_beyond(part.data, facts)  # the stated value: its own records
    if beyond is not None:
      return refuse(beyond)
  message_t, own_t, carried_t = _method_templates(method, config, params0, facts)
  message = method_work.arrays_to_tree(records.record_to_arrays(msg.content["message"]), message_t)
  params = records.record_to_params(msg.content["arrays"], params0)
  carries = method.carries(config)  # a state kept from round to round
  state = ClientState(node.state_dir) if (dp or carries) else None
  with state.locked() if state is not None else contextlib.nullcontext():
    carried: tuple = ()
    run_key, from_round = None, None
    if method.carried and not carries:  # read for its fixed labels only: the initial slot
      carried, why = _initial_carried(method, config, setup, facts, node)
      if why is not None:
        return refuse(why)
    if carries:  # before the ledger: a round this client cannot compute costs nothing
      try:
        run_key = _federated_run(state, conf, context, run)
      except federated_runs.RefusedRun as e:
        return refuse(str(e))
      prev = _last_round(run, node, server_round)
      from_round, got, why = _carried_state(
        method, config, setup, facts, node, state, run_key, conf, prev, server_round, carried_t
      )
      if why is not None:
        return refuse(why)
      carried = got
    if dp:
      steps = mechanism.steps_per_round
      try:
        eps, run_eps = _charge(state, mechanism, part, node, steps, context, server_round, keys)
      except BudgetExceeded as e:
        return refuse(
          str(e),
          epsilon=e.epsilon,
          **{"epsilon-after": e.epsilon_after, "max-epsilon": e.max_epsilon},
        )
      metrics.update(
        {"epsilon": eps, "run-epsilon": run_eps, "max-epsilon": node.max_epsilon, "dp-steps": steps}
      )
    else:
      metrics["num-examples"] = part.num_records
    if keys == "server":
      own = method_work.arrays_to_tree(records.record_to_arrays(msg.content["own"]), own_t)
    else:  # 128 fresh bits of the operating system's entropy per key, never reused
      own = method_work.fresh_keys(own_t, ledger_lib.fresh_round_key)
    model = _model_fns(setup.model, part.image_shape)
    update, carried = method_work.client_fn(method, model, config)(
      own, method_work.with_model(message, params), carried, part.data
    )
    if carries:
      _keep_state(state, run_key, server_round, from_round, method_work.tree_to_arrays(carried))
  content = RecordDict(
    {"metrics": MetricRecord(metrics), "status": ConfigRecord({"status": "ok", "keys": keys})}
  )
  if method_work.is_model(update, params0):  # FedAvg's wire: the model, packed
    content["arrays"] = records.params_to_record(update)
  else:
    content["update"] = records.arrays_record(method_work.tree_to_arrays(update))
  return Message(content=content, reply_to=msg)


def _refused_before_state(run, node, mechanism, part, keys, server_round: int) -> str | None:
  """Why this client refuses a round before it reads its state or touches its ledger (``None``:
  it does not): a client with its own ``max-epsilon`` asked for a run without DP
  (``mechanism`` ``None``), server keys under DP without the client's consent, a round it is not
  drawn for (a client charges only the rounds it computes), or what :func:`_dp_denied` refuses."""
  dp = mechanism is not None
  if node.requires_dp and not dp:
    return (
      f"this client has its own max-epsilon and takes part in DP runs only; "
      f"method={run.cfg.method!r} with this run config is not private. Allowed: a DP config"
    )
  if dp and keys == "server" and not settings.unsafe_consent():
    return (
      f"the server sent round keys under DP (unsafe-dp-keys-from-server); this "
      f"client does not consent ({settings.UNSAFE_ENV} is not 1). Allowed: keys "
      "drawn from the client's own entropy"
    )
  if task.key_slot(run.cfg, server_round, node.partition_id) is None:
    return _not_drawn(run, node, server_round)
  return _dp_denied(mechanism, node, part) if dp else None


def _dp_denied(mechanism, node, part) -> str | None:
  """Why this client refuses a DP round before its ledger is touched (``None``: it does not)."""
  if not math.isfinite(node.max_epsilon):
    return (
      "no max-epsilon: set it in the node config (--node-config 'max-epsilon=E') "
      "or the run config; allowed: a finite epsilon this client will not exceed"
    )
  bound = node.delta_bound(part.num_records)
  if not mechanism.delta <= bound or not mechanism.delta < 1.0 / part.num_records:
    return (
      f"dp.delta={mechanism.delta!r} is refused by this client; allowed: "
      f"dp.delta <= max-delta={bound:g} (its node config's max-delta, default "
      f"min(1e-5, 1 / N_k)) and < 1 / N_k"
    )
  return None


def _charge(state, mechanism, part, node, steps, context, server_round, keys) -> tuple:
  """Records the round in this client's ledger (before any noise is drawn); ``(epsilon,
  run epsilon)``: the ledger's, every run it ever answered composed, and that of this Flower
  run's charged rounds alone (what a fresh ledger would show after them, which the server can
  bound without seeing the earlier runs).

  Raises:
    BudgetExceeded: the round would take it past ``max-epsilon``.
  """
  privacy = {
    **mechanism.ledger(part.num_records).privacy_fields(),
    "adjacency": mechanism.adjacency,
  }
  ledger = state.ledger(part.fingerprint, **privacy)
  run_id = int(context.run_id)
  eps = state.spend(
    ledger,
    part.fingerprint,
    steps,
    node.max_epsilon,
    {"run_id": run_id, "server_round": server_round, "keys": keys},
  )
  return eps, mechanism.epsilon_after(state.rounds_of_run(run_id), part.num_records)
