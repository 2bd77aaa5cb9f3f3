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
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

import fedlap_jax
from fedlap_jax import accounting
from fedlap_jax.method import json_floats

from experiments import resume

from fedlap_runs import build, checkpointing, method_entries, seeds
from experiments.resume import DAMAGED_DIR

BYTES_PER_FLOAT = 4
# The section of a metrics record that holds raw statistics of the clients' records.
NONPRIVATE_SECTION = "nonprivate"
TIMING_FILE = checkpointing.TIMING_FILE
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
NOT_COVERED = (TIMING_FILE, resume.FINGERPRINT_FILE, "audit/")


def _keystr(path) -> str:
  return (
    jax.tree_util.keystr(path)
    .replace("'", "")
    .replace("[", ".")
    .replace("]", "")
    .replace("..", ".")
    .strip(".")
  )


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

  A metrics type with a view of its own (:func:`fedlap_runs.method_entries.metrics_view`; FedLAP's
  :class:`~fedlap_jax.methods.fedlap.state.RoundMetrics`: per-client radius, matching losses, real
  accesses, ...) is summarised by it; any other: every leaf, per client where it has a
  leading ``(K,)`` axis.

  Args:
    private: a DP run: the metrics the library declares ``NONPRIVATE`` (raw
      statistics of the clients' records) go to the second dict.

  Returns:
    ``(released, nonprivate)``; ``nonprivate`` is empty unless ``private``.
  """
  view = method_entries.metrics_view(metrics)
  out = _summarize(metrics, num_clients) if view is None else view.summary(metrics, num_clients)
  if not private:
    return out, {}
  names = _nonprivate_names(metrics) if view is None else view.nonprivate(metrics)
  return (
    {k: v for k, v in out.items() if k not in names},
    {k: v for k, v in out.items() if k in names},
  )


def _summarize(metrics: Any, num_clients: int) -> dict:
  out: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]:
    a = np.asarray(leaf)
    name = _keystr(path) or "value"
    if a.ndim == 0:
      out[name] = json_floats(a)[0]
    elif a.shape[0] == num_clients:
      out[name] = json_floats(a.reshape(num_clients, -1).mean(axis=1))
    elif a.size <= 64:
      out[name] = json_floats(a)
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
  view = method_entries.metrics_view(metrics)
  problems = [] if view is None else view.non_finite(metrics, num_clients, ids)
  if view is None:
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
  # On the host: one device program per parameter shape would be built (or read from JAX's
  # cache) in a run's first round, for a check NumPy makes as fast.
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not np.isfinite(np.asarray(leaf)).all():
      problems.append(f"global parameter {_keystr(path)} holds NaN/Inf")
  if not math.isfinite(test_loss):
    problems.append(f"test loss is {test_loss}")
  return problems


def compiling_line(m: int) -> str:
  """Said before the first round of a process, whose programs are built (minutes on a CPU for
  the DP recipes) before anything else is printed."""
  return f"compiling round {m} (or reading its programs from the compilation cache) ..."


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
    if r_g is not None and rec.get("server_distance", r_g) < r_g and set(radii) <= {r_g}:
      # One constant radius the server stopped short of (at max_epochs): it bound nothing
      # this round (the hybrid recipe's 1e4); its number would read as a limit.
      parts.append("server radius not reached")
    else:
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


def run_info(
  cfg, config_name: str, run, *, privacy: dict, mechanism, seed, nonprivate_stats: bool
) -> dict:
  """``run_info.json``: the run's public facts (method, data, client sizes and classes,
  normalisation, upload, versions, the privacy parameters) without the seed, which determines
  every noise draw (it stays in config.json), and how the run came by it."""
  dataset, private = run.dataset, run.algorithm.dp is not None
  hidden = ("method", "dataset", "client_sizes", "seed") + resume.COMPUTATION_FIELDS
  return dict(
    config_name=config_name,
    method=cfg.method,
    method_label=method_entries.label(cfg.method, private),
    dataset=cfg.data.name,
    rounds=cfg.rounds,
    num_params=run.num_params,
    image_shape=list(dataset.image_shape),
    num_classes=dataset.num_classes,
    client_sizes=[len(i) for i in run.client_indices],
    client_classes=[np.unique(dataset.y_train[i]).tolist() for i in run.client_indices],
    test_size=int(len(dataset.y_test)),
    normalisation={
      "source": dataset.normalisation,
      "mean": dataset.mean.tolist(),
      "std": dataset.std.tolist(),
    },
    nonprivate_stats=nonprivate_stats,
    upload_floats_per_client=int(run.algorithm.upload_floats_per_client),
    jax_version=jax.__version__,
    fedlap_jax_version=fedlap_jax.__version__,
    devices=[str(d) for d in jax.devices()],
    client_backend=build.client_backend(cfg),
    **{k: v for k, v in privacy.items() if k not in hidden},
    # What "epsilon" means (replace-one) and which figure a target calibrated.
    **(
      {
        "adjacency": mechanism.adjacency,
        "epsilon_for": cfg.dp.get("epsilon_for", accounting.REPLACE_ONE),
      }
      if private
      else {}
    ),
    # How the run came by its seed (fedlap_runs.seeds: given, drawn or default), not the seed.
    seed_origin=seed.origin,
  )


class TrainLog:
  """``train.log`` and stdout, line by line (flushed at once: a run killed by a scheduler or
  SIGKILL, with its stdout piped to a file, keeps every line it printed)."""

  def __init__(self, path: Path, label: str):
    self.label = label
    self._file = open(path, "a")

  def __call__(
    self, line: str, seconds: float | None = None, *, labelled: bool = True, kept: bool = True
  ) -> None:
    """``[label] line`` (``labelled``) to stdout and (``kept``) train.log; ``seconds`` (a
    round's timing) to stdout only, as train.log is releasable and timing is not covered."""
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top

    line = f"[{self.label}] {line}" if labelled else line
    tqdm.write(line if seconds is None else f"{line}  {seconds:.1f}s", file=sys.stdout)
    sys.stdout.flush()
    if kept:
      self._file.write(line + "\n")
      self._file.flush()

  def close(self) -> None:
    self._file.close()


def log_start(
  log: TrainLog, cfg, info: dict, *, start: int, ledger, moved, ckpt_dir: Path, seed, private: bool
) -> None:
  """The first lines of a run: damaged checkpoints set aside (``moved``: ``(round, why,
  where)``), where it resumes (round ``start`` of ``ckpt_dir``, with its ``ledger``) or the
  setting of a new run, the seed (DP) and the warning of ``debug_nonprivate_stats``."""
  for r, why, target in moved:
    log(f"WARNING checkpoint {r} is damaged ({why}); moved to {target}")
  per_round = cfg.data.get("clients_per_round")
  if start:
    log(
      f"resuming from round {start} (checkpoint {ckpt_dir / str(start)})"
      + (
        f", epsilon so far {ledger.epsilon:.3f} (add/remove {ledger.epsilon_add_remove:.3f})"
        if ledger is not None
        else ""
      )
    )
  elif moved:
    log("no valid checkpoint left: starting from round 0")
  else:
    sizes = info["client_sizes"]
    sampled = per_round is not None and per_round < cfg.data.num_clients
    log(
      f"{info['method_label']} on {cfg.data.name}: {len(sizes)} clients (sizes {sizes}"
      + ("" if per_round is None else f"; {per_round} per round")
      + ("; data on the host" if sampled else "")
      + f"), {info['num_params']:,} parameters, {cfg.rounds} rounds, "
      f"clients run by {info['client_backend']!r} on {jax.default_backend()}"
    )
  seed_line = seeds.describe(seed, private=private)
  if seed_line:
    log(seed_line)
  if info["nonprivate_stats"]:
    log(
      f"WARNING debug_nonprivate_stats=True: metrics.jsonl holds raw "
      f"statistics of the clients' records under \"{NONPRIVATE_SECTION}\", outside the "
      "privacy guarantee; do not release this work dir"
    )


def round_record(
  m: int,
  test_accuracy: float,
  test_loss: float,
  epsilon,
  ledger,
  metrics,
  idx,
  *,
  cfg,
  private,
  nonprivate_stats: bool,
  upload_mb: float,
) -> dict:
  """Round ``m``'s record of ``metrics.jsonl``: test metrics, epsilon (replace-one; and the
  add/remove figure), the round's summary (:func:`summarize_metrics`; with sampled
  participation its ``clients`` first and the per-client epsilons), the upload so far, and
  with ``debug_nonprivate_stats`` the raw statistics under :data:`NONPRIVATE_SECTION`."""
  released, nonprivate = summarize_metrics(metrics, len(idx), private=private)
  if cfg.data.get("clients_per_round") is not None:  # per-client metrics are of these clients
    released = {"clients": idx.tolist(), **released}
    if isinstance(ledger, accounting.ClientLedgers):
      released["epsilon_clients"] = ledger.summary()
  rec = {
    "round": m,
    "test_accuracy": test_accuracy,
    "test_loss": test_loss,
    "epsilon": epsilon,
    **({} if ledger is None else {"epsilon_add_remove": ledger.epsilon_add_remove}),
    **released,
    "upload_mb": upload_mb,
  }
  if nonprivate_stats:
    rec[NONPRIVATE_SECTION] = nonprivate
  return rec
