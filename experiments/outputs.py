"""What a run writes and logs besides its checkpoints: round summaries, the log line, the
synthetic snapshots, ``run_info.json`` and ``summary.md``, and what a DP work dir may release.

:func:`summarize_metrics` turns a round's metrics pytree into the JSON record of
``metrics.jsonl`` (split by what may be released: the library declares raw statistics of the
clients' records ``NONPRIVATE``); :func:`find_non_finite` lists what went NaN / Inf;
:func:`format_line` is the round's log line; :func:`save_snapshot` writes the synthetic sets;
:func:`write_summary` writes ``summary.md`` with the release lists (:data:`RELEASABLE`,
:data:`SECRET`, :data:`NOT_COVERED`, as docs/privacy.md).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax.federated import RoundMetrics

from experiments import seeds
from experiments.resume import DAMAGED_DIR

BYTES_PER_FLOAT = 4
# The section of a metrics record that holds raw statistics of the clients' records.
NONPRIVATE_SECTION = "nonprivate"
# A round's timing (it depends on the round's Poisson draws, so it is not covered by the
# guarantee): its own file, beside the releasable metrics.jsonl.
TIMING_FILE = "timing.jsonl"
TIMING_FIELDS = ("round_seconds", "wall_seconds", "first_in_process")
# What a DP run's work dir holds, by what may be released (docs/privacy.md, "A DP run's work
# dir"; summary.md lists the same): DP outputs, their post-processing and public facts;
# what determines every noise draw; what the guarantee does not cover.
RELEASABLE = (
  "synthetic/",
  "metrics.jsonl",
  "privacy_ledger.json",
  "run_info.json",
  "summary.md",
  "train.log",
  "the plots (*.png)",
  "config.json without its seed",
)
SECRET = ("the seed in config.json", "checkpoints/", f"{DAMAGED_DIR}/")
NOT_COVERED = (TIMING_FILE, "audit/")


def _keystr(path) -> str:
  return (
    jax.tree_util.keystr(path)
    .replace("'", "")
    .replace("[", ".")
    .replace("]", "")
    .replace("..", ".")
    .strip(".")
  )


def _finite_list(a) -> list:
  return [None if not math.isfinite(v) else v for v in np.asarray(a, np.float64).ravel().tolist()]


def _nonprivate_names(metrics: Any, prefix: str = "") -> set[str]:
  """Dotted names of the metrics that NamedTuples declare ``NONPRIVATE``."""
  names = set()
  if isinstance(metrics, tuple) and hasattr(metrics, "_fields"):
    declared = getattr(type(metrics), "NONPRIVATE", ())
    for f in metrics._fields:
      if f in declared:
        names.add(prefix + f)
      else:
        names |= _nonprivate_names(getattr(metrics, f), f"{prefix}{f}.")
  return names


def summarize_metrics(
  metrics: Any, num_clients: int, *, private: bool = False
) -> tuple[dict, dict]:
  """JSON-ready summary of a round's metrics pytree, split by what may be released.

  For FedLAP (:class:`~fedlap_jax.federated.RoundMetrics`): per-client radius
  ``r_k``, mean and last matching loss over the executed while-loop
  iterations, real accesses, clip fraction, mean batch size and extra Poisson
  chunks; the server's radius ``r_g`` (``None`` for ``fixed``), epochs and
  steps. Other algorithms: every leaf, per client where it has a leading
  ``(K,)`` axis.

  Args:
    private: a DP run: the metrics the library declares ``NONPRIVATE`` (raw
      statistics of the clients' records) go to the second dict.

  Returns:
    ``(released, nonprivate)``; ``nonprivate`` is empty unless ``private``.
  """
  out = _summarize(metrics, num_clients)
  if not private:
    return out, {}
  # FedLAP's summary names its client metrics without the "client." prefix.
  names = (
    set(type(metrics.client).NONPRIVATE)
    if isinstance(metrics, RoundMetrics)
    else _nonprivate_names(metrics)
  )
  return (
    {k: v for k, v in out.items() if k not in names},
    {k: v for k, v in out.items() if k in names},
  )


def _summarize(metrics: Any, num_clients: int) -> dict:
  out: dict[str, Any] = {}
  if isinstance(metrics, RoundMetrics):
    cm = metrics.client
    loss = np.asarray(cm.matching_loss, np.float64)  # (K, R_i, O, B, R_b)
    outer = np.asarray(cm.outer_iterations)  # (K, R_i)
    ran = np.arange(loss.shape[2])[None, None, :] < outer[:, :, None]
    ran = np.broadcast_to(ran[..., None, None], loss.shape)
    count = np.maximum(ran.reshape(num_clients, -1).sum(1), 1)
    out["matching_loss"] = _finite_list(
      np.where(ran, loss, 0).reshape(num_clients, -1).sum(1) / count
    )
    last = []
    for k in range(num_clients):
      i, o = loss.shape[1] - 1, int(outer[k, -1]) - 1
      last.append(loss[k, i, o, -1, -1] if o >= 0 else float("nan"))
    out["matching_loss_last"] = _finite_list(last)
    out["client_radius"] = _finite_list(metrics.client_radius)
    r_g = float(metrics.server.radius)
    out["server_radius"] = r_g if math.isfinite(r_g) else None
    out["server_epochs"] = int(metrics.server.epochs)
    out["server_steps"] = int(metrics.server.steps)
    out["server_distance"] = float(metrics.server.distance)
    out["learning_rate"] = float(metrics.learning_rate)
    out["outer_iterations"] = np.asarray(cm.outer_iterations).mean(axis=1).tolist()
    out["real_accesses"] = np.asarray(cm.real_accesses).tolist()
    out["clip_fraction"] = _finite_list(cm.clip_fraction)
    out["mean_batch_size"] = _finite_list(cm.mean_batch_size)
    out["poisson_extra_chunks"] = np.asarray(cm.poisson_extra_chunks).tolist()
    return out
  for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]:
    a = np.asarray(leaf)
    name = _keystr(path) or "value"
    if a.ndim == 0:
      out[name] = _finite_list(a)[0]
    elif a.shape[0] == num_clients:
      out[name] = _finite_list(a.reshape(num_clients, -1).mean(axis=1))
    elif a.size <= 64:
      out[name] = _finite_list(a)
  return out


def find_non_finite(
  params, metrics, test_loss: float, num_clients: int, client_ids=None
) -> list[str]:
  """Descriptions of every non-finite quantity of a round ("" list if all finite).

  ``num_clients``: the clients of the round (the leading axis of per-client
  metrics); ``client_ids``: their indices among all clients (sampled rounds),
  default ``0..num_clients - 1``.
  """
  ids = list(range(num_clients)) if client_ids is None else [int(i) for i in client_ids]
  problems = []
  if isinstance(metrics, RoundMetrics):
    loss = np.asarray(metrics.client.matching_loss).reshape(num_clients, -1)
    for k in np.flatnonzero(~np.isfinite(loss).all(axis=1)):
      problems.append(f"matching loss of client {ids[k]} is {loss[k][~np.isfinite(loss[k])][0]}")
    r = np.asarray(metrics.client_radius)
    for k in np.flatnonzero(~np.isfinite(r)):
      problems.append(f"radius of client {ids[k]} is {r[k]}")
  else:
    for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]:
      a = np.asarray(leaf)
      if not np.issubdtype(a.dtype, np.floating) or np.isfinite(a).all():
        continue
      if a.ndim >= 1 and a.shape[0] == num_clients:
        bad = np.flatnonzero(~np.isfinite(a.reshape(num_clients, -1)).all(axis=1))
        problems.append(
          f"metric {_keystr(path)} of client(s) {[ids[k] for k in bad]} is not finite"
        )
      else:
        problems.append(f"metric {_keystr(path)} is not finite")
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not bool(jnp.all(jnp.isfinite(leaf))):
      problems.append(f"global parameter {_keystr(path)} holds NaN/Inf")
  if not math.isfinite(test_loss):
    problems.append(f"test loss is {test_loss}")
  return problems


def format_line(rec: dict, rounds: int) -> str:
  parts = [
    f"round {rec['round']:>3d}/{rounds}",
    f"acc {rec['test_accuracy']:.4f}",
    f"loss {rec['test_loss']:.4f}",
  ]
  if rec.get("epsilon") is not None:
    parts.append(f"eps {rec['epsilon']:.3f}")
  if "client_radius" in rec:
    radii = [r for r in rec["client_radius"] if r is not None]
    r_g = rec.get("server_radius")
    parts.append(
      f"radius {'fixed' if r_g is None else f'{r_g:.3f}'}"
      + (f" (r_k {min(radii):.2f}..{max(radii):.2f})" if radii else "")
    )
  if "server_steps" in rec:
    parts.append(f"server_steps {rec['server_steps']}")
  if "matching_loss" in rec:
    ml = [v for v in rec["matching_loss"] if v is not None]
    if ml:
      parts.append(f"match {np.mean(ml):.3f}")
  return "  ".join(parts)


def save_snapshot(workdir: Path, round_index: int, state, dataset) -> None:
  """Writes the synthetic sets of all clients (if the state has them) to ``synthetic/``."""
  synthetic = getattr(state, "synthetic", None)
  if synthetic is None:
    return
  out = workdir / "synthetic"
  out.mkdir(exist_ok=True)
  path = out / f"round_{round_index:04d}.npz"
  tmp = out / f".round_{round_index:04d}.tmp.npz"
  np.savez(
    tmp,
    x=np.asarray(synthetic.x),
    y=np.asarray(synthetic.y),
    mask=np.asarray(synthetic.mask),
    mean=dataset.mean,
    std=dataset.std,
    round=round_index,
  )
  os.replace(tmp, path)


def release_lines(info: dict, *, nonprivate_stats: bool) -> list[str]:
  """What ``summary.md`` says about releasing a DP run's work dir: the lists of
  :data:`RELEASABLE`, :data:`SECRET` and :data:`NOT_COVERED` (docs/privacy.md holds the same),
  unless the seed was given or raw statistics were written, which make nothing private."""
  lines = []
  if info.get("seed_origin") != seeds.DRAWN:
    lines.append(
      "- NOT PRIVATE: the seed was given (--config.seed), and a given seed is guessable: "
      "these outputs reproduce a run and may not be published as private (leave --config.seed "
      "out to draw one from the operating system's entropy)"
    )
  if nonprivate_stats:
    lines.append(
      f"- WARNING: metrics.jsonl holds non-private statistics of the clients' records "
      f"(section \"{NONPRIVATE_SECTION}\", debug_nonprivate_stats=True), outside the "
      "privacy guarantee: do not release it"
    )
  lines += [
    f"- releasable under the privacy guarantee{' (had the seed been drawn)' if lines else ''}: "
    + ", ".join(RELEASABLE),
    "- secret (they determine every noise draw): " + ", ".join(SECRET),
    "- not covered by the guarantee (do not release): " + ", ".join(NOT_COVERED),
  ]
  return lines


def write_summary(workdir: Path, config_name: str, records: list[dict], info: dict) -> None:
  """A short ``summary.md``: setting, final and best accuracy, epsilon, cost, what may be
  released, files. Timing is named (:data:`TIMING_FILE`), not quoted: the guarantee does not
  cover it."""
  lines = [f"# {config_name}: {info['method_label']} on {info['dataset']}", ""]
  notes = []
  norm = info.get("normalisation")
  if norm:
    notes.append(f"- normalisation: {norm['source']} (mean {norm['mean']}, std {norm['std']})")
  if info.get("delta") is not None:
    notes += release_lines(info, nonprivate_stats=any(NONPRIVATE_SECTION in r for r in records))
  if records:
    last = records[-1]
    best = max(records, key=lambda r: r["test_accuracy"])
    lines += [
      f"- rounds run: {last['round']} / {info['rounds']}",
      f"- final test accuracy: {100 * last['test_accuracy']:.2f} % (loss {last['test_loss']:.4f})",
      f"- best test accuracy: {100 * best['test_accuracy']:.2f} % (round {best['round']})",
    ]
    if last.get("epsilon") is not None:
      lines.append(
        f"- privacy: epsilon = {last['epsilon']:.3f} at delta = {info['delta']:g}, "
        "replace-one neighbours given the public client sizes and classes (the "
        f"guarantee; sigma = {info['noise_multiplier']}, C = {info['l2_clip_norm']}, "
        f"B = {info['batch_size']}, T = {info['steps_per_round']}, "
        f"q = {info['sampling_rate']:.4f})"
      )
      if last.get("epsilon_add_remove") is not None:
        lines.append(
          f"- for comparison, the add/remove-one epsilon (the paper's notion): "
          f"{last['epsilon_add_remove']:.3f}"
          + (
            " (dp.target_epsilon calibrated this figure)"
            if info.get("epsilon_for") == "add_remove"
            else ""
          )
        )
    lines += notes + [
      f"- upload: {info['upload_floats_per_client']:,} floats per client per round "
      f"({info['upload_floats_per_client'] / info['num_params']:.2f}x the "
      f"{info['num_params']:,} model parameters); {last['upload_mb']:.2f} MB in total",
      f"- timing: {TIMING_FILE}",
      "",
      "| round | accuracy | loss | epsilon |",
      "|---:|---:|---:|---:|",
    ]
    for r in records:
      eps = "-" if r.get("epsilon") is None else f"{r['epsilon']:.3f}"
      lines.append(
        f"| {r['round']} | {100 * r['test_accuracy']:.2f} | {r['test_loss']:.4f} | {eps} |"
      )
  else:
    lines += notes
  lines += [
    "",
    "Clients: "
    + ", ".join(
      f"{k}: {n} records, classes {c}"
      for k, (n, c) in enumerate(zip(info["client_sizes"], info["client_classes"]))
    ),
    "",
  ]
  files = sorted(
    p.relative_to(workdir).as_posix()
    for p in workdir.glob("*")
    if p.is_file() and not p.name.startswith(".")
  )
  dirs = [f"{d}/" for d in ("checkpoints", "synthetic") if (workdir / d).is_dir()]
  lines += ["Files: " + ", ".join(files + dirs), ""]
  (workdir / "summary.md").write_text("\n".join(lines))
