r"""Tables and an overlay plot over finished runs, in the paper's layout.

  python -m experiments.report RUN_DIR [RUN_DIR ...] --out DIR [--epsilons 2.79,10.18]
                               [--metric final|best] [--best-of-grid]

``--best-of-grid`` (the ``compare_dp`` suite's report): the DP tables instead
show, per column, the best grid point (the best mean over seeds of the runs
that differ only in other fields, e.g. ``learning_rate``), and a grid table
(and ``grid_dp.csv``) shows every point. A run with ``dp.target_epsilon``
(calibrated to spend exactly that) counts only in the table of that epsilon,
with its accuracy after its last round. Best-of-grid reads the test accuracy
of every grid point: the choice itself is not covered by the runs' epsilon.
A config's ``label`` (e.g. ``FedLAP-DP (paper)``), when set, names its column
instead of the method.

Runs are grouped by setting: one **row** per dataset (with the data and model
fields that differ between runs of that dataset, e.g. ``cifar10 [partition=iid]``),
one **column** per method with its upload per client and round relative to the
model size, as the paper's ``FedAvg (1x)`` (``FedLAP (0.96x)``, ``FedAvg (1x)``,
``SCAFFOLD (2x)``, ...; a one-shot method uploads once; ``DSC (centralized)``
counts the raw data pooled), and the fields that differ between runs of that
method (e.g. ``FedLAP (0.96x) [client.ipc=20]``); runs that differ only in
``seed`` are pooled and shown as ``mean +- std`` (population std, in %) with
the number of seeds.

* Non-DP table: the accuracy after the last round (``--metric final``, the
  default) or the best over rounds (``--metric best``).
* DP tables, one per ``--epsilons`` value: the accuracy after the last round
  whose epsilon is at most that value (``-`` if already the first round spends
  more), as the paper's "under privacy budgets of 2.79 and 10.18". A run's
  epsilon is the figure its ``dp.epsilon_for`` names: the record's ``epsilon``
  (replace-one), or ``epsilon_add_remove`` (the paper's notion) for runs
  calibrated on it.
* DP at the epsilon spent: the accuracy after the last round and that
  round's epsilon (as the paper's PSG column, there at its add/remove 32; one-shot methods
  have one round).

Writes ``report.md``, ``table_nondp.csv``, ``table_dp_eps<e>.csv``,
``table_dp_final.csv``, ``runs.csv`` (one line per run, with its upload and
seconds per round from its ``timing.jsonl``; a drawn seed as ``drawn``) and ``accuracy_vs_round.png`` (mean over seeds, shaded +-
std; DP runs dashed) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from experiments import resume

from fedlap_runs import catalog, checkpointing, method_entries

METHOD_ORDER = method_entries.labels()
DATASET_ORDER = catalog.NAMES
# Fields that do not tell runs apart: what may change when a run resumes (it changes no
# number), and what a report names otherwise (the seed: runs of one setting; the method and
# dp.enabled: the label; where the data was read from).
IGNORED = resume.RUNTIME_FIELDS + ("seed", "data.source", "method", "dp.enabled", "label")
# Fields that differ between the points of one grid without being a grid dimension.
GRID_IGNORED = ("dp.noise_multiplier", "dp.target_epsilon")
ROW_PREFIXES = ("data.", "model.")


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


class Run:
  """One run directory: its config, run info and metric records."""

  def __init__(self, path):
    self.path = Path(path)
    cfg_path, info_path = self.path / "config.json", self.path / "run_info.json"
    if not cfg_path.exists() or not info_path.exists():
      raise ValueError(
        f"RUN_DIR={str(path)!r} is invalid: no config.json / run_info.json; "
        "allowed: a work dir written by experiments.run"
      )
    self.config = _flatten(json.loads(cfg_path.read_text()))
    self.info = json.loads(info_path.read_text())
    self.records = checkpointing.read_metrics(self.path / "metrics.jsonl")
    # Timing has its own file (outside the releasable ones); work dirs of older versions kept
    # it in metrics.jsonl.
    self.timing = checkpointing.read_metrics(self.path / "timing.jsonl") or self.records
    if not self.records:
      raise ValueError(f"RUN_DIR={str(path)!r} has no metrics records yet")
    self.dp = bool(self.info.get("dp"))
    self.method = self.info.get("method_label", self.config["method"])
    self.upload_ratio = (
      self.info["upload_floats_per_client"] / self.info["num_params"]
      if self.info.get("num_params")
      else float("nan")
    )
    self.dataset = self.config["data.name"]
    # A drawn seed is secret: reports name it "drawn", never its value.
    self.seed = "drawn" if self.info.get("seed_origin") == "drawn" else self.config["seed"]
    if self.config.get("label"):  # a config's display name replaces the method's
      self.method = self.config["label"]
    self.target_epsilon = self.config.get("dp.target_epsilon")
    # The figure the run's epsilon levels are stated in: the one its dp.target_epsilon /
    # dp.match_epsilon_of calibrated (dp.epsilon_for): "epsilon" (replace-one) or the
    # paper's "epsilon_add_remove".
    self.epsilon_key = (
      "epsilon_add_remove" if self.config.get("dp.epsilon_for") == "add_remove" else "epsilon"
    )
    fields = {k: v for k, v in self.config.items() if k not in IGNORED}
    self.row_fields = {k: v for k, v in fields.items() if k.startswith(ROW_PREFIXES)}
    self.col_fields = {k: v for k, v in fields.items() if not k.startswith(ROW_PREFIXES)}

  @property
  def complete(self) -> bool:
    return self.records[-1]["round"] == self.config["rounds"]

  def accuracy(self, metric: str = "final") -> float:
    accs = [r["test_accuracy"] for r in self.records]
    return accs[-1] if metric == "final" else max(accs)

  @property
  def final_epsilon(self) -> float:
    eps = self.records[-1].get(self.epsilon_key)
    return float("nan") if eps is None else float(eps)

  @property
  def round_seconds(self) -> tuple[float, float]:
    """``(first round, mean of the later rounds or nan)``; the first includes compilation."""
    secs = [r["round_seconds"] for r in self.timing if "round_seconds" in r]
    if not secs:
      return float("nan"), float("nan")
    return secs[0], (float(np.mean(secs[1:])) if len(secs) > 1 else float("nan"))

  def accuracy_at_epsilon(self, epsilon: float) -> float:
    key = self.epsilon_key
    ok = [r for r in self.records if r.get(key) is not None and r[key] <= epsilon]
    return ok[-1]["test_accuracy"] if ok else float("nan")


def _varying(dicts: list[dict]) -> set:
  keys = set().union(*dicts) if dicts else set()
  return {k for k in keys if len({repr(d.get(k)) for d in dicts}) > 1}


def _label(base: str, fields: dict, varying: set) -> str:
  extra = ", ".join(f"{k}={fields.get(k)}" for k in sorted(varying))
  return f"{base} [{extra}]" if extra else base


def label_runs(runs: list[Run]) -> None:
  """Sets ``run.row`` and ``run.col`` labels: base name plus the fields that tell groups apart."""
  by_dataset, by_method = defaultdict(list), defaultdict(list)
  for r in runs:
    by_dataset[r.dataset].append(r)
    by_method[r.method].append(r)
  for group in by_dataset.values():
    varying = _varying([r.row_fields for r in group])
    for r in group:
      r.row = _label(r.dataset, r.row_fields, varying)
  for group in by_method.values():
    varying = _varying([r.col_fields for r in group])
    for r in group:
      r.col = _label(f"{r.method} ({cost_label(r.upload_ratio)})", r.col_fields, varying)


def cost_label(ratio: float) -> str:
  """Upload per client and round relative to the model size, as the paper: ``0.96x``, ``2x``."""
  return "?x" if math.isnan(ratio) else f"{ratio:.3g}x"


def _order(labels, order, base=lambda label: label.split(" [")[0]):
  def key(label):
    b = base(label)
    return (order.index(b) if b in order else len(order), label)

  return sorted(set(labels), key=key)


def _cell(values: list[float], note: str = "") -> tuple[str, float, float, int]:
  vals = [v for v in values if not math.isnan(v)]
  if not vals:
    return "-", float("nan"), float("nan"), 0
  mean, std = 100 * float(np.mean(vals)), 100 * float(np.std(vals))
  text = f"{mean:.2f} ± {std:.2f}" if len(vals) > 1 else f"{mean:.2f}"
  return text + f" (n={len(vals)}{note})", mean, std, len(vals)


def build_table(runs: list[Run], value_fn, note_fn=None) -> tuple[list[str], list[str], dict]:
  """``(rows, cols, cells)`` with ``cells[(row, col)] = (text, mean, std, n)``.

  ``note_fn(runs of a cell)`` may add text inside the cell's parentheses.
  """
  groups, members = defaultdict(list), defaultdict(list)
  for r in runs:
    groups[(r.row, r.col)].append(value_fn(r))
    members[(r.row, r.col)].append(r)
  rows = _order([r.row for r in runs], DATASET_ORDER)
  method_of = {r.col: r.method for r in runs}
  cols = _order([r.col for r in runs], METHOD_ORDER, base=method_of.get)
  cells = {
    key: _cell(vals, note_fn(members[key]) if note_fn else "") for key, vals in groups.items()
  }
  return rows, cols, cells


def _epsilon_note(runs: list[Run]) -> str:
  eps = [r.final_epsilon for r in runs if not math.isnan(r.final_epsilon)]
  return f", ε={np.mean(eps):.3g}" if eps else ""


def _markdown(title: str, rows, cols, cells) -> str:
  lines = [
    f"### {title}",
    "",
    "| dataset | " + " | ".join(cols) + " |",
    "|---|" + "---:|" * len(cols),
  ]
  for row in rows:
    lines.append(f"| {row} | " + " | ".join(cells.get((row, c), ("",))[0] for c in cols) + " |")
  return "\n".join(lines) + "\n"


def _write_csv(path: Path, rows, cols, cells) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["dataset"] + [f"{c} {s}" for c in cols for s in ("mean", "std", "n")])
    for row in rows:
      line = [row]
      for c in cols:
        _, mean, std, n = cells.get((row, c), ("", float("nan"), float("nan"), 0))
        fmt = lambda v: "" if math.isnan(v) else f"{v:.4f}"
        line += [fmt(mean), fmt(std), n]
      w.writerow(line)


def overlay_plot(path: Path, runs: list[Run]):
  """Accuracy vs round, one panel per dataset (the runs it compares, whatever else their
  rows differ in: that goes to the legend), mean over seeds +- std; integer round ticks.
  Returns the figure, closed once written."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

  panels = _order([r.dataset for r in runs], DATASET_ORDER, base=lambda d: d)
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
  for ax, dataset in zip(axes[0], panels):
    groups = defaultdict(list)
    for r in runs:
      if r.dataset == dataset:
        groups[r.row, r.col].append(r)
    several_rows = len({row for row, _ in groups}) > 1
    method_of = {r.col: r.method for r in runs}
    for row, col in sorted(groups, key=lambda rc: (_method_rank(method_of[rc[1]]), rc)):
      members = groups[row, col]
      n = min(len(r.records) for r in members)
      acc = 100 * np.array([[rec["test_accuracy"] for rec in r.records[:n]] for r in members])
      x = np.arange(1, n + 1)
      mean, std = acc.mean(0), acc.std(0)
      style = "--" if members[0].dp else "-"
      where = row[len(dataset) :].strip() if several_rows else ""
      label = f"{col}{' ' + where if where else ''} (n={len(members)})"
      (line,) = ax.plot(x, mean, style, marker="o", markersize=3, label=label)
      ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_title(dataset, fontsize=10)
    ax.set_xlabel("communication round")
    ax.set_ylabel("test accuracy (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return fig


def best_of_grid_table(runs: list[Run], epsilon: float) -> tuple[list[str], list[str], dict, dict]:
  """Table-2 cells at ``epsilon``: per (dataset row, method) the best grid point.

  The runs of one cell that differ in fields other than the seed, the noise
  multiplier and the target epsilon are the grid (``learning_rate=0.3``, ...);
  each point's accuracies at ``epsilon`` are pooled over seeds and the point
  with the best mean is the cell. Runs with a ``dp.target_epsilon`` other than
  ``epsilon`` are left out (they spend another budget).

  Returns:
    ``(rows, cols, cells, grid)``: ``cells[(row, col)] = (text, mean, std, n)``
    of the best point (the text names it), ``grid[(row, col)] = {point: cell}``.
  """
  chosen = [
    r
    for r in runs
    if r.target_epsilon is None or math.isclose(float(r.target_epsilon), epsilon, rel_tol=1e-9)
  ]
  groups = defaultdict(list)
  for r in chosen:
    groups[(r.row, r.method)].append(r)
  cells, grid = {}, {}
  for key, members in groups.items():
    fields = [{k: v for k, v in r.col_fields.items() if k not in GRID_IGNORED} for r in members]
    varying = _varying(fields)
    points = defaultdict(list)
    for r, f in zip(members, fields):
      points[tuple(f.get(k) for k in sorted(varying))].append(r.accuracy_at_epsilon(epsilon))
    order = sorted(points, key=lambda vals: tuple((type(v).__name__, v) for v in vals))
    names = [", ".join(f"{k}={v}" for k, v in zip(sorted(varying), vals)) for vals in order]
    grid[key] = {name: _cell(points[vals]) for name, vals in zip(names, order)}
    scored = [(c[1], -i, p) for i, (p, c) in enumerate(grid[key].items()) if not math.isnan(c[1])]
    if not scored:
      cells[key] = ("-", float("nan"), float("nan"), 0)
      continue
    _, i, best = max(scored)
    edge = len(names) >= 3 and -i in (0, len(names) - 1)  # a wider grid might do better
    text, mean, std, n = grid[key][best]
    cells[key] = (
      text + (f" [{best}{', grid edge' if edge else ''}]" if best else ""),
      mean,
      std,
      n,
    )
  rows = _order([r.row for r in chosen], DATASET_ORDER)
  cols = sorted({r.method for r in chosen}, key=lambda m: (_method_rank(m), m))
  return rows, cols, cells, grid


def _method_rank(label: str) -> int:
  """Position in :data:`METHOD_ORDER`; a config label ("FedLAP-DP (tuned)") sorts with its method."""
  exact = [i for i, o in enumerate(METHOD_ORDER) if label == o]
  prefix = [i for i, o in enumerate(METHOD_ORDER) if label.startswith(o + " ")]
  return (exact or prefix or [len(METHOD_ORDER)])[0]


def _grid_markdown(epsilons, grids: dict) -> str:
  keys = list(dict.fromkeys((k, p) for g in grids.values() for k in sorted(g) for p in g[k]))
  lines = [
    "### Every grid point",
    "",
    "| dataset | method | grid point | " + " | ".join(f"epsilon {e:g}" for e in epsilons) + " |",
    "|---|---|---|" + "---:|" * len(epsilons),
  ]
  for (row, col), point in keys:
    vals = [grids[e].get((row, col), {}).get(point, ("",))[0] for e in epsilons]
    lines.append(f"| {row} | {col} | {point or '-'} | " + " | ".join(vals) + " |")
  return "\n".join(lines) + "\n"


def make_report(
  run_dirs, out, *, epsilons=(2.79, 10.18), metric: str = "final", best_of_grid: bool = False
) -> dict:
  """Writes the tables and the plot for ``run_dirs`` into ``out``; returns the tables.

  ``best_of_grid``: the DP tables show each column's best grid point (see
  :func:`best_of_grid_table`) and a table of every point (``grid_dp.csv`` too); the
  columns are then the methods (or config labels) alone.
  """
  if metric not in ("final", "best"):
    raise ValueError(f"metric={metric!r} is invalid; allowed: 'final' or 'best'")
  runs = [Run(d) for d in run_dirs]
  label_runs(runs)
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  md = [
    "# Results",
    "",
    f"{len(runs)} runs; accuracy in % (mean ± population std over seeds, n = seeds).",
    "",
  ]
  incomplete = [str(r.path) for r in runs if not r.complete]
  if incomplete:
    md += [f"Unfinished runs (their last round is used): {', '.join(incomplete)}", ""]
  tables = {}
  nondp = [r for r in runs if not r.dp]
  if nondp:
    t = build_table(nondp, lambda r: r.accuracy(metric))
    tables["nondp"] = t
    md.append(_markdown(f"Non-DP ({metric} accuracy)", *t))
    _write_csv(out / "table_nondp.csv", *t)
  dp = [r for r in runs if r.dp]
  if best_of_grid and dp:
    grids = {}
    md += [
      "DP: accuracy after the last round of each run calibrated to the epsilon "
      "(`dp.target_epsilon`), or of the last round within it; each column is its best "
      "grid point (best mean over seeds; [the point]). Choosing the best point looks at "
      "the test accuracy of every point: that choice is not covered by the epsilon.",
      "",
    ]
    for eps in epsilons:
      rows, cols, cells, grids[eps] = best_of_grid_table(dp, eps)
      tables[f"dp_eps{eps:g}"] = (rows, cols, cells)
      md.append(_markdown(f"DP, accuracy at epsilon {eps:g} (best of grid)", rows, cols, cells))
      _write_csv(out / f"table_dp_eps{eps:g}.csv", rows, cols, cells)
    tables["grid"] = grids
    md.append(_grid_markdown(epsilons, grids))
    with open(out / "grid_dp.csv", "w", newline="") as f:
      w = csv.writer(f)
      w.writerow(["epsilon", "dataset", "method", "grid_point", "mean", "std", "n"])
      for eps, g in grids.items():
        for (row, col), pts in sorted(g.items()):
          for point, (_, mean, std, n) in pts.items():
            w.writerow(
              [
                f"{eps:g}",
                row,
                col,
                point,
                "" if math.isnan(mean) else f"{mean:.4f}",
                "" if math.isnan(std) else f"{std:.4f}",
                n,
              ]
            )
  for eps in epsilons if dp and not best_of_grid else ():
    t = build_table(dp, lambda r, e=eps: r.accuracy_at_epsilon(e))
    tables[f"dp_eps{eps:g}"] = t
    md.append(_markdown(f"DP, accuracy at epsilon <= {eps:g}", *t))
    _write_csv(out / f"table_dp_eps{eps:g}.csv", *t)
  if dp:
    t = build_table(dp, lambda r: r.accuracy("final"), _epsilon_note)
    tables["dp_final"] = t
    md.append(_markdown("DP, final accuracy at the epsilon spent (ε after the last round)", *t))
    _write_csv(out / "table_dp_final.csv", *t)
  with open(out / "runs.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(
      [
        "run_dir",
        "dataset",
        "method",
        "row",
        "column",
        "seed",
        "rounds_done",
        "final_accuracy",
        "best_accuracy",
        "final_epsilon",
        "wall_seconds",
        "upload_floats_per_client",
        "upload_vs_model",
        "first_round_seconds",
        "later_round_seconds",
      ]
    )
    for r in runs:
      last = r.records[-1]
      first, later = r.round_seconds
      w.writerow(
        [
          r.path,
          r.dataset,
          r.method,
          r.row,
          r.col,
          r.seed,
          last["round"],
          f"{last['test_accuracy']:.6f}",
          f"{r.accuracy('best'):.6f}",
          "" if last.get("epsilon") is None else f"{last['epsilon']:.6f}",
          f"{r.timing[-1].get('wall_seconds', float('nan')):.1f}",
          r.info.get("upload_floats_per_client", ""),
          f"{r.upload_ratio:.4f}",
          f"{first:.2f}",
          "" if math.isnan(later) else f"{later:.2f}",
        ]
      )
  overlay_plot(out / "accuracy_vs_round.png", runs)
  md += ["![accuracy vs round](accuracy_vs_round.png)", ""]
  (out / "report.md").write_text("\n".join(md))
  return tables


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m experiments.report", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument(
    "--epsilons", default="2.79,10.18", help="comma-separated epsilon budgets for the DP tables"
  )
  parser.add_argument("--metric", default="final", choices=("final", "best"))
  parser.add_argument(
    "--best-of-grid",
    action="store_true",
    help="DP tables: each method's best grid point (e.g. learning rate)",
  )
  args = parser.parse_args(argv)
  try:
    eps = tuple(float(e) for e in args.epsilons.split(",") if e.strip())
    if any(not math.isfinite(e) or e <= 0 for e in eps):
      raise ValueError
  except ValueError:
    print(
      f"error: --epsilons={args.epsilons!r} is invalid; allowed: comma-separated numbers > 0",
      file=sys.stderr,
    )
    return 2
  try:
    make_report(
      args.run_dirs, args.out, epsilons=eps, metric=args.metric, best_of_grid=args.best_of_grid
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print((Path(args.out) / "report.md").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
