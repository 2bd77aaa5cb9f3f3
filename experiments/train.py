"""The experiment loop: ``train_and_evaluate(config, workdir)``.

Method-agnostic: builds its run with :mod:`experiments.build` (the data, the method's
library config and mechanism, the model, the keys and the
:class:`fedlap_jax.algorithm.FederatedAlgorithm`) and runs
its jitted ``round`` once per communication round (one compilation per run:
the round index lives in the state and is traced). With
``data.clients_per_round = m < K`` the clients' data stay on the host and each
round runs :func:`fedlap_jax.participation.sampled_round` on the block of the
``m`` clients :func:`~fedlap_jax.participation.sample_clients` draws from
the public ``(data.participation_seed, round)`` (never the secret ``seed``: the
participants are released). After every round it

1. evaluates the global model on the full test split (jitted once),
2. composes the round into the ledger of the method's mechanism
   (DP only; ``alg.mechanism``, a :class:`~fedlap_jax.accounting.DpMechanism`:
   ``T`` steps per round at ``q = B / min_k N_k``, one
   :class:`~fedlap_jax.accounting.PrivacyLedger`); with
   ``data.clients_per_round`` set, into each participating client's ledger
   instead (:class:`~fedlap_jax.accounting.ClientLedgers`, ``q_k = B / N_k``,
   only the rounds a client took part in), and the record's ``epsilon`` is the
   maximum over clients (``epsilon_clients``: min / median / max; ``clients``:
   the round's participants, the order of its per-client metrics). ``epsilon``
   is the replace-one figure (the guarantee that holds: client sizes and
   classes are released), ``epsilon_add_remove`` beside it the add/remove
   figure (the paper's notion, for comparison),
3. stops with :class:`NonFiniteError` if the parameters, a client's matching
   loss or the test loss are NaN / Inf (nothing of that round is written, the
   last good checkpoint stays the latest),
4. appends a record to ``metrics.jsonl`` and logs one line,
5. every ``checkpoint_every`` rounds (and at the last) saves an orbax
   checkpoint holding the state and the ledger.

Re-running with the same workdir resumes from the newest checkpoint: the
ledger is restored (never reset), records beyond the restored round are dropped
from ``metrics.jsonl`` and the rounds are re-run; the round's randomness comes
from the checkpointed key, so a re-run round reproduces the same outputs and
spends no extra privacy. A resume whose privacy-relevant fields (sigma, C,
delta, B, T, q, dataset, partition and its seed, clients, seed, under DP the
computation, ...) or any other
run-defining field differ from the checkpointed run is refused. A damaged
checkpoint (unreadable state or metadata, an inconsistent or edited ledger) is
moved to ``damaged_checkpoints/`` and the run falls back to the newest valid
one, with its ledger; if none is valid the resume is refused and nothing is
touched.

SIGTERM (schedulers kill about 30 s later): each round is computed in a worker
thread while the main thread waits on it with the signal handled
(:mod:`experiments.termination`). A round that finishes within
``termination_grace_seconds`` (default 20) of SIGTERM is written and
checkpointed as usual; one that does not is *abandoned*: nothing of it is
written but its ledger charge (``privacy_ledger.json``, atomically), the last
completed round's checkpoint stays the newest, and the run stops with
:class:`Terminated` (``experiments.run`` then exits with 143 at once, leaving
the worker to die with the process). Ctrl-C abandons a round in progress alike
(exit 130). Either way the next run redoes the round.

Why this is sound under DP: the abandoned round's noisy accesses happened
(the worker drew its Poisson batches and noise) though nothing of it was
released, so charging it over-counts: an upper bound. The redone round
is computed from the checkpointed state and PRNG key, i.e. with the same keys
on the same inputs by the same computation (the DP fingerprint below), so it
reproduces exactly the outputs the abandoned one would have released: one
mechanism invocation, not two. The resumed ledger is the checkpoint's, which
the redone round charges again, so the final ledger equals an uninterrupted
run's and every released output is covered exactly once. (Redoing a round
with fresh keys would be a new invocation to charge a second time; this loop
never does that.) The same holds for a round redone after SIGKILL.

A DP run's fingerprint also holds its computation: the resolved
``client_backend``, the JAX platform, device count and kind and the JAX
version (:func:`experiments.resume.computation_fingerprint`). A resume on another one is refused:
redone rounds would recompute already released outputs with the same noise on
a different computation, releasing their difference without noise.

What a DP run writes (the README's "Privacy guarantees and their
assumptions"): DP outputs (synthetic sets, the model), post-processing of them
(matching losses, trajectory lengths, server steps, test metrics), public
facts (config, client sizes and classes, normalisation constants) and the
ledger. Raw statistics of the clients' records (:attr:`LocalApproxMetrics.NONPRIVATE`,
:attr:`ClientMetrics.NONPRIVATE`) are written only with
``debug_nonprivate_stats=True``, under ``"nonprivate"`` in ``metrics.jsonl``.

The seed (:mod:`experiments.seeds`): a DP run without ``config.seed`` draws one from the
operating system's entropy (128 bits) and keeps it in ``config.json``; a re-run on the same
work dir reads it back. A given seed is guessable, and ``summary.md`` then says the outputs
are not private. Timing (``round_seconds``, ``wall_seconds``) goes to its own file,
:data:`experiments.outputs.TIMING_FILE`, never to the releasable ``metrics.jsonl``, ``train.log`` or
``summary.md`` (stdout shows each round's seconds); ``summary.md`` lists what may be released
(:data:`experiments.outputs.RELEASABLE`, ``SECRET``, ``NOT_COVERED``, as docs/privacy.md).

Outputs (in ``workdir``): ``config.json``, ``run_info.json``,
``metrics.jsonl``, ``timing.jsonl``, ``privacy_ledger.json`` (DP), ``train.log``,
``checkpoints/``, ``synthetic/round_XXXX.npz`` (FedLAP), the PNG plots of
:mod:`experiments.plots` and ``summary.md``.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import accounting, participation
from fedlap_jax.client_data import normalise_pixels
from fedlap_jax.training import evaluate

from experiments import build, checkpointing, faults, library_configs, outputs, resume, seeds
from experiments import export_cache, termination

# How long a round may go on after SIGTERM before it is abandoned (schedulers kill ~30 s after).
DEFAULT_GRACE_SECONDS = 20.0
# dp_accounting's per-order convergence warnings are filtered by fedlap_jax.accounting.


class CompileCounter:
  """Counts the programs built inside ``with counter:`` blocks (compiled by XLA, or read from
  the persistent compilation cache: JAX reports both as a compilation)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def _listener(self, event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == self.EVENT:
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


class NonFiniteError(RuntimeError):
  """A round produced NaN / Inf parameters, matching losses or test loss."""


class WorkdirError(ValueError):
  """The work dir is a file, or cannot be created or written."""


class Terminated(RuntimeError):
  """SIGTERM: the round in progress finished and was checkpointed, or it did not finish within
  the grace period and was abandoned (the last completed round's checkpoint stays)."""


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


def _without_seed(config) -> dict:
  """``config`` as a dict without its seed (a DP run's is secret; no program depends on it)."""
  return {k: v for k, v in config.to_dict().items() if k != "seed"}


def train_and_evaluate(
  config, workdir: str | os.PathLike, *, config_name: str = "", built: build.Plan | None = None
) -> dict:
  """Runs (or resumes) one experiment in ``workdir`` and writes every output.

  Args:
    config: the resolved ``ml_collections.ConfigDict`` (see
      ``experiments/configs/default.py``).
    workdir: output directory (created); an existing checkpoint is resumed.
    config_name: label for logs and ``summary.md``.
    built: ``config``'s :class:`experiments.build.Plan` if made already (its data, library
      config and mechanism, for ``config`` as it is now); else :func:`experiments.build.plan`.

  Returns:
    ``{'records': [...], 'state': final state, 'ledger': dict | None,
    'compilations': int, 'workdir': str}``; ``compilations`` is the number
    of programs the rounds of this call built (1 for a run, compiled by XLA or read
    from the persistent compilation cache; 0 when an earlier run of the same setting
    in this process built it already).

  Raises:
    library_configs.ConfigError: invalid config or config/data mismatch.
    WorkdirError: ``workdir`` is a file or cannot be written.
    resume.ResumeError: the workdir's checkpoint belongs to another run, or every
      checkpoint in it is damaged (nothing is changed then).
    NonFiniteError: a round produced NaN / Inf (the last good checkpoint is kept).
    Terminated: SIGTERM arrived; the round in progress finished and was checkpointed, or was
      abandoned after ``termination_grace_seconds`` (charged to the ledger as spent).
    KeyboardInterrupt: Ctrl-C; a round in progress is abandoned alike.
    data_lib.DataUnavailableError: tfds data missing and no network.
  """
  # A run of a config run before loads that run's round program (from the export cache and
  # JAX's) on a background thread while it sets up: its data, its state, its outputs.
  hint = export_cache.hint_of("experiments.train", _without_seed(config))
  export_cache.prefetch(hint)
  # The config's checks, its data, library config and mechanism.
  planned = build.plan(config) if built is None else built
  workdir = Path(workdir)
  try:
    checkpointing.check_writable(workdir)
    if (workdir / "checkpoints").is_dir():
      checkpointing.check_writable(workdir / "checkpoints")
  except OSError as e:
    raise WorkdirError(
      f"--workdir={str(workdir)!r} is invalid: {e}; allowed: a directory this "
      "process can create and write (new, or the work dir of this run to "
      "resume it)"
    ) from None
  config_name = config_name or workdir.name
  t_start = time.time()
  try:
    seed = seeds.resolve(config.get("seed"), private=bool(config.dp.enabled), workdir=workdir)
  except seeds.SeedError as e:
    raise resume.ResumeError(str(e)) from None
  cfg = copy.deepcopy(config)  # the caller's config keeps its None seed (another work dir)
  cfg.seed = seed.value

  setup = build.build_run(cfg, seed=seed.value, built=planned._replace(cfg=cfg))
  dataset, alg, state, clients = setup.dataset, setup.algorithm, setup.state, setup.clients
  # With JAX's persistent cache on, the round's traced program is kept too: a warm run reads
  # it back instead of tracing it (experiments.export_cache).
  alg = export_cache.wrap(alg, hint=hint)
  apply_fn = setup.apply_fn
  sizes = [len(i) for i in setup.client_indices]
  x_test, y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
  num_clients = len(sizes)
  privacy = resume.privacy_fingerprint(cfg, alg, sizes)
  fields = resume.run_defining_fields(cfg)
  private = alg.dp is not None
  nonprivate_stats = private and bool(cfg.get("debug_nonprivate_stats", False))
  per_round = cfg.data.get("clients_per_round")
  participation_seed = cfg.data.get("participation_seed", 0)  # public; never cfg.seed
  sampled = build.samples_clients(cfg)
  fresh_ledger = None
  mechanism = alg.mechanism
  if private:
    smallest = privacy["min_client_size"]
    fresh_ledger = new_ledger(mechanism, sizes, per_round)
    if cfg.dp.get("target_epsilon") is not None:  # calibrated by experiments.run
      # The smallest client taking part in every round bounds every client's ledger.
      epsilon_for = cfg.dp.get("epsilon_for", accounting.REPLACE_ONE)
      library_configs.check_target_epsilon(
        cfg, mechanism.epsilon_after(cfg.rounds, smallest, adjacency=epsilon_for)
      )
  info = outputs.run_info(
    cfg,
    config_name,
    setup,
    privacy=privacy,
    mechanism=mechanism,
    seed=seed,
    nonprivate_stats=nonprivate_stats,
  )

  # Resume from the newest valid checkpoint (damaged ones are set aside, never deleted).
  ckpt = checkpointing.Checkpointer(workdir / "checkpoints", keep=cfg.keep_checkpoints)
  metrics_path = workdir / "metrics.jsonl"
  timing_path = workdir / outputs.TIMING_FILE
  try:
    start, state, ledger, damaged = resume.restore_newest_valid(
      ckpt, state, privacy=privacy, fields=fields, fresh_ledger=fresh_ledger, workdir=workdir
    )
    records = checkpointing.read_metrics(metrics_path)
    kept = [r for r in records if isinstance(r, dict) and r.get("round", 0) <= start]
    if [r.get("round") for r in kept] != list(range(1, start + 1)):
      raise resume.ResumeError(
        f"{metrics_path} holds rounds {[r.get('round') for r in kept]} up to round {start}, "
        f"but the checkpoint is after round {start}; allowed: complete records 1..{start} "
        "(restore the file, or use a new --workdir); nothing was changed"
      )
    moved = [(r, why, ckpt.set_aside(r, workdir / resume.DAMAGED_DIR)) for r, why in damaged]
    records = checkpointing.truncate_metrics(metrics_path, start)
    timing = checkpointing.truncate_metrics(timing_path, start)
  except BaseException:
    ckpt.close()
    raise
  checkpointing.write_json_atomic(workdir / "config.json", cfg.to_dict())
  checkpointing.write_json_atomic(workdir / "run_info.json", info)
  if ledger is not None:
    checkpointing.write_json_atomic(workdir / "privacy_ledger.json", ledger.to_dict())

  # The test set stays on the device as stored (uint8 for image datasets) and is
  # normalised chunk by chunk inside the evaluation.
  to_inputs = functools.partial(
    normalise_pixels,
    pixel_scale=jnp.asarray(dataset.pixel_scale),
    pixel_offset=jnp.asarray(dataset.pixel_offset),
  )
  chunk_size = cfg.eval_chunk_size

  def evaluate_test_split(p, x, y):
    return evaluate(apply_fn, p, x, y, chunk_size=chunk_size, preprocess=to_inputs)

  # Read back from the export cache too (a warm run neither traces nor lowers it).
  eval_fn = export_cache.wrap_program(jax.jit(evaluate_test_split))
  log = outputs.RunLog(workdir / "train.log", config_name)
  outputs.log_start(
    log,
    cfg,
    info,
    start=start,
    ledger=ledger,
    moved=moved,
    ckpt_dir=ckpt.directory,
    seed=seed,
    private=private,
  )
  wall_before = timing[-1]["wall_seconds"] if timing else 0.0
  taking_part = num_clients if per_round is None else per_round
  upload_mb_per_round = taking_part * alg.upload_floats_per_client * outputs.BYTES_PER_FLOAT / 1e6
  snapshots = set(cfg.snapshot_rounds) | {cfg.rounds}
  t_loop = time.time()

  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  bar = tqdm(
    total=cfg.rounds,
    initial=start,
    desc=config_name,
    unit="round",
    disable=not cfg.progress_bar,
    file=sys.stderr,
    dynamic_ncols=True,
  )
  last_good = start if start else None
  round_compiles = CompileCounter()
  stop = termination.TermSignal()
  grace = float(cfg.get("termination_grace_seconds", DEFAULT_GRACE_SECONDS))

  def save_checkpoint(m):
    ckpt.save(
      m,
      state,
      {
        "round": m,
        "ledger": ledger.to_dict() if ledger else None,
        "privacy": privacy,
        "config": fields,
        "metrics_records": m,
      },
    )

  def compute_round(m, idx, state):
    """Round ``m`` and its evaluation, in the worker thread of :func:`termination.wait_for`
    (it writes nothing: the main thread does)."""
    with round_compiles:
      if sampled:  # only the sampled clients' block goes to the device
        state, metrics = participation.sampled_round(
          alg, state, participation.device_block(clients, idx), idx
        )
      else:
        state, metrics = alg.round(state, clients)
    params = alg.params_of(state)
    ev = eval_fn(params, x_test, y_test)
    test_loss, test_acc = float(ev.loss), float(ev.accuracy)
    jax.block_until_ready((state, metrics))
    faults.slow(m)
    return state, metrics, params, test_loss, test_acc

  def charge_ledger(m, idx):
    """Composes round ``m``'s noisy accesses into the ledger and writes privacy_ledger.json
    (atomically); the round's epsilon, ``None`` without DP."""
    epsilon = None if ledger is None else charge_round(ledger, mechanism, idx)
    if ledger is not None:
      checkpointing.write_json_atomic(
        workdir / "privacy_ledger.json", ledger.to_dict(), fault_round=m
      )
    return epsilon

  def interrupted(m, idx, why):
    """Round ``m`` was left computing: charge it as spent (DP), say so; the message."""
    epsilon = charge_ledger(m, idx)
    where = (
      f"checkpoint {last_good} in {ckpt.directory} is the last one"
      if last_good
      else "no checkpoint was written yet"
    )
    spent = (
      ""
      if epsilon is None
      else f"; its noisy accesses are charged to "
      f"privacy_ledger.json as spent (epsilon {epsilon:.3f})"
    )
    msg = (
      f"{why} during round {m}: the round was abandoned{spent}; {where}; run the same "
      f"command again to redo round {m}"
    )
    log(msg)
    return msg

  try:
    with stop:
      for m in range(start + 1, cfg.rounds + 1):
        t0 = time.time()
        idx = participation.sample_clients(participation_seed, m, num_clients, per_round)
        try:
          state, metrics, params, test_loss, test_acc = termination.wait_for(
            functools.partial(compute_round, m, idx, state), stop, grace_seconds=grace
          )
        except termination.Abandoned:
          raise Terminated(
            interrupted(
              m,
              idx,
              f"terminated by {stop.received} (not done within "
              f"termination_grace_seconds={grace:g})",
            )
          ) from None
        except KeyboardInterrupt:
          interrupted(m, idx, "interrupted (Ctrl-C)")
          raise
        faults.point("round", m)
        epsilon = charge_ledger(m, idx)
        problems = outputs.find_non_finite(params, metrics, test_loss, len(idx), idx)
        if problems:
          where = (
            f"the last good checkpoint is round {last_good} in {ckpt.directory}"
            if last_good is not None
            else "no checkpoint was written yet"
          )
          msg = (
            f"round {m}: {'; '.join(problems)}. Stopped; {where} (with its privacy "
            f"ledger); metrics.jsonl holds rounds 1..{m - 1}. Try a smaller learning_rate "
            f"or client.image_lr, or check the data."
          )
          log(f"ERROR {msg}", labelled=False)
          raise NonFiniteError(msg)
        now = time.time()
        rec = outputs.round_record(
          m,
          test_acc,
          test_loss,
          epsilon,
          ledger,
          metrics,
          idx,
          cfg=cfg,
          private=private,
          nonprivate_stats=nonprivate_stats,
          upload_mb=m * upload_mb_per_round,
        )
        times = {
          "round": m,
          "round_seconds": now - t0,
          "wall_seconds": wall_before + (now - t_loop),
          "first_in_process": m == start + 1,
        }
        checkpointing.append_metrics(timing_path, times)  # first: metrics.jsonl decides resumes
        checkpointing.append_metrics(metrics_path, rec)
        timing.append(times)
        records.append(rec)
        if m in snapshots:
          outputs.save_snapshot(workdir, m, state, dataset)
        if m % cfg.checkpoint_every == 0 or m == cfg.rounds or stop.received:
          save_checkpoint(m)
          last_good = m
        bar.update(1)
        log(outputs.format_line(rec, cfg.rounds), seconds=times["round_seconds"])
        if stop.received:  # at the last round too: the plots and summary can wait
          msg = (
            f"terminated by {stop.received} after round {m}: checkpoint {m} saved in "
            f"{ckpt.directory}; run the same command again to resume"
          )
          log(msg)
          raise Terminated(msg)
  finally:
    bar.close()
    log.close()
    ckpt.close()

  if cfg.plots:
    from experiments import plots  # pylint: disable=g-import-not-at-top

    plots.make_all(workdir)
  outputs.write_summary(workdir, config_name, records, info)
  return {
    "records": records,
    "timing": timing,
    "state": state,
    "workdir": str(workdir),
    "ledger": ledger.to_dict() if ledger is not None else None,
    "compilations": round_compiles.count,
    "seconds": time.time() - t_start,
  }


def new_ledger(mechanism: accounting.DpMechanism, client_sizes, clients_per_round: int | None):
  """The empty ledger a DP run keeps: with every client in every round one
  :class:`~fedlap_jax.accounting.PrivacyLedger` of the smallest client (its epsilon is the
  maximum over clients); with ``clients_per_round`` set one ledger per client
  (:class:`~fedlap_jax.accounting.ClientLedgers`), each charged only for its rounds."""
  if clients_per_round is not None:
    return mechanism.client_ledgers(client_sizes)
  return mechanism.ledger(int(min(client_sizes)))


def charge_round(ledger, mechanism: accounting.DpMechanism, participants) -> float:
  """Composes one round of ``mechanism`` (its ``T`` noisy steps) into ``ledger`` for the round's
  ``participants`` (client indices); returns the headline epsilon after it."""
  return ledger.record_round(
    mechanism.steps_per_round, participants=np.asarray(participants).tolist()
  )
