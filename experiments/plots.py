"""PNG plots of one run, made from the files in its workdir only.

* ``accuracy_vs_round.png``: test accuracy after every round.
* ``accuracy_vs_upload.png``: accuracy against cumulative upload (MB, all
  clients, ``rounds x clients x upload floats x 4 bytes``).
* ``accuracy_vs_epsilon.png`` (DP): accuracy against the accountant's epsilon.
* ``synthetic_round_XXXX.png`` (FedLAP): a grid of synthetic images per client
  at each snapshot round (rows: the client's classes; pixels un-normalised and
  clipped to [0, 1], as in the paper's qualitative figures).
* ``pixel_histograms.png`` (FedLAP): per client, the distribution of
  un-normalised synthetic pixel values at each snapshot round (as in the
  paper's appendix).

``python -m experiments.plots WORKDIR`` remakes them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from experiments import checkpointing


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def _line_plot(path, xs, ys, xlabel, title):
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(xs, 100 * np.asarray(ys), marker="o", markersize=3)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# Many-client runs (data.clients_per_round) plot the first clients only.
MAX_CLIENT_PANELS = 10


def synthetic_grid(path, snapshot: dict, title: str, max_per_class: int = 8) -> None:
  """One panel per client (the first :data:`MAX_CLIENT_PANELS`); rows are classes, up to
  ``max_per_class`` images each."""
  plt = _plt()
  x = snapshot["x"] * snapshot["std"] + snapshot["mean"]  # (K, S, H, W, C)
  x = np.clip(x, 0.0, 1.0)
  y, mask = snapshot["y"], snapshot["mask"]
  num_clients = min(x.shape[0], MAX_CLIENT_PANELS)
  fig, axes = plt.subplots(1, num_clients, figsize=(2.2 * num_clients, 2.6), squeeze=False)
  for k in range(num_clients):
    ax = axes[0, k]
    classes = np.unique(y[k][mask[k]])
    rows = []
    for c in classes:
      imgs = x[k][(y[k] == c) & mask[k]][:max_per_class]
      pad = max_per_class - len(imgs)
      if pad:
        imgs = np.concatenate([imgs, np.ones((pad, *imgs.shape[1:]), imgs.dtype)])
      rows.append(np.concatenate(list(imgs), axis=1))
    grid = np.concatenate(rows, axis=0)
    ax.imshow(
      grid[..., 0] if grid.shape[-1] == 1 else grid,
      cmap="gray" if grid.shape[-1] == 1 else None,
      vmin=0,
      vmax=1,
      interpolation="nearest",
    )
    ax.set_title(f"client {k}: classes {classes.tolist()}", fontsize=8)
    ax.axis("off")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def pixel_histograms(path, snapshots: list[dict], title: str) -> None:
  """Per-client histograms of un-normalised synthetic pixel values, one line per round
  (the first :data:`MAX_CLIENT_PANELS` clients)."""
  plt = _plt()
  num_clients = min(snapshots[0]["x"].shape[0], MAX_CLIENT_PANELS)
  fig, axes = plt.subplots(
    1, num_clients, figsize=(2.6 * num_clients, 2.6), squeeze=False, sharey=True
  )
  for snap in snapshots:
    x = snap["x"] * snap["std"] + snap["mean"]
    for k in range(num_clients):
      values = x[k][snap["mask"][k]].ravel()
      hist, edges = np.histogram(values, bins=60, density=True)
      axes[0, k].plot(0.5 * (edges[1:] + edges[:-1]), hist, label=f"round {int(snap['round'])}")
  for k in range(num_clients):
    axes[0, k].set_title(f"client {k}", fontsize=9)
    axes[0, k].set_xlabel("pixel value")
    axes[0, k].axvspan(0, 1, color="grey", alpha=0.1)
  axes[0, 0].set_ylabel("density")
  axes[0, -1].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def make_all(workdir) -> list[Path]:
  """Writes every plot that the run's files support; returns their paths."""
  workdir = Path(workdir)
  records = checkpointing.read_metrics(workdir / "metrics.jsonl")
  info_path = workdir / "run_info.json"
  info = json.loads(info_path.read_text()) if info_path.exists() else {}
  label = f"{info.get('method_label', '')} on {info.get('dataset', '')}".strip()
  written = []
  if records:
    rounds = [r["round"] for r in records]
    acc = [r["test_accuracy"] for r in records]
    p = workdir / "accuracy_vs_round.png"
    _line_plot(p, rounds, acc, "communication round", label)
    written.append(p)
    p = workdir / "accuracy_vs_upload.png"
    _line_plot(
      p, [r["upload_mb"] for r in records], acc, "cumulative upload (MB, all clients)", label
    )
    written.append(p)
    if records[-1].get("epsilon") is not None:
      p = workdir / "accuracy_vs_epsilon.png"
      _line_plot(p, [r["epsilon"] for r in records], acc, "epsilon", label)
      written.append(p)
  snaps = []
  for f in sorted((workdir / "synthetic").glob("round_*.npz")):
    with np.load(f) as z:
      snaps.append({k: z[k] for k in z.files})
  for snap in snaps:
    p = workdir / f"synthetic_round_{int(snap['round']):04d}.png"
    synthetic_grid(p, snap, f"{label}: synthetic images after round {int(snap['round'])}")
    written.append(p)
  if snaps:
    p = workdir / "pixel_histograms.png"
    pixel_histograms(p, snaps, f"{label}: synthetic pixel values")
    written.append(p)
  return written


if __name__ == "__main__":
  for d in sys.argv[1:]:
    for p in make_all(d):
      print(p)
