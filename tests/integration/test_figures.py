"""The figures a run and a report draw: what a reader sees in them (panels, rows, ticks)."""

import types

import numpy as np

from experiments import plots, report


def _snapshot(classes_per_client, ipc=3, hw=8):
  k, s = len(classes_per_client), ipc * max(map(len, classes_per_client))
  y = np.zeros((k, s), np.int32)
  mask = np.zeros((k, s), bool)
  for i, classes in enumerate(classes_per_client):
    y[i, : ipc * len(classes)] = np.repeat(classes, ipc)
    mask[i, : ipc * len(classes)] = True
  x = np.random.default_rng(0).normal(size=(k, s, hw, hw, 1)).astype(np.float32)
  return {"x": x, "y": y, "mask": mask, "mean": np.float32(0.5), "std": np.float32(0.2)}


def test_synthetic_images_are_a_grid_per_client_with_a_row_per_class():
  snap = _snapshot([[0, 1], [2, 3, 4], [5]])
  fig = plots.synthetic_figure(snap, "title")
  axes = fig.get_axes()
  assert len(axes) == 3  # one panel per client
  for ax, classes in zip(axes, [[0, 1], [2, 3, 4], [5]]):
    assert [t.get_text() for t in ax.get_yticklabels()] == [str(c) for c in classes]
    (image,) = ax.get_images()
    # 3 images of 8 pixels a row, a row per class, 1 white pixel between them
    assert image.get_array().shape == (9 * len(classes) - 1, 9 * 3 - 1)
  mosaic, classes = plots.client_mosaic(snap["x"][1], snap["y"][1], snap["mask"][1], 8)
  assert classes == [2, 3, 4]
  assert (mosaic[8, :] == 1).all() and (mosaic[:, 8] == 1).all()  # the borders
  np.testing.assert_array_equal(mosaic[9:17, 18:26], snap["x"][1][5])  # class 3, image 3


def _run(method, normalisation, dp, accuracies):
  return types.SimpleNamespace(
    dataset="digits",
    row=f"digits [data.normalisation={normalisation}]",
    col=f"{method} (1x)",
    method=method,
    dp=dp,
    records=[{"round": i + 1, "test_accuracy": a} for i, a in enumerate(accuracies)],
  )


def test_report_compares_fedlap_and_fedlap_dp_in_one_panel_with_integer_rounds(tmp_path):
  runs = [
    _run("FedLAP-DP", "test_split", True, [0.5, 0.6]),
    _run("FedLAP", "train_split", False, [0.7, 0.8]),
  ]
  fig = report.overlay_plot(tmp_path / "accuracy.png", runs)
  (ax,) = fig.get_axes()
  assert len(ax.get_lines()) == 2
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert any("test_split" in l for l in labels) and any("train_split" in l for l in labels)
  ticks = [t for t in ax.get_xticks() if 1 <= t <= 2]
  assert ticks and all(float(t).is_integer() for t in ticks)


def test_a_run_plots_its_rounds_on_integer_ticks(tmp_path):
  fig = plots.line_plot(
    tmp_path / "a.png", [1, 2], [0.5, 0.6], "communication round", "t", integer_x=True
  )
  ticks = [t for t in fig.get_axes()[0].get_xticks() if 1 <= t <= 2]
  assert ticks == [1.0, 2.0]
