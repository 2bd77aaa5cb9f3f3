"""Membership-inference audit of a finished run (the paper's "Privacy Auditing").

  python -m experiments.audit RUN_DIR [--out DIR] [--seed 0] [--confidence 0.95]

Loads the final global model of ``RUN_DIR``, then, as in the paper:

* members are the clients' training records, non-members the test split; the
  larger pool is subsampled to the size of the smaller one (balanced);
* each pool is cut in two halves at random: the *training* half fits the
  attack (its thresholds; "a low loss / gradient norm means member"), the
  *audit* half measures it;
* black-box attack: threshold on the per-example loss; white-box attack:
  threshold on the per-example gradient norm (:mod:`fedlap_jax.auditing`).

Beyond the paper it reports an empirical epsilon lower bound per attack
(Clopper-Pearson, ``jax_privacy.auditing.CanaryScoreAuditor``) beside the
accountant's epsilon. Writes to ``RUN_DIR/audit/`` (or ``--out``):

* ``roc_blackbox.png``, ``roc_whitebox.png``: ROC curves of the audit half,
  linear and log-log;
* ``audit.json``: AUCs, TPR at 0.1 % and 1 % FPR where the audit half resolves them
  (:func:`resolves`: a rate of FPR ``f`` needs at least ``1 / f`` audit non-members; else
  ``null`` with the reason) and at the lowest FPR it does resolve, the epsilon lower bounds
  with their confidence level and delta, the accountant's epsilon, counts.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import auditing
from fedlap_jax.training import evaluate
from fedlap_jax.types import ApplyFn, PyTree


ATTACKS = {
  # name: (feature description, file stem)
  "blackbox_loss": ("per-example cross-entropy (nats)", "roc_blackbox"),
  "whitebox_grad_norm": (
    "per-example L2 norm of the loss gradient over all parameters",
    "roc_whitebox",
  ),
}


class LoadedRun(NamedTuple):
  """What the audit needs from a finished run.

  Attributes:
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the final global model.
    members: ``(x, y)``, every client's training records (numpy).
    nonmembers: ``(x, y)``, the test split (numpy).
    config: the run's resolved config as a dict.
    accountant_epsilon: the ledger's epsilon after the last round (``None``
      without DP: no guarantee).
    delta: the run's DP delta (``None`` without DP).
    round_index: the round of the loaded checkpoint.
    rounds: the rounds the run was configured for.
    label: the method's display name (e.g. ``"FedLAP-DP"``).
  """

  apply_fn: ApplyFn
  params: PyTree
  members: tuple[np.ndarray, np.ndarray]
  nonmembers: tuple[np.ndarray, np.ndarray]
  config: dict
  accountant_epsilon: float | None
  delta: float | None
  round_index: int
  rounds: int
  label: str


# ----------------------------------------------------------------------------
# The audit (independent of the run-dir format).
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _feature_fns(apply_fn: ApplyFn, loss_chunk: int, grad_chunk: int):
  losses = jax.jit(
    lambda p, x, y: auditing.per_example_losses(apply_fn, p, x, y, chunk_size=loss_chunk)
  )
  norms = jax.jit(
    lambda p, x, y: auditing.per_example_grad_norms(apply_fn, p, x, y, chunk_size=grad_chunk)
  )
  acc = jax.jit(lambda p, x, y: evaluate(apply_fn, p, x, y, chunk_size=loss_chunk).accuracy)
  return losses, norms, acc


def _check_xy(name: str, xy) -> tuple[np.ndarray, np.ndarray]:
  if not isinstance(xy, (tuple, list)) or len(xy) != 2:
    raise ValueError(f"{name} must be an (x, y) pair, got {type(xy).__name__}")
  x, y = np.asarray(xy[0]), np.asarray(xy[1])
  if y.ndim != 1 or x.shape[0] != y.shape[0]:
    raise ValueError(
      f"{name}: x has shape {x.shape} and y {y.shape}; allowed: "
      "x (N, ...) and y (N,) with the same N"
    )
  return x, y


def _roc(scores_in: np.ndarray, scores_out: np.ndarray):
  from sklearn import metrics  # pylint: disable=g-import-not-at-top

  labels = np.concatenate([np.ones(scores_in.size), np.zeros(scores_out.size)])
  scores = np.concatenate([scores_in, scores_out])
  fpr, tpr, _ = metrics.roc_curve(labels, scores)
  return fpr, tpr, float(metrics.roc_auc_score(labels, scores))


def _plot_roc(path: Path, title: str, curves: dict, min_fpr: float) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(9, 4))
  for ax, log in zip(axes, (False, True)):
    for label, (fpr, tpr, auc) in curves.items():
      ax.plot(fpr, tpr, label=f"{label} (AUC {auc:.3f})")
    lo = 10.0 ** math.floor(math.log10(min_fpr)) if log else 0.0
    ax.plot([lo, 1], [lo, 1], "k--", lw=0.8, label="random guess")
    if log:
      ax.set_xscale("log")
      ax.set_yscale("log")
      ax.set_xlim(lo, 1)
      ax.set_ylim(lo, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"{title}, {'log-log' if log else 'linear'}")
    ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
  fig.savefig(tmp, dpi=120)
  plt.close(fig)
  os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True, allow_nan=False)
    f.write("\n")
  os.replace(tmp, path)


def _finite_or_none(v):
  return None if v is None or not math.isfinite(v) else float(v)


def resolves(fpr: float, num_nonmembers: int) -> bool:
  """Whether ``num_nonmembers`` audit non-members resolve a false-positive rate of ``fpr``:
  at least one false positive must be possible (``fpr * n >= 1``; 0.1 % needs 1,000). Below
  that the empirical TPR at ``fpr`` is the TPR at zero false positives, not at ``fpr``."""
  return fpr * num_nonmembers >= 1.0 - 1e-9


def lowest_resolvable_fpr(num_nonmembers: int) -> float:
  """``1 / n``: the smallest false-positive rate ``n`` audit non-members resolve."""
  return 1.0 / num_nonmembers


def tpr_report(tpr_at_fpr: dict, num_nonmembers: int, fprs) -> dict:
  """The TPRs an audit may state: ``{"tpr_at_fpr": {fpr: tpr or None}, "tpr_unresolved":
  {fpr: why}, "lowest_resolvable_fpr": 1 / n, "tpr_at_lowest_resolvable_fpr": tpr}``, keys
  as ``f"{fpr:g}"``; ``tpr_at_fpr`` holds the measured TPR at each of ``fprs`` and at
  :func:`lowest_resolvable_fpr`."""
  lowest = lowest_resolvable_fpr(num_nonmembers)
  out = {"tpr_at_fpr": {}, "tpr_unresolved": {}}
  for f in fprs:
    key = f"{f:g}"
    if resolves(f, num_nonmembers):
      out["tpr_at_fpr"][key] = float(tpr_at_fpr[f])
    else:
      out["tpr_at_fpr"][key] = None
      out["tpr_unresolved"][key] = (
        f"needs >= {math.ceil(1 / f - 1e-9):,} audit non-members, has {num_nonmembers:,} "
        f"(lowest resolvable FPR {lowest:.3g})"
      )
  out["lowest_resolvable_fpr"] = lowest
  out["tpr_at_lowest_resolvable_fpr"] = float(tpr_at_fpr[lowest])
  return out


def audit_model(
  apply_fn: ApplyFn,
  params: PyTree,
  members,
  nonmembers,
  *,
  seed: int,
  out_dir: str | os.PathLike | None,
  accountant_epsilon: float | None = None,
  delta: float | None = None,
  confidence: float = 0.95,
  label: str = "model",
  run_info: dict | None = None,
  loss_chunk_size: int = 512,
  grad_chunk_size: int = 64,
) -> dict:
  """Black-box (loss) and white-box (gradient-norm) membership inference on one model.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the model under attack.
    members: ``(x, y)`` records the model was trained on, ``(N_in, ...)``, ``(N_in,)``.
    nonmembers: ``(x, y)`` records it never saw (the test split).
    seed: seed of the balanced subsampling and the half split.
    out_dir: where ``audit.json`` and the two ROC PNGs go (created);
      ``None`` writes nothing.
    accountant_epsilon: the accountant's epsilon of the run (``None``: no DP).
    delta: ``delta`` of the epsilon lower bounds (the run's DP delta, so the
      two epsilons are comparable); ``None`` uses 1e-5.
    confidence: confidence level of the lower bounds, in ``(0.5, 1)``.
    label: curve label in the plots (e.g. ``"FedLAP-DP"``).
    run_info: JSON-ready facts about the audited run, stored under ``"run"``.
    loss_chunk_size, grad_chunk_size: examples per device step.

  Returns:
    The ``audit.json`` content as a dict.
  """
  x_in, y_in = _check_xy("members", members)
  x_out, y_out = _check_xy("nonmembers", nonmembers)
  if not 0.5 < confidence < 1:
    raise ValueError(f"confidence={confidence!r} is invalid; allowed: a number in (0.5, 1)")
  if accountant_epsilon is not None and not accountant_epsilon >= 0:
    raise ValueError(
      f"accountant_epsilon={accountant_epsilon!r} is invalid; allowed: >= 0 or None (no DP)"
    )
  bound_delta = 1e-5 if delta is None else float(delta)
  significance = 1.0 - confidence
  split = auditing.split_for_audit(seed, len(y_in), len(y_out))

  # Compute features only on the records the audit uses.
  idx_in = np.concatenate([split.train_members, split.audit_members])
  idx_out = np.concatenate([split.train_nonmembers, split.audit_nonmembers])
  n_train = split.train_members.size
  losses_fn, norms_fn, acc_fn = _feature_fns(apply_fn, loss_chunk_size, grad_chunk_size)
  xi, yi = jnp.asarray(x_in[idx_in]), jnp.asarray(y_in[idx_in], jnp.int32)
  xo, yo = jnp.asarray(x_out[idx_out]), jnp.asarray(y_out[idx_out], jnp.int32)
  features = {
    "blackbox_loss": (np.asarray(losses_fn(params, xi, yi)), np.asarray(losses_fn(params, xo, yo))),
    "whitebox_grad_norm": (
      np.asarray(norms_fn(params, xi, yi)),
      np.asarray(norms_fn(params, xo, yo)),
    ),
  }

  result = {
    "protocol": {
      "members": "clients' training records",
      "nonmembers": "test split",
      "balanced": "the larger pool subsampled to the size of the smaller one",
      "split": "random halves: the training half fits the attack (thresholds), "
      "the audit half measures it",
      "attack": "threshold on one feature: member iff sign * feature >= threshold, "
      "sign = -1 (a low loss / gradient norm means member; Yeom et al. 2018)",
      "epsilon_lower_bound": "Clopper-Pearson (jax_privacy.auditing."
      "CanaryScoreAuditor.epsilon_clopper_pearson)",
      "seed": int(seed),
    },
    "counts": {
      "member_pool": int(len(y_in)),
      "nonmember_pool": int(len(y_out)),
      "train_members": int(split.train_members.size),
      "train_nonmembers": int(split.train_nonmembers.size),
      "audit_members": int(split.audit_members.size),
      "audit_nonmembers": int(split.audit_nonmembers.size),
    },
    "accountant": {
      "dp": accountant_epsilon is not None,
      "epsilon": _finite_or_none(accountant_epsilon),
      "delta": None if delta is None else float(delta),
    },
    "model": {
      "member_accuracy": float(acc_fn(params, xi, yi)),
      "nonmember_accuracy": float(acc_fn(params, xo, yo)),
    },
    "attacks": {},
  }
  if run_info is not None:
    result["run"] = dict(run_info)

  for name, (f_in, f_out) in features.items():
    if not (np.all(np.isfinite(f_in)) and np.all(np.isfinite(f_out))):
      raise FloatingPointError(
        f"{name}: the model gives non-finite features on "
        f"{int(np.sum(~np.isfinite(f_in)) + np.sum(~np.isfinite(f_out)))} "
        "records; refusing to audit a NaN/Inf model"
      )
    attack = auditing.fit_threshold_attack(
      f_in[:n_train], f_out[:n_train], significance=significance, delta=bound_delta
    )
    n_audit_out = int(split.audit_nonmembers.size)
    ev = auditing.evaluate_attack(
      attack,
      f_in[n_train:],
      f_out[n_train:],
      significance=significance,
      delta=bound_delta,
      fprs=auditing.DEFAULT_FPRS + (lowest_resolvable_fpr(n_audit_out),),
    )
    s_in, s_out = attack.scores(f_in[n_train:]), attack.scores(f_out[n_train:])
    fpr, tpr, auc = _roc(s_in, s_out)
    result["attacks"][name] = {
      "feature": ATTACKS[name][0],
      "sign": attack.sign,
      "threshold": attack.threshold,
      "epsilon_threshold": attack.epsilon_threshold,
      "train_auc": attack.train_auc,
      "train_accuracy": attack.train_accuracy,
      "auc": auc,
      "auc_convex_hull": ev.auc_convex_hull,
      "accuracy": ev.accuracy,
      **tpr_report(ev.tpr_at_fpr, n_audit_out, auditing.DEFAULT_FPRS),
      "epsilon_lower_bound": ev.epsilon_lower_bound,
      "epsilon_lower_bound_all_thresholds": ev.epsilon_lower_bound_all_thresholds,
      "epsilon_lower_bound_max": ev.epsilon_lower_bound_max,
      "confidence": ev.confidence,
      "delta": ev.delta,
      "mean_feature_members": float(np.mean(f_in[n_train:])),
      "mean_feature_nonmembers": float(np.mean(f_out[n_train:])),
    }
    if out_dir is not None:
      Path(out_dir).mkdir(parents=True, exist_ok=True)
      kind = "black-box (loss)" if name == "blackbox_loss" else "white-box (gradient norm)"
      _plot_roc(
        Path(out_dir) / f"{ATTACKS[name][1]}.png",
        kind,
        {label: (fpr, tpr, auc)},
        min_fpr=0.5 / s_out.size,
      )

  if out_dir is not None:
    _write_json(Path(out_dir) / "audit.json", result)
  return result


# ----------------------------------------------------------------------------
# Loading a run directory.
# ----------------------------------------------------------------------------


class RebuiltRun(NamedTuple):
  """A run rebuilt from its config, before any round (see :func:`rebuild_run`)."""

  apply_fn: ApplyFn
  algorithm: Any
  template: PyTree
  dataset: Any
  client_indices: list


def rebuild_run(cfg) -> RebuiltRun:
  """Data, partition, model, algorithm and initial state of ``cfg``, as the trainer builds them.

  :func:`fedlap_runs.build.build_run` itself (same seed use), so the initial
  state is a valid restore template for the run's checkpoints.
  """
  from fedlap_runs import build  # pylint: disable=g-import-not-at-top

  setup = build.build_run(cfg)
  return RebuiltRun(
    setup.apply_fn, setup.algorithm, setup.state, setup.dataset, setup.client_indices
  )


def load_run(run_dir: str | os.PathLike, round_index: int | None = None) -> LoadedRun:
  """Loads a run of ``python -m experiments.run``: model, data and the accountant's epsilon.

  Rebuilds the run from ``RUN_DIR/config.json`` as
  :func:`experiments.train.train_and_evaluate` does (same data, partition,
  model and algorithm, so the state template matches), then restores the
  checkpoint ``round_index`` (default: the newest) from ``RUN_DIR/checkpoints``
  with its privacy ledger.

  Args:
    run_dir: the run's work dir.
    round_index: which checkpoint; ``None`` for the newest.

  Returns:
    A :class:`LoadedRun`; ``members`` are every client's training records.

  Raises:
    FileNotFoundError: no ``config.json`` or no checkpoint.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  from fedlap_runs import checkpointing, method_entries  # pylint: disable=g-import-not-at-top
  from fedlap_jax.accounting import PrivacyLedger  # pylint: disable=g-import-not-at-top

  run_dir = Path(run_dir)
  config_path = run_dir / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(
      f"{config_path} does not exist; allowed: a work dir written by python -m experiments.run"
    )
  with open(config_path) as f:
    cfg = ml_collections.ConfigDict(json.load(f))
  built = rebuild_run(cfg)
  alg = built.algorithm

  ckpt = checkpointing.Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
  try:
    if ckpt.latest_round() is None:
      raise FileNotFoundError(
        f"no checkpoint in {run_dir / 'checkpoints'}; allowed: a run "
        "that completed at least one checkpointed round"
      )
    if round_index is not None and round_index not in ckpt.all_rounds():
      raise ValueError(
        f"round_index={round_index!r} is invalid; allowed: one of the "
        f"checkpointed rounds {ckpt.all_rounds()}"
      )
    if round_index is None:
      round_index = ckpt.latest_round()
    state, meta = ckpt.restore(built.template, round_index)
  finally:
    ckpt.close()

  epsilon = delta = None
  if alg.dp is not None:
    ledger = PrivacyLedger.from_dict(meta["ledger"])
    epsilon, delta = float(ledger.epsilon), float(ledger.delta)
  dataset = built.dataset
  members_idx = np.concatenate(built.client_indices)
  return LoadedRun(
    apply_fn=built.apply_fn,
    params=alg.params_of(state),
    members=(dataset.normalise(dataset.x_train[members_idx]), dataset.y_train[members_idx]),
    nonmembers=(dataset.normalise(dataset.x_test), dataset.y_test),
    config=cfg.to_dict(),
    accountant_epsilon=epsilon,
    delta=delta,
    round_index=int(meta.get("round", round_index)),
    rounds=int(cfg.rounds),
    label=method_entries.label(cfg.method, alg.dp is not None),
  )


