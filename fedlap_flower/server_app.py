"""The ``ServerApp``: FedLAP / FedLAP-DP (or another federated registry method) for ``cfg.rounds`` rounds.

It builds the run exactly as ``experiments.run`` does (:mod:`fedlap_runs.build`: the
library config, the DP mechanism with ``dp.target_epsilon`` calibrated at the smallest
client of the named partition, the model and its initial parameters from ``key(seed)``,
the key chain), loads the config's test split (or the npz the server's
environment names, :data:`fedlap_flower.settings.SERVER_DATA_ENV`: a server reading its
own data knows no client sizes and refuses ``dp.target_epsilon``), and runs the strategy
(:mod:`fedlap_flower.strategy`) with ``strategy.start``. Outputs go to the run
config's ``run-dir`` (default ``runs/flower/<label>``, relative to the
directory the SuperLink was started in): ``metrics.jsonl``,
``client_reports.json``, ``run_info.json``, ``server_state.npz`` (after every
round), ``final_params.npz`` and ``done`` (at the end). A run-dir holding a
run's outputs is refused, unless the run config says ``resume = true``: the
server then continues that run (same config and overrides, not finished)
after its last completed round, from the parameters, key chain and pins of
``server_state.npz`` (:mod:`fedlap_flower.server_state`). The resumed run is
a new Flower run: each DP client's ledger charges the rounds it computes (a
round redone after a stop is charged again). It keeps the federated run's identity
(``run_info.json``'s ``federated_run``, drawn when the run started and sent with every train
message, :mod:`fedlap_flower.federated_runs`), under which each client keeps its carried
state (SCAFFOLD's ``c_k``, FedDM's / DSC's / PSG's synthetic set, FedLAP's images under
``synthetic_init='noise'``): a resumed round starts from what each client kept after its last
round, as in the run that was not stopped.
"""

from __future__ import annotations

import time
from logging import INFO

import numpy as np
from flax import traverse_util
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedlap_flower import (
  federated_runs,
  method_work,
  records,
  replies,
  server_state,
  server_work,
  settings,
  task,
)
from fedlap_flower import strategy as strategy_lib
from fedlap_flower.prompt_grid import PromptGrid

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
  """:func:`serve` in a worker thread, so that Flower's SIGTERM handler (in the main thread)
  ends the ServerApp process at once, not after the round's server training. The run log is
  on disk round by round (``metrics.jsonl`` lines, ``client_reports.json`` atomically).
  Replies are collected as they arrive, not on Flower's 3 s pulls."""
  from fedlap_runs import termination  # pylint: disable=g-import-not-at-top

  # the models the server's operator allows (its environment), never the run config's own
  run = settings.run_settings(context.run_config, settings.allowed_models())
  termination.call_interruptibly(serve, PromptGrid(grid), run)


def largest_pixel(test: task.TestSplit) -> float:
  """The largest ``|pixel|`` of the normalised test split (per-channel extremes, no copy)."""
  x = np.asarray(test.x)
  axes = tuple(range(x.ndim - 1))
  lo = x.min(axis=axes).astype(np.float64) * test.pixel_scale + test.pixel_offset
  hi = x.max(axis=axes).astype(np.float64) * test.pixel_scale + test.pixel_offset
  return float(np.max(np.abs(np.concatenate([np.ravel(lo), np.ravel(hi)]))))


def _resumed_identity(stopped: dict, run: settings.RunSettings, method, config) -> str:
  """The stopped run's federated identity (``run_info.json``), which the resumed run's clients
  find their carried state under; a run written without one gets a new one, unless its
  clients carry state (kept then per Flower run, which no resumed run can name).

  Raises:
    fedlap_flower.settings.SettingsError: naming ``resume``: such a run's clients carry state.
  """
  identity = stopped.get(federated_runs.RUN_INFO_KEY)
  if isinstance(identity, str) and federated_runs.IDENTITY.fullmatch(identity):
    return identity
  carried = method.carried if method.carries(config) else ()
  if carried:
    raise settings.SettingsError(
      "resume",
      True,
      "resume = false (a new run)",
      message=f"resume=true is invalid: run-dir={str(run.run_dir)!r} holds a run without "
      f"{federated_runs.RUN_INFO_KEY!r} in run_info.json (written before runs had one), "
      f"whose clients carry {', '.join(carried)} under its Flower run id, which a resumed "
      "run cannot name. Allowed: resume = false, a new run",
    )
  return federated_runs.new_identity()


