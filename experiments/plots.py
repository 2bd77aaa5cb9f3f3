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

from fedlap_runs import checkpointing


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def line_plot(path, xs, ys, xlabel, title, *, integer_x: bool = False):
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(xs, 100 * np.asarray(ys), marker="o", markersize=3)
  ax.set_xlabel(xlabel)
  if integer_x:  # rounds: no tick at 1.5
    from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return fig


# Many-client runs (data.clients_per_round) plot the first clients only.
MAX_CLIENT_PANELS = 10


# Client panels per row of a synthetic-image figure.
CLIENTS_PER_ROW = 5


def _gap(h: int) -> int:
  """Pixels of white between the images of a mosaic of ``h``-pixel images."""
  return max(1, h // 8)


def client_mosaic(x, y, mask, max_per_class: int) -> tuple[np.ndarray, list]:
  """One client's images as one array: a row per class (its first ``max_per_class`` images),
  a white line between images and rows; ``(mosaic (rows, cols, C), classes)``."""
  classes = np.unique(y[mask]).tolist()
  h, w, c = x.shape[1:]
  gap = _gap(h)
  per_row = min(max_per_class, max(int(((y == k) & mask).sum()) for k in classes))
  out = np.ones((len(classes) * (h + gap) - gap, per_row * (w + gap) - gap, c), x.dtype)
  for i, k in enumerate(classes):
    for j, img in enumerate(x[(y == k) & mask][:per_row]):
      out[i * (h + gap) : i * (h + gap) + h, j * (w + gap) : j * (w + gap) + w] = img
  return out, classes


def synthetic_figure(snapshot: dict, title: str, max_per_class: int = 8):
  """One panel per client (the first :data:`MAX_CLIENT_PANELS`, :data:`CLIENTS_PER_ROW` to a
  row): a row of images per class, the class named on the left; pixels un-normalised and
  clipped to [0, 1]. Returns the figure (the caller saves and closes it)."""
  plt = _plt()
  x = np.clip(snapshot["x"] * snapshot["std"] + snapshot["mean"], 0.0, 1.0)  # (K, S, H, W, C)
  y, mask = snapshot["y"], snapshot["mask"]
  num_clients = min(x.shape[0], MAX_CLIENT_PANELS)
  mosaics = [client_mosaic(x[k], y[k], mask[k], max_per_class) for k in range(num_clients)]
  cols = min(num_clients, CLIENTS_PER_ROW)
  rows = -(-num_clients // cols)
  # Inches per image pixel: panels as wide as their images, the figure as tall as its rows.
  scale = 2.4 / max(m.shape[1] for m, _ in mosaics)
  width = cols * (scale * max(m.shape[1] for m, _ in mosaics) + 0.6)
  height = rows * (scale * max(m.shape[0] for m, _ in mosaics) + 0.5) + 0.4
  fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
  for k, ax in enumerate(axes.ravel()):
    if k >= num_clients:
      ax.remove()
      continue
    mosaic, classes = mosaics[k]
    ax.imshow(
      mosaic[..., 0] if mosaic.shape[-1] == 1 else mosaic,
      cmap="gray" if mosaic.shape[-1] == 1 else None,
      vmin=0,
      vmax=1,
      interpolation="nearest",
    )
    pitch = x.shape[2] + _gap(x.shape[2])
    ax.set_yticks(
      [i * pitch + (x.shape[2] - 1) / 2 for i in range(len(classes))], classes, fontsize=7
    )
    ax.set_xticks([])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
      spine.set_visible(False)
    ax.set_title(f"client {k}", fontsize=8)
    if k % cols == 0:
      ax.set_ylabel("class", fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  return fig


def synthetic_grid(path, snapshot: dict, title: str, max_per_class: int = 8) -> None:
  """Writes :func:`synthetic_figure` to ``path``."""
  plt = _plt()
  fig = synthetic_figure(snapshot, title, max_per_class)
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
    line_plot(p, rounds, acc, "communication round", label, integer_x=True)
    written.append(p)
    p = workdir / "accuracy_vs_upload.png"
    line_plot(
      p, [r["upload_mb"] for r in records], acc, "cumulative upload (MB, all clients)", label
    )
    written.append(p)
    if records[-1].get("epsilon") is not None:
      p = workdir / "accuracy_vs_epsilon.png"
      line_plot(p, [r["epsilon"] for r in records], acc, "epsilon", label)
      written.append(p)
  snaps = []
  for f in sorted((workdir / "synthetic").glob("round_*.npz")):
    with np.load(f) as z:
      snaps.append({k: z[k] for k in z.files})
  # Synthetic sets learnt in a feature space (data.features) are not images: no figure.
  snaps = [s for s in snaps if s["x"].shape[-1] in (1, 3)]
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
