"""The experiment loop: ``train_and_evaluate(config, workdir)``.

Method-agnostic: builds its run with :mod:`fedlap_runs.build` (the data, the method's
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
(:mod:`fedlap_runs.termination`). A round that finishes within
``termination_grace_seconds`` (default 20) of SIGTERM is written and
checkpointed as usual; one that does not is *abandoned*: nothing of it is
written but its ledger charge (``privacy_ledger.json``, atomically), the last
completed round's checkpoint stays the newest, and the run stops with
:class:`Terminated` (``experiments.run`` then exits with 143 at once, leaving
the worker to die with the process). Ctrl-C abandons a round in progress alike
(exit 130). Either way the last completed round is checkpointed first, if it was
not yet, and the next run redoes the abandoned round only.

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

The seed (:mod:`fedlap_runs.seeds`): a DP run without ``config.seed`` draws one from the
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

from experiments import outputs, resume

from fedlap_runs import build, checkpointing, library_configs, seeds
from fedlap_runs import export_cache, termination

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
      ``fedlap_runs/configs/default.py``).
    workdir: output directory (created); an existing checkpoint is resumed.
    config_name: label for logs and ``summary.md``.
    built: ``config``'s :class:`fedlap_runs.build.Plan` if made already (its data, library
      config and mechanism, for ``config`` as it is now); else :func:`fedlap_runs.build.plan`.

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
  workdir = _writable(Path(workdir))
  config_name = config_name or workdir.name
  t_start = time.time()
  cfg, seed = _seeded(config, workdir)
  setup = build.build_run(cfg, seed=seed.value, built=planned._replace(cfg=cfg))
  # With JAX's persistent cache on, the round's traced program is kept too: a warm run reads
  # it back instead of tracing it (fedlap_runs.export_cache).
  alg = export_cache.wrap(setup.algorithm, hint=hint)
  sizes = [len(i) for i in setup.client_indices]
  privacy = resume.privacy_fingerprint(cfg, alg, sizes)
  private = alg.dp is not None
  nonprivate_stats = private and bool(cfg.get("debug_nonprivate_stats", False))
  fields = resume.run_defining_fields(cfg)
  # A seed read back belongs to the run that drew it: another run is refused before any write.
  resume.check_seed_binding(workdir, seed.value, privacy, fields)
  fresh_ledger = _fresh_ledger(cfg, alg.mechanism, sizes) if private else None
  info = outputs.run_info(
    cfg,
    config_name,
    setup,
    privacy=privacy,
    mechanism=alg.mechanism,
    seed=seed,
    nonprivate_stats=nonprivate_stats,
  )

  # Resume from the newest valid checkpoint (damaged ones are set aside, never deleted).
  ckpt = checkpointing.Checkpointer(workdir / "checkpoints", keep=cfg.keep_checkpoints)
  try:
    restored = resume.restore(
      ckpt,
      setup.state,
      privacy=privacy,
      fields=fields,
      fresh_ledger=fresh_ledger,
      workdir=workdir,
      metrics_path=workdir / "metrics.jsonl",
      timing_path=workdir / outputs.TIMING_FILE,
    )
  except BaseException:
    ckpt.close()
    raise
  if private:  # before the seed is kept (config.json)
    fingerprint = resume.run_fingerprint(privacy, fields)
    checkpointing.write_json_atomic(workdir / resume.FINGERPRINT_FILE, fingerprint)
  checkpointing.write_json_atomic(workdir / "config.json", cfg.to_dict())
  checkpointing.write_json_atomic(workdir / "run_info.json", info)
  if restored.ledger is not None:
    checkpointing.write_json_atomic(workdir / "privacy_ledger.json", restored.ledger.to_dict())

  log = outputs.TrainLog(workdir / "train.log", config_name)
  outputs.log_start(
    log,
    cfg,
    info,
    start=restored.start,
    ledger=restored.ledger,
    moved=restored.moved,
    ckpt_dir=ckpt.directory,
    seed=seed,
    private=private,
  )
  bar = _progress_bar(cfg, restored.start, config_name)
  try:
    loop = _RoundLoop(
      cfg,
      setup,
      alg,
      workdir=workdir,
      restored=restored,
      ckpt=ckpt,
      log=log,
      checkpoint_meta={"privacy": privacy, "config": fields},
      nonprivate_stats=nonprivate_stats,
    )
    loop.run(bar)
  finally:
    bar.close()
    log.close()
    ckpt.close()

  if cfg.plots:
    from experiments import plots  # pylint: disable=g-import-not-at-top

    plots.make_all(workdir)
  outputs.write_summary(workdir, config_name, loop.records, info)
  return {
    "records": loop.records,
    "timing": loop.timing,
    "state": loop.state,
    "workdir": str(workdir),
    "ledger": loop.ledger.to_dict() if loop.ledger is not None else None,
    "compilations": loop.compiles.count,
    "seconds": time.time() - t_start,
  }


# ----------------------------------------------------------------------------
# The steps of a run's set-up.
# ----------------------------------------------------------------------------


def _writable(workdir: Path) -> Path:
  """``workdir``, once it (and its ``checkpoints/``, if there) is known to be writable.

  Raises:
    WorkdirError: it is a file, or cannot be created or written.
  """
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
  return workdir


def _seeded(config, workdir: Path):
  """``(cfg, seed)``: a copy of ``config`` with its resolved seed (:func:`fedlap_runs.seeds.resolve`:
  a DP run without one draws it, a re-run reads it back); the caller's config keeps its
  ``None`` seed (it may be run in another work dir)."""
  try:
    seed = seeds.resolve(config.get("seed"), private=bool(config.dp.enabled), workdir=workdir)
  except seeds.SeedError as e:
    raise resume.ResumeError(str(e)) from None
  cfg = copy.deepcopy(config)
  cfg.seed = seed.value
  return cfg, seed


def _fresh_ledger(cfg, mechanism: accounting.DpMechanism, sizes):
  """A DP run's empty ledger (:func:`new_ledger`), once a calibrated ``dp.target_epsilon``
  is known to be what ``cfg.rounds`` rounds spend on the smallest client (the one taking part
  in every round bounds every client's ledger)."""
  if cfg.dp.get("target_epsilon") is not None:  # calibrated by experiments.run
    epsilon_for = cfg.dp.get("epsilon_for", accounting.REPLACE_ONE)
    library_configs.check_target_epsilon(
      cfg, mechanism.epsilon_after(cfg.rounds, int(min(sizes)), adjacency=epsilon_for)
    )
  return new_ledger(mechanism, sizes, cfg.data.get("clients_per_round"))


def _test_evaluator(setup: build.Run, chunk_size: int):
  """The jitted ``(params, x, y) -> evaluation`` of the test split. The test set stays on the
  device as stored (uint8 for image datasets) and is normalised chunk by chunk inside it; it is
  read back from the export cache too (a warm run neither traces nor lowers it)."""
  to_inputs = functools.partial(
    normalise_pixels,
    pixel_scale=jnp.asarray(setup.dataset.pixel_scale),
    pixel_offset=jnp.asarray(setup.dataset.pixel_offset),
  )
  apply_fn = setup.apply_fn

  def evaluate_test_split(p, x, y):
    return evaluate(apply_fn, p, x, y, chunk_size=chunk_size, preprocess=to_inputs)

  return export_cache.wrap_program(jax.jit(evaluate_test_split))


def _progress_bar(cfg, start: int, label: str):
  """tqdm's bar of the rounds on stderr (``cfg.progress_bar`` off: a disabled one)."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(
    total=cfg.rounds,
    initial=start,
    desc=label,
    unit="round",
    disable=not cfg.progress_bar,
    file=sys.stderr,
    dynamic_ncols=True,
  )


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


class _RoundLoop:
  """The rounds ``start + 1 .. cfg.rounds`` of one run, and what they carry between rounds:
  the state, the ledger, the records and timing written, the last round checkpointed."""

  def __init__(
    self,
    cfg,
    setup: build.Run,
    alg,
    *,
    workdir: Path,
    restored: resume.Resumed,
    ckpt,
    log,
    checkpoint_meta: dict,
    nonprivate_stats: bool,
  ):
    self.cfg, self.alg, self.workdir, self.ckpt, self.log = cfg, alg, workdir, ckpt, log
    self.dataset, self.clients = setup.dataset, setup.clients
    self.start, self.state, self.ledger = restored.start, restored.state, restored.ledger
    self.records, self.timing = restored.records, restored.timing
    self.last_good = restored.start if restored.start else None
    self.meta = checkpoint_meta
    self.private = alg.dp is not None
    self.nonprivate_stats = nonprivate_stats
    self.num_clients = len(setup.client_indices)
    self.per_round = cfg.data.get("clients_per_round")
    self.participation_seed = cfg.data.get("participation_seed", 0)  # public; never cfg.seed
    self.sampled = build.samples_clients(cfg)
    self.eval_fn = _test_evaluator(setup, cfg.eval_chunk_size)
    self.x_test, self.y_test = jnp.asarray(self.dataset.x_test), jnp.asarray(self.dataset.y_test)
    taking_part = self.num_clients if self.per_round is None else self.per_round
    self.upload_mb = taking_part * alg.upload_floats_per_client * outputs.BYTES_PER_FLOAT / 1e6
    self.compiles = CompileCounter()

  def run(self, bar) -> None:
    """Every remaining round: computed in a worker thread while SIGTERM / Ctrl-C are watched,
    then charged, checked, written and (every ``checkpoint_every``) checkpointed."""
    cfg = self.cfg
    stop = termination.TermSignal()
    grace = float(cfg.get("termination_grace_seconds", DEFAULT_GRACE_SECONDS))
    snapshots = set(cfg.snapshot_rounds) | {cfg.rounds}
    wall_before = self.timing[-1]["wall_seconds"] if self.timing else 0.0
    t_loop = time.time()
    with stop:
      for m in range(self.start + 1, cfg.rounds + 1):
        t0 = time.time()
        idx = participation.sample_clients(
          self.participation_seed, m, self.num_clients, self.per_round
        )
        if m == self.start + 1:  # not in train.log: a resumed run's log reads as one run's
          self.log(outputs.compiling_line(m), kept=False)
        try:
          state, metrics, params, test_loss, test_acc = termination.wait_for(
            functools.partial(self._compute, m, idx, self.state), stop, grace_seconds=grace
          )
        except termination.Abandoned:
          why = (
            f"terminated by {stop.received} (not done within termination_grace_seconds={grace:g})"
          )
          raise Terminated(self._abandon(m, idx, why)) from None
        except KeyboardInterrupt:
          self._abandon(m, idx, "interrupted (Ctrl-C)")
          raise
        self.state = state
        epsilon = self._charge(m, idx)
        problems = outputs.find_non_finite(params, metrics, test_loss, len(idx), idx)
        if problems:
          where = self._last_good("the last good checkpoint is round {} in {}")
          msg = (
            f"round {m}: {'; '.join(problems)}. Stopped; {where} (with its privacy ledger); "
            f"metrics.jsonl holds rounds 1..{m - 1}. Try a smaller "
            "learning_rate or client.image_lr, or check the data."
          )
          self.log(f"ERROR {msg}", labelled=False)
          raise NonFiniteError(msg)
        now = time.time()
        rec = outputs.round_record(
          m,
          test_acc,
          test_loss,
          epsilon,
          self.ledger,
          metrics,
          idx,
          cfg=cfg,
          private=self.private,
          nonprivate_stats=self.nonprivate_stats,
          upload_mb=m * self.upload_mb,
        )
        times = {
          "round": m,
          "round_seconds": now - t0,
          "wall_seconds": wall_before + (now - t_loop),
          "first_in_process": m == self.start + 1,
        }
        # timing.jsonl first: metrics.jsonl decides resumes
        checkpointing.append_metrics(self.workdir / outputs.TIMING_FILE, times)
        checkpointing.append_metrics(self.workdir / "metrics.jsonl", rec)
        self.timing.append(times)
        self.records.append(rec)
        if m in snapshots:
          outputs.save_snapshot(self.workdir, m, self.state, self.dataset)
        if m % cfg.checkpoint_every == 0 or m == cfg.rounds or stop.received:
          self._checkpoint(m)
        bar.update(1)
        self.log(outputs.format_line(rec, cfg.rounds), seconds=times["round_seconds"])
        if stop.received:  # at the last round too: the plots and summary can wait
          msg = (
            f"terminated by {stop.received} after round {m}: checkpoint {m} saved in "
            f"{self.ckpt.directory}; run the same command again to resume"
          )
          self.log(msg)
          raise Terminated(msg)

  def _compute(self, m, idx, state):
    """Round ``m`` and its evaluation, in the worker thread of :func:`termination.wait_for`
    (it writes nothing: the main thread does)."""
    alg = self.alg
    with self.compiles:
      if self.sampled:  # only the sampled clients' block goes to the device
        state, metrics = participation.sampled_round(
          alg, state, participation.device_block(self.clients, idx), idx
        )
      else:
        state, metrics = alg.round(state, self.clients)
    params = alg.params_of(state)
    ev = self.eval_fn(params, self.x_test, self.y_test)
    test_loss, test_acc = float(ev.loss), float(ev.accuracy)
    jax.block_until_ready((state, metrics))
    return state, metrics, params, test_loss, test_acc

  def _charge(self, m, idx):
    """Composes round ``m``'s noisy accesses into the ledger and writes privacy_ledger.json
    (atomically); the round's epsilon, ``None`` without DP."""
    if self.ledger is None:
      return None
    epsilon = charge_round(self.ledger, self.alg.mechanism, idx)
    checkpointing.write_json_atomic(self.workdir / "privacy_ledger.json", self.ledger.to_dict())
    return epsilon

  def _checkpoint(self, m):
    """Saves the state after round ``m`` with its ledger and fingerprints."""
    ledger = self.ledger.to_dict() if self.ledger else None
    meta = {"round": m, "ledger": ledger, **self.meta, "metrics_records": m}
    self.ckpt.save(m, self.state, meta)
    self.last_good = m

  def _last_good(self, where: str) -> str:
    """``where`` filled with the last checkpointed round and its directory, or that none was
    written yet."""
    if self.last_good is None:
      return "no checkpoint was written yet"
    return where.format(self.last_good, self.ckpt.directory)

  def _abandon(self, m, idx, why) -> str:
    """Round ``m`` was left computing: checkpoint round ``m - 1`` if it is not yet (so a rerun
    redoes round ``m`` only), charge round ``m`` as spent (DP), say so; the message."""
    if m > 1 and self.last_good != m - 1:
      self._checkpoint(m - 1)  # the ledger before round m's charge, as the rerun expects
    epsilon = self._charge(m, idx)
    spent = (
      ""
      if epsilon is None
      else f"; its noisy accesses are charged to "
      f"privacy_ledger.json as spent (epsilon {epsilon:.3f})"
    )
    where = self._last_good("checkpoint {} in {} is the last one")
    msg = (
      f"{why} during round {m}: the round was abandoned{spent}; {where}; run the same "
      f"command again to redo round {m}"
    )
    self.log(msg)
    return msg


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
  ledger.record_round(mechanism.steps_per_round, participants=np.asarray(participants).tolist())
  return ledger.epsilon
