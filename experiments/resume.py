"""Resuming a run from its work dir: what must match, and the newest checkpoint that restores.

A run's checkpoint holds its state, its privacy ledger and two fingerprints:
:func:`privacy_fingerprint` (what the ledger's guarantee rests on: sigma, C, delta, B, T, q,
the data and its partition, the seed; under DP the computation, :func:`computation_fingerprint`)
and :func:`run_defining_fields` (every config field but :data:`RUNTIME_FIELDS`). A resume whose
fingerprints differ is refused (:func:`check_resume_compatible`; a field added since, one of
:data:`ADDED_FIELDS`, that a checkpoint lacks is the value its run had); a damaged checkpoint is set
aside and the next older one tried (:func:`restore_newest_valid`); :func:`restore` is the whole
step :func:`experiments.train.train_and_evaluate` takes before its first round.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jaxlib

from fedlap_jax import optim

from fedlap_runs import checkpointing
from fedlap_runs.configs import schema

# Fields that may change between an interrupted run and its resumption.
RUNTIME_FIELDS = (
  "checkpoint_every",
  "keep_checkpoints",
  "eval_chunk_size",
  "snapshot_rounds",
  "plots",
  "progress_bar",
  "client_backend",
  "data.cache_dir",
  "data.data_dir",
  "compilation_cache_dir",
  "debug_nonprivate_stats",
  "termination_grace_seconds",
)


def _added_fields() -> dict:
  """``{field: value}`` of the run-defining fields added after checkpoints were first
  written, with the value every run before them ran with (their defaults): a checkpoint's
  config without one of them matches a config that holds it at that value."""
  added: dict = {"baseline.server_lr": 1.0, "server.carry_state": False}
  for path in (
    "baseline.client_optimizer",
    "baseline.server_optimizer",
    "client.model_optimizer",
    "client.image_optimizer",
    "server.optimizer",
    "feddm.image_optimizer",
    "condense.image_optimizer",
  ):
    for k, v in schema.section(optim.Optimizer).to_dict().items():
      added[f"{path}.{k}"] = v
  return added


ADDED_FIELDS = _added_fields()
# Where damaged checkpoints are moved (never deleted).
DAMAGED_DIR = "damaged_checkpoints"


class ResumeError(ValueError):
  """The workdir holds a checkpoint of a different run, or no usable one (``fields``: the
  names of the fields that differ from it, where that is why)."""

  def __init__(self, message: str, fields: tuple[str, ...] | list[str] = ()):
    super().__init__(message)
    self.fields = list(fields)


def run_defining_fields(cfg) -> dict:
  """The resolved config as a flat ``{'a.b': value}`` dict without :data:`RUNTIME_FIELDS`."""
  flat = {}

  def walk(d, prefix):
    for k, v in d.items():
      name = f"{prefix}{k}"
      if isinstance(v, dict):
        walk(v, name + ".")
      elif name not in RUNTIME_FIELDS:
        flat[name] = list(v) if isinstance(v, tuple) else v

  walk(cfg.to_dict(), "")
  return flat


# The computation of a DP run's rounds (:func:`computation_fingerprint`).
COMPUTATION_FIELDS = (
  "client_backend",
  "platform",
  "device_count",
  "device_kind",
  "jax_version",
  "jaxlib_version",
  "xla_flags",
  "cpu_features",
)


def _cpu_features() -> str:
  """The host CPU's architecture and a digest of its instruction-set extensions (XLA's CPU
  code generator targets those it finds): ``/proc/cpuinfo``'s ``flags`` (``Features`` on
  ARM), else the processor's name."""
  flags = ""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.split(":")[0].strip() in ("flags", "Features"):
        flags = " ".join(sorted(line.split(":", 1)[1].split()))
        break
  except OSError:
    pass
  flags = flags or platform.processor()
  return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def computation_fingerprint(cfg) -> dict:
  """What decides a round's outputs besides its inputs and PRNG keys: the resolved
  ``client_backend``, the JAX platform (``cpu``, ``gpu``, ...), the device count and kind, the
  JAX and jaxlib versions, the XLA flags (``XLA_FLAGS`` and ``--xla`` arguments: they may
  change the last bits) and, on the CPU platform, the CPU's instruction set. A DP run's
  checkpoint holds it (:func:`privacy_fingerprint`)."""
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  xla_flags = [os.environ.get("XLA_FLAGS", ""), *(a for a in sys.argv if a.startswith("--xla"))]
  return {
    "client_backend": build.client_backend(cfg),
    "platform": jax.default_backend(),
    "device_count": len(devices),
    "device_kind": devices[0].device_kind,
    "jax_version": jax.__version__,
    "jaxlib_version": jaxlib.__version__,
    "xla_flags": " ".join(f for f in xla_flags if f),
    "cpu_features": _cpu_features() if jax.default_backend() == "cpu" else None,
  }