# ----------------------------------------------------------------------------
# CLI.
# ----------------------------------------------------------------------------


def summary_lines(result: dict) -> list[str]:
  """A short human-readable summary of an ``audit.json`` dict."""
  acc = result["accountant"]
  eps = acc["epsilon"]
  lines = [
    f"accountant: epsilon={eps:.3f} (delta={acc['delta']:g})"
    if eps is not None
    else "accountant: no DP (no guarantee)"
  ]
  c = result["counts"]
  lines.append(f"audit half: {c['audit_members']} members / {c['audit_nonmembers']} non-members")
  for name, a in result["attacks"].items():
    tprs = ", ".join(
      f"TPR@{k}=N/A ({a['tpr_unresolved'][k]})" if v is None else f"TPR@{k}={v:.3f}"
      for k, v in a["tpr_at_fpr"].items()
    )
    tprs += (
      f", TPR@{a['lowest_resolvable_fpr']:.3g} (the lowest FPR resolved)="
      f"{a['tpr_at_lowest_resolvable_fpr']:.3f}"
    )
    lines.append(
      f"{name}: AUC={a['auc']:.3f} acc={a['accuracy']:.3f} {tprs} "
      f"eps_lb={a['epsilon_lower_bound']:.3f} (all thresholds "
      f"{a['epsilon_lower_bound_all_thresholds']:.3f}, max possible "
      f"{a['epsilon_lower_bound_max']:.3f}; {a['confidence']:.0%} confidence, "
      f"delta={a['delta']:g})"
    )
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m experiments.audit", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("run_dir", help="a finished run directory (config.json, checkpoints/)")
  parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/audit)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the subsampling and split")
  parser.add_argument(
    "--confidence", type=float, default=0.95, help="confidence level of the epsilon lower bounds"
  )
  parser.add_argument(
    "--round",
    type=int,
    default=None,
    dest="round_index",
    help="audit this checkpointed round (default: the newest)",
  )
  args = parser.parse_args(argv)
  try:
    run = load_run(args.run_dir, args.round_index)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if run.round_index != run.rounds:
    print(
      f"warning: auditing round {run.round_index} of a run configured for {run.rounds} rounds "
      "(unfinished run or --round)",
      file=sys.stderr,
    )
  out = Path(args.out) if args.out else Path(args.run_dir) / "audit"
  label = run.label
  if run.accountant_epsilon is not None:
    label = f"{label} (eps={run.accountant_epsilon:.2f})"
  run_info = {
    "dir": str(Path(args.run_dir).absolute()),
    "method": run.config.get("method"),
    "label": run.label,
    "dataset": run.config.get("data", {}).get("name"),
    "round": run.round_index,
    "rounds": run.rounds,
  }
  result = audit_model(
    run.apply_fn,
    run.params,
    run.members,
    run.nonmembers,
    seed=args.seed,
    out_dir=out,
    accountant_epsilon=run.accountant_epsilon,
    delta=run.delta,
    confidence=args.confidence,
    label=label,
    run_info=run_info,
  )
  for line in summary_lines(result):
    print(line)
  print(f"wrote {out / 'audit.json'}, {out / 'roc_blackbox.png'}, {out / 'roc_whitebox.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