def serve(grid: Grid, run: settings.RunSettings) -> list[dict]:
  """Runs the whole training; returns the per-round records (also in ``metrics.jsonl``).

  The run is built as ``experiments.run`` builds it (:func:`fedlap_flower.task.server_run`):
  its library config, its DP mechanism with ``dp.target_epsilon`` calibrated, the model and
  the key chain."""
  method = method_work.method_of(run.cfg)
  task.enable_compilation_cache()
  t0 = time.time()
  plan, start, test = task.server_run(run.cfg, settings.server_data(run.cfg))
  cfg = plan.cfg  # with the calibrated dp.noise_multiplier
  if plan.calibration is not None:
    log(INFO, plan.calibration)
  apply_fn, params = start.model.apply_fn, start.model.params
  # max-classes-per-client checked before the run-dir is written
  facts = method_work.run_facts(cfg, plan.facts, start.model.num_params, run.max_classes_per_client)
  evaluate = server_work.make_evaluate(apply_fn, test, cfg.eval_chunk_size)
  model_bytes = int(
    sum(np.asarray(v).nbytes for v in records.params_to_record(params).to_numpy_ndarrays())
  )
  # Under DP, every method's config allows only server.weighting='uniform' (Algorithm 3), so
  # the server never needs a DP client's record count N_k.
  info = {
    "config": run.config_name,
    "overrides": run.overrides,
    "label": run.label,
    "method": cfg.method,
    "dp": run.dp,
    "rounds": int(cfg.rounds),
    "num_clients": run.num_clients,
    "min_clients": run.min_clients,
    "round_timeout": run.round_timeout,
    "join_timeout": run.join_timeout,
    "model_bytes": model_bytes,
    "unsafe_dp_keys_from_server": run.unsafe_dp_keys_from_server,
    "clients_per_round": cfg.data.get("clients_per_round"),
    "participation_seed": int(cfg.data.get("participation_seed", 0)),
    "partition_keys": dict(run.partition_keys),
    "config_values": cfg.to_dict(),
    **({"calibration": plan.calibration} if plan.calibration is not None else {}),
  }
  stopped = None
  if run.resume:
    stopped = strategy_lib.RunLog.check_resumable(run.run_dir, info)
    info[federated_runs.RUN_INFO_KEY] = _resumed_identity(stopped, run, method, plan.config)
  else:
    info[federated_runs.RUN_INFO_KEY] = federated_runs.new_identity()
  shared = dict(
    cfg=cfg,
    evaluate=evaluate,
    min_clients=run.min_clients,
    round_timeout=run.round_timeout,
    join_timeout=run.join_timeout,
    model_bytes=model_bytes,
    template=params,
    partition_keys=run.partition_keys,
    federated_run=info[federated_runs.RUN_INFO_KEY],
  )
  max_image_abs = run.max_image_abs or replies.image_bound(largest_pixel(test))
  from fedlap_runs import method_entries  # pylint: disable=g-import-not-at-top

  shared.update(
    method=method,
    method_config=plan.config,
    facts=facts,
    model=method_entries.model_fns(start.model, test.image_shape),
    k_alg=start.k_alg,
    unsafe_dp_keys_from_server=run.unsafe_dp_keys_from_server,
    max_epsilon=run.max_epsilon,
    num_classes=test.num_classes,
    max_image_abs=max_image_abs,
  )
  # Built before the run-dir is written: what the method's wire refuses (a max-update-norm
  # that bounds nothing, a synthetic set no party can size) leaves no run behind.
  strategy = strategy_lib.MethodStrategy(
    **shared, max_classes_stated=run.max_classes_per_client, max_update_norm=run.max_update_norm
  )
  state = None
  if stopped is not None:
    state = server_state.load(run.run_dir, params)
    run_log = strategy_lib.RunLog.resume(run.run_dir, info, state.round if state else 0)
  else:
    run_log = strategy_lib.RunLog(run.run_dir, info)
  strategy.run_log = run_log
  if state is not None:
    strategy.restore(state)
    params = state.params
  result = strategy.start(
    grid=grid,
    initial_arrays=records.params_to_record(params),
    num_rounds=int(cfg.rounds) - strategy.rounds_done,
    timeout=run.round_timeout,
  )
  final = result.arrays if result.arrays is not None else records.params_to_record(params)
  np.savez(
    run.run_dir / "final_params.npz",
    **{
      k.replace("/", "."): np.asarray(v)
      for k, v in traverse_util.flatten_dict(
        records.record_to_params(final, params), sep="/"
      ).items()
    },
  )
  (run.run_dir / "done").write_text(f"{time.time() - t0:.1f} s\n")
  return run_log.records