def privacy_fingerprint(cfg, alg, client_sizes) -> dict:
  """The fields a resumed run must share with its checkpoint for the ledger to hold.

  Under DP also its :func:`computation_fingerprint`: a round redone from a checkpoint repeats
  the checkpointed keys, and is the same mechanism invocation only if computed the same way.
  """
  dp = alg.dp
  smallest = int(min(client_sizes))
  per_round = cfg.data.get("clients_per_round")
  # Only when set, so checkpoints of runs without sampling keep their fingerprint.
  sampling = (
    {}
    if per_round is None
    else {
      "clients_per_round": int(per_round),
      "participation_seed": int(cfg.data.get("participation_seed", 0)),
    }
  )
  return {
    **sampling,
    **({} if dp is None else computation_fingerprint(cfg)),
    "method": cfg.method,
    "dp": dp is not None,
    "noise_multiplier": None if dp is None else float(dp.noise_multiplier),
    "l2_clip_norm": None if dp is None else float(dp.l2_clip_norm),
    "delta": None if dp is None else float(dp.delta),
    "batch_size": int(alg.batch_size),
    "steps_per_round": alg.dp_steps_per_round,
    "min_client_size": smallest,
    "sampling_rate": alg.batch_size / smallest,
    "client_sizes": [int(n) for n in client_sizes],
    "dataset": cfg.data.name,
    "source": cfg.data.source,
    "partition": cfg.data.partition,
    "dirichlet_alpha": float(cfg.data.dirichlet_alpha),
    "num_clients": int(cfg.data.num_clients),
    "train_fraction": float(cfg.data.train_fraction),
    "partition_seed": int(cfg.data.get("partition_seed", 0)),
    "seed": int(cfg.seed),
  }


def _diff(stored: dict, current: dict, was: str = "checkpoint") -> list[str]:
  keys = sorted(set(stored) | set(current))
  norm = lambda v: list(v) if isinstance(v, tuple) else v
  return [
    # The seed is secret: a message says that it differs, never what it is.
    "seed: another seed than the checkpoint's (not shown: it is secret)"
    if k == "seed"
    else f"{k}: {was} {stored.get(k)!r} vs now {current.get(k)!r}"
    for k in keys
    if norm(stored.get(k)) != norm(current.get(k))
  ]


def check_resume_compatible(meta: dict, privacy: dict, fields: dict, workdir) -> None:
  """Refuses to resume a checkpoint of a run with different privacy or run fields, or a DP
  run on another computation (:data:`COMPUTATION_FIELDS`)."""
  stored = meta.get("privacy", {})
  if privacy.get("dp"):
    was = {k: stored.get(k) for k in COMPUTATION_FIELDS}
    now = {k: privacy.get(k) for k in COMPUTATION_FIELDS}
    diff = _diff(was, now)
    if diff:
      raise ResumeError(
        f"refusing to resume the DP run in {workdir} on another computation "
        f"({'; '.join(diff)}): its redone rounds would repeat the checkpointed noise on a "
        "different computation, and two outputs under the same noise release their "
        "difference without noise. Allowed: resume where it ran (--config.client_backend="
        f"{was['client_backend']}, JAX platform {was['platform']!r} with "
        f"{was['device_count']} device(s) of kind {was['device_kind']!r}, e.g. "
        f"JAX_PLATFORMS={was['platform']} and CUDA_VISIBLE_DEVICES / --xla_force_host_"
        f"platform_device_count to pick the devices; jax {was['jax_version']}, jaxlib "
        f"{was['jaxlib_version']}, XLA_FLAGS={was['xla_flags']!r}, the same CPU), or a new "
        "--workdir",
        [d.split(":")[0] for d in diff],
      )
  diff = _diff(stored, privacy)
  if diff:
    raise ResumeError(
      f"refusing to resume {workdir}: its privacy-relevant fields differ from this config "
      f"({'; '.join(diff)}); the stored privacy ledger would no longer describe the run. "
      f"Allowed: the same values as the checkpointed run, or a new --workdir",
      [d.split(":")[0] for d in diff],
    )
  stored_config = meta.get("config", {})
  # A checkpoint written before a field existed ran with the field's ADDED_FIELDS value.
  if stored_config:
    stored_config = {**{k: v for k, v in ADDED_FIELDS.items() if k in fields}, **stored_config}
  diff = _diff(stored_config, fields)
  if diff:
    raise ResumeError(
      f"refusing to resume {workdir}: the config differs from the checkpointed run "
      f"({'; '.join(diff)}); a resumed run must equal an uninterrupted one. Allowed: the "
      f"same values (only {', '.join(RUNTIME_FIELDS)} may change), or a new --workdir",
      [d.split(":")[0] for d in diff],
    )


# Where a work dir keeps the fingerprint of the run its secret seed belongs to (not released:
# it names the machine's XLA flags and CPU).
FINGERPRINT_FILE = "run_fingerprint.json"


class SeedBindingError(ResumeError):
  """A run would reuse the secret seed of the work dir's run while differing from it in
  ``fields`` (the names of the fields that differ)."""


def _charged(workdir: Path) -> bool:
  """Whether ``privacy_ledger.json`` holds a charge (or cannot be read: it may)."""
  path = workdir / "privacy_ledger.json"
  if not path.exists():
    return False
  try:
    d = json.loads(path.read_text())
    return bool(d.get("rounds") or d.get("participants"))
  except (OSError, ValueError, AttributeError):
    return True


def check_seed_binding(workdir: Path, seed: int, privacy: dict, fields: dict) -> None:
  """Refuses a run that would reuse the secret seed of the run in ``workdir`` while differing
  from it; before it writes anything. A work dir with checkpoints is checked by the resume
  (:func:`check_resume_compatible`), one without by the fingerprint the run that drew its seed
  kept (:data:`FINGERPRINT_FILE`: :func:`privacy_fingerprint` and :func:`run_defining_fields`
  without the seed): the same seed keys the same noise, so a changed run released beside the
  first would release the difference of their outputs without noise.

  Only a DP run, or a work dir whose seed was drawn, is checked (a seed without DP is public).

  Raises:
    SeedBindingError: this run differs from the recorded one (``fields`` names what differs),
      or the work dir's ledger holds charges but no fingerprint says of which run.
  """
  from fedlap_runs import seeds  # pylint: disable=g-import-not-at-top

  stored, _ = seeds.stored_seed(workdir)
  if seeds.holds_checkpoints(workdir) or not (
    privacy.get("dp") or (stored or 0) >= seeds.DRAWN_MIN
  ):
    return
  allowed = (
    "Allowed: the same config on the same computation (to resume the run), or a new "
    "--workdir, which draws a new seed (docs/privacy.md, \"Starting over\")"
  )
  try:
    recorded = json.loads((workdir / FINGERPRINT_FILE).read_text())
  except FileNotFoundError:
    if _charged(workdir):
      raise SeedBindingError(
        f"refusing to run in {workdir}: its privacy_ledger.json holds charges but no "
        f"{FINGERPRINT_FILE} says of which run, so this run could reuse its seed on another "
        f"computation and its ledger would be reset. {allowed}",
        [FINGERPRINT_FILE],
      ) from None
    return
  except (OSError, ValueError) as e:
    raise SeedBindingError(
      f"refusing to run in {workdir}: its {FINGERPRINT_FILE} is unreadable ({e}). {allowed}",
      [FINGERPRINT_FILE],
    ) from None
  now = run_fingerprint(privacy, fields)
  names = set(now["config"])
  # A privacy field that is a config field too (noise_multiplier: dp.noise_multiplier) is
  # named once, by the config.
  covered = lambda k: any(n == k or n.endswith("." + k) for n in names)
  was = {
    **{k: v for k, v in recorded.get("privacy", {}).items() if not covered(k)},
    **recorded.get("config", {}),
  }
  is_ = {**{k: v for k, v in now["privacy"].items() if not covered(k)}, **now["config"]}
  diff = _diff(was, is_, "recorded")
  if stored != seed:
    diff.insert(0, "seed: another seed than the work dir's (not shown: it is secret)")
  if diff:
    raise SeedBindingError(
      f"refusing to run in {workdir}: it holds the run that drew its secret seed, and this "
      f"run differs from it ({'; '.join(diff)}); the same seed would draw the same noise for "
      "another computation, and the two runs' releases would give away their difference "
      f"without noise; nothing was written. {allowed}",
      [d.split(":")[0] for d in diff],
    )


def run_fingerprint(privacy: dict, fields: dict) -> dict:
  """What a DP work dir binds its seed to (:func:`check_seed_binding`): this run's
  :func:`privacy_fingerprint` and :func:`run_defining_fields`, without the seed."""
  return {
    "privacy": {k: v for k, v in privacy.items() if k != "seed"},
    "config": {k: v for k, v in fields.items() if k != "seed"},
  }


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return f"{type(e).__name__}: {text[:300]}"


def restore_newest_valid(
  ckpt: checkpointing.Checkpointer, template, *, privacy: dict, fields: dict, fresh_ledger, workdir
):
  """The newest checkpoint that restores completely, with its ledger.

  Checkpoints are tried newest first. One whose metadata or state cannot be
  read, whose state round differs from its name, or whose privacy ledger is
  inconsistent (:class:`~fedlap_jax.accounting.PrivacyLedger` recomputes every
  epsilon) or belongs to other privacy parameters is *damaged*: the next older
  one is tried. One that belongs to another run (:func:`check_resume_compatible`)
  is refused.

  Args:
    ckpt: the run's :class:`~fedlap_runs.checkpointing.Checkpointer`.
    template: the state before round 1 (structure, dtypes, key types).
    privacy, fields: this run's :func:`privacy_fingerprint` and :func:`run_defining_fields`.
    fresh_ledger: the run's empty :class:`~fedlap_jax.accounting.PrivacyLedger`
      (``None`` without DP).
    workdir: for messages.

  Returns:
    ``(round, state, ledger, damaged)``: ``(0, template, fresh_ledger, [])``
    when there is no checkpoint; ``damaged`` lists ``(round, reason)`` of the
    newer checkpoints that were skipped (the caller sets them aside).

  Raises:
    ResumeError: a checkpoint of another run, or checkpoints that are all damaged.
  """
  damaged = []
  for r in sorted(ckpt.all_rounds(), reverse=True):
    try:
      meta = ckpt.read_meta(r)
      missing = {"round", "ledger", "privacy", "config"} - set(meta)
      if missing:
        raise ValueError(f"its metadata lacks {sorted(missing)}")
    except Exception as e:  # pylint: disable=broad-except
      damaged.append((r, f"metadata unreadable: {_one_line(e)}"))
      continue
    check_resume_compatible(meta, privacy, fields, workdir)
    try:
      state, meta = ckpt.restore(template, r)
      held = int(state.round) if hasattr(state, "round") else r
      if held != r:
        raise ValueError(f"its state holds round {held}")
      ledger = None
      if fresh_ledger is not None:
        ledger = type(fresh_ledger).from_dict(meta["ledger"])
        if ledger.rounds != r:
          raise ValueError(f"its privacy ledger records {ledger.rounds} rounds")
        expected, stored = fresh_ledger.privacy_fields(), ledger.privacy_fields()
        if stored != expected:
          raise ValueError(f"its privacy ledger has parameters {stored}, this run {expected}")
    except Exception as e:  # pylint: disable=broad-except
      damaged.append((r, _one_line(e)))
      continue
    return r, state, ledger, damaged
  if damaged:
    raise ResumeError(
      f"refusing to resume {workdir}: every checkpoint is damaged ("
      + "; ".join(f"checkpoint {r}: {why}" for r, why in damaged)
      + "), so the privacy ledger of the rounds run so far cannot be restored; nothing was "
      "changed. Allowed: the undamaged checkpoints this run wrote, or a new --workdir (a new "
      "run with its own ledger)"
    )
  return 0, template, fresh_ledger, []


class Resumed(NamedTuple):
  """Where a run starts: after round ``start`` (0: a new run), from ``state`` and ``ledger``,
  with the ``records`` of ``metrics.jsonl`` and ``timing`` of the timing file up to it, and
  the ``moved`` damaged checkpoints ``(round, why, where)``."""

  start: int
  state: Any
  ledger: Any
  records: list
  timing: list
  moved: list


def restore(
  ckpt: checkpointing.Checkpointer,
  template,
  *,
  privacy: dict,
  fields: dict,
  fresh_ledger,
  workdir: Path,
  metrics_path: Path,
  timing_path: Path,
) -> Resumed:
  """The newest valid checkpoint (:func:`restore_newest_valid`) and the records up to it.

  Damaged checkpoints are moved to :data:`DAMAGED_DIR`; ``metrics.jsonl`` and the timing file
  are cut after the restored round (a redone round is written again).

  Raises:
    ResumeError: as :func:`restore_newest_valid`, or ``metrics.jsonl`` lacks a round up to the
      checkpoint's (nothing is changed then).
  """
  start, state, ledger, damaged = restore_newest_valid(
    ckpt, template, privacy=privacy, fields=fields, fresh_ledger=fresh_ledger, workdir=workdir
  )
  records = checkpointing.read_metrics(metrics_path)
  kept = [r for r in records if isinstance(r, dict) and r.get("round", 0) <= start]
  if [r.get("round") for r in kept] != list(range(1, start + 1)):
    raise ResumeError(
      f"{metrics_path} holds rounds {[r.get('round') for r in kept]} up to round {start}, "
      f"but the checkpoint is after round {start}; allowed: complete records 1..{start} "
      "(restore the file, or use a new --workdir); nothing was changed"
    )
  moved = [(r, why, ckpt.set_aside(r, workdir / DAMAGED_DIR)) for r, why in damaged]
  records = checkpointing.truncate_metrics(metrics_path, start)
  timing = checkpointing.truncate_metrics(timing_path, start)
  return Resumed(start, state, ledger, records, timing, moved)
