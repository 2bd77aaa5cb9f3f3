"""End-to-end runs of experiments.run on a tiny FedLAP-DP setting (digits, ConvNet-8x1).

One straight 4-round run (through the CLI) is compared with a run that crashes
inside the checkpoint save of round 3 and is resumed: same metrics, same privacy
ledger. Plus: outputs parse, resume refusals, NaN stop, report.
"""

import csv
import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import outputs, report, resume, run, train

from fedlap_runs import build, checkpointing
from fedlap_jax import accounting, baselines
from fedlap_runs.configs import quickstart
from conftest import TINY_FEDLAP_FLAGS, raises_field


TINY = {
  # conftest's tiny FedLAP with this file's progress bar (its default) and its own run.
  **{k: v for k, v in TINY_FEDLAP_FLAGS.items() if k != "progress_bar"},
  "rounds": 4,
  "snapshot_rounds": (2,),
  # Fixed here (the quickstart's recipe may change): the ledger numbers below assume it.
  "dp.noise_multiplier": 1.0,
  # Given, so runs compare (a DP run draws its seed otherwise: test_a_dp_run_draws_its_seed...).
  "seed": 0,
}
# Fields that legitimately differ between an interrupted and an uninterrupted run.
TIMING = ("round_seconds", "wall_seconds", "first_in_process")


def tiny_config(**overrides):
  cfg = quickstart.dp_config()
  for field, value in {**TINY, **overrides}.items():
    node = cfg
    *parents, leaf = field.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cfg


def argv_of(overrides):
  """``--config.FIELD=VALUE`` flags (tuples written as ``(a,b,)``)."""
  out = []
  for k, v in overrides.items():
    if isinstance(v, tuple):
      v = "(" + "".join(f"{x}," for x in v) + ")"
    out.append(f"--config.{k}={v}")
  return out


def comparable(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """4 rounds in one go, through the command line."""
  workdir = tmp_path_factory.mktemp("straight")
  argv = ["prog", "--config=quickstart:dp_loops", *argv_of(TINY), f"--workdir={workdir}"]
  assert run.main(argv) == 0
  return workdir


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory):
  """Checkpoints every round; the save of round 3 raises inside orbax; then resume."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  workdir = tmp_path_factory.mktemp("resumed")
  cfg = tiny_config(checkpoint_every=1, progress_bar=False)
  handler = ocp.handlers.JsonCheckpointHandler
  original = handler.async_save
  saves = []

  def crash_on_round_3(self, *args, **kwargs):  # the meta item is written after the state
    saves.append(1)
    if len(saves) == 3:
      raise RuntimeError("simulated crash inside the checkpoint save")
    return original(self, *args, **kwargs)

  mp = pytest.MonkeyPatch()
  mp.setattr(handler, "async_save", crash_on_round_3)
  with pytest.raises(RuntimeError, match="simulated crash"):
    train.train_and_evaluate(cfg, workdir)
  mp.undo()
  after_crash = {
    "latest": checkpointing.Checkpointer(workdir / "checkpoints").latest_round(),
    "records": checkpointing.read_metrics(workdir / "metrics.jsonl"),
    "ledger": json.loads((workdir / "privacy_ledger.json").read_text()),
    "listing": sorted(p.name for p in (workdir / "checkpoints").iterdir()),
  }
  result = train.train_and_evaluate(cfg, workdir)
  return workdir, after_crash, result


def test_tiny_run_writes_every_output_and_the_files_parse(straight):
  names = {p.name for p in straight.iterdir()}
  expected = {
    "config.json",
    "run_info.json",
    "metrics.jsonl",
    "privacy_ledger.json",
    "train.log",
    "summary.md",
    "timing.jsonl",
    "checkpoints",
    "synthetic",
    "accuracy_vs_round.png",
    "accuracy_vs_upload.png",
    "accuracy_vs_epsilon.png",
    "synthetic_round_0002.png",
    "synthetic_round_0004.png",
    "pixel_histograms.png",
  }
  assert expected <= names, expected - names
  cfg = json.loads((straight / "config.json").read_text())
  assert cfg["model"]["width"] == 8 and cfg["dp"]["enabled"] is True
  info = json.loads((straight / "run_info.json").read_text())
  assert info["upload_floats_per_client"] == 2 * 2 * 64 + 1  # ipc x classes x 8x8x1, r_k
  assert info["steps_per_round"] == 2 and info["batch_size"] == 16
  assert info["client_backend"] == "map"  # "auto" on the CPU backend
  records = checkpointing.read_metrics(straight / "metrics.jsonl")
  assert [r["round"] for r in records] == [1, 2, 3, 4]
  for r in records:
    assert 0.0 <= r["test_accuracy"] <= 1.0 and np.isfinite(r["test_loss"])
    assert len(r["client_radius"]) == 5 and len(r["matching_loss"]) == 5
    assert (
      r["server_radius"] == pytest.approx(quickstart.dp_config().client.radius)
      and r["server_steps"] >= 1
    )
  eps = [r["epsilon"] for r in records]
  assert all(b > a > 0 for a, b in zip(eps, eps[1:]))
  ledger = json.loads((straight / "privacy_ledger.json").read_text())
  assert ledger["rounds"] == 4 and ledger["epsilons"] == pytest.approx(eps)
  assert ledger["min_client_size"] == min(info["client_sizes"]) and ledger["steps_per_round"] == 2
  # Cumulative upload: rounds x clients x floats x 4 bytes.
  assert records[-1]["upload_mb"] == pytest.approx(4 * 5 * 257 * 4 / 1e6)
  for png in straight.glob("*.png"):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with np.load(straight / "synthetic" / "round_0004.npz") as snap:
    assert snap["x"].shape == (5, 4, 8, 8, 1) and snap["y"].shape == (5, 4)
  summary = (straight / "summary.md").read_text()
  assert "FedLAP-DP on digits" in summary and f"{eps[-1]:.3f}" in summary
  assert "- normalisation: test_split" in summary
  assert "- secret (they determine every noise draw): the seed in config.json" in summary
  assert "NOT PRIVATE: the seed was given" in summary  # TINY gives seed 0
  assert "non-private" not in summary
  log = (straight / "train.log").read_text()
  for m in range(1, 5):
    assert f"round   {m}/4  acc " in log and "server_steps 2" in log


# Every value a DP run writes is a DP output, post-processing of DP outputs, or
# public by the README's privacy section and docs/privacy.md.
RELEASED_RECORD_KEYS = {
  "round",
  "test_accuracy",
  "test_loss",
  "epsilon",  # test split (public), ledger
  "epsilon_add_remove",  # ledger (the paper's notion)
  "matching_loss",
  "matching_loss_last",
  "outer_iterations",  # post-processing of the
  "real_accesses",
  "server_distance",
  "server_epochs",  # noised gradients and the
  "server_steps",  # synthetic sets
  "client_radius",
  "server_radius",
  "learning_rate",
  "upload_mb",  # config constants
}
TIMING_KEYS = {"round", "round_seconds", "wall_seconds", "first_in_process"}  # timing.jsonl
PUBLIC_INFO_KEYS = {
  "config_name",
  "method",
  "method_label",
  "dataset",
  "rounds",
  "num_params",
  "image_shape",
  "num_classes",
  "client_sizes",
  "client_classes",
  "test_size",
  "normalisation",
  "nonprivate_stats",
  "upload_floats_per_client",
  "jax_version",
  "fedlap_jax_version",
  "devices",
  "client_backend",
  "dp",
  "noise_multiplier",
  "l2_clip_norm",
  "delta",
  "batch_size",
  "steps_per_round",
  "min_client_size",
  "sampling_rate",
  "source",
  "partition",
  "dirichlet_alpha",
  "num_clients",
  "train_fraction",
  "partition_seed",
  "adjacency",
  "epsilon_for",  # what epsilon means (config)
  "seed_origin",  # given / drawn / default, never the seed
}
WORKDIR_FILES = {  # name -> what it is (README, "Privacy guarantees and their assumptions"; docs/privacy.md)
  "metrics.jsonl": "released",
  "privacy_ledger.json": "released",
  "run_info.json": "released",
  "summary.md": "released",
  "train.log": "released",
  "synthetic": "released",
  "config.json": "public but its seed",
  "checkpoints": "secret (PRNG key)",
  "timing.jsonl": "not covered (timing)",
  "run_fingerprint.json": "not covered (the machine's XLA flags and CPU)",
}


def test_dp_workdir_holds_only_dp_outputs_and_public_values(straight):
  """An attacker's look at a DP run's work dir (tiny FedLAP-DP on digits, default flags)."""
  listing = {p.name for p in straight.iterdir()}
  assert {n for n in listing if not n.endswith(".png")} <= set(WORKDIR_FILES), listing
  for r in checkpointing.read_metrics(straight / "metrics.jsonl"):
    assert set(r) <= RELEASED_RECORD_KEYS, set(r) - RELEASED_RECORD_KEYS
  timing = checkpointing.read_metrics(straight / "timing.jsonl")
  assert [set(t) for t in timing] == [TIMING_KEYS] * 4 and [t["round"] for t in timing] == [
    1,
    2,
    3,
    4,
  ]
  log = (straight / "train.log").read_text() + (straight / "summary.md").read_text()
  assert not re.search(r"\d+\.\ds\b|seconds|wall time", log), "timing in a releasable file"
  info = json.loads((straight / "run_info.json").read_text())
  assert set(info) <= PUBLIC_INFO_KEYS, set(info) - PUBLIC_INFO_KEYS
  assert "seed" not in info and info["partition_seed"] == 0  # the partition's: public
  # Normalisation: the public test split's statistics, nothing of the training records.
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  _, _, x_test, _ = data_lib.load_digits()
  assert info["normalisation"]["source"] == "test_split"
  np.testing.assert_allclose(info["normalisation"]["mean"], [x_test.mean()], rtol=1e-5)
  np.testing.assert_allclose(info["normalisation"]["std"], [x_test.std()], rtol=1e-5)
  for snap in sorted((straight / "synthetic").glob("round_*.npz")):
    with np.load(snap) as z:
      assert set(z.files) == {"x", "y", "mask", "mean", "std", "round"}
      np.testing.assert_array_equal(z["mean"], np.float32(info["normalisation"]["mean"]))
      np.testing.assert_array_equal(z["std"], np.float32(info["normalisation"]["std"]))
      # Labels and mask: the classes each client holds (public), ipc per class.
      assert [sorted(set(y[m].tolist())) for y, m in zip(z["y"], z["mask"])] == info[
        "client_classes"
      ]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
  """One round of the hybrid DP recipe (client.model_steps='noisy_real', server.start=
  'fedavg_delta'), with the round metrics the driver receives: (workdir, out, seen)."""
  tmp_path = tmp_path_factory.mktemp("hybrid")
  seen = []
  summarize = outputs.summarize_metrics

  def spy(metrics, *args, **kwargs):
    seen.append(metrics)
    return summarize(metrics, *args, **kwargs)

  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(outputs, "summarize_metrics", spy)
    cfg = tiny_config(
      rounds=1,
      checkpoint_every=1,
      progress_bar=False,
      plots=False,
      **{
        "client.average_targets": True,
        "client.model_steps": "noisy_real",
        "client.inner_loop": 0,
        "server.start": "fedavg_delta",
      },
    )
    out = train.train_and_evaluate(cfg, tmp_path)
  return tmp_path, out, seen


def test_noisy_real_run_keeps_the_model_delta_inside_the_round(hybrid_run):
  """client.model_steps='noisy_real' + server.start='fedavg_delta': the clients' model deltas
  are used by the server step and dropped there; nothing of them reaches the work dir."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  tmp_path, out, seen = hybrid_run
  assert len(out["records"]) == 1 and len(seen) == 1
  assert seen[0].client.model_delta is None  # what the round hands the driver
  listing = {p.name for p in tmp_path.iterdir()}
  assert {n for n in listing if not n.endswith(".png")} <= set(WORKDIR_FILES), listing
  for r in checkpointing.read_metrics(tmp_path / "metrics.jsonl"):
    assert set(r) <= RELEASED_RECORD_KEYS, set(r) - RELEASED_RECORD_KEYS
  for f in tmp_path.rglob("*"):
    if f.is_file() and f.suffix in (".json", ".jsonl", ".md", ".log", ""):
      assert "model_delta" not in f.read_text(errors="replace"), f
  # The checkpoint holds the state (parameters, synthetic sets, round, key), no deltas.
  manager = ocp.CheckpointManager(tmp_path / "checkpoints")
  state = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  manager.close()
  fields = {name.split("_")[1] for name in state}  # "0003_params_Conv_0_kernel" -> params
  assert fields == {"params", "synthetic", "round", "key"}, sorted(state)
  num_params = json.loads((tmp_path / "run_info.json").read_text())["num_params"]
  assert sum(np.size(a) for n, a in state.items() if n.split("_")[1] == "params") == num_params


def test_every_noisy_access_of_the_hybrid_reaches_the_ledger(hybrid_run):
  """The hybrid's model steps and matching use only the round's T noisy accesses: every client
  made at least one and at most T = R_i x max_outer x batch_loop, and the ledger charged T
  (the worst case) for the round, at the smallest client's q."""
  tmp_path, out, _ = hybrid_run
  ledger = accounting.PrivacyLedger.from_dict(
    json.loads((tmp_path / "privacy_ledger.json").read_text())
  )
  t = TINY["client.iterations"] * TINY["client.max_outer"] * TINY["client.batch_loop"]
  assert ledger.steps_per_round == t and ledger.steps == [t]
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert ledger.min_client_size == min(info["client_sizes"]) == info["min_client_size"]
  (rec,) = out["records"]
  assert len(rec["real_accesses"]) == 5 and all(1 <= a <= t for a in rec["real_accesses"])
  assert rec["epsilon"] == pytest.approx(ledger.epsilon, rel=1e-9)


# What a DP baseline's round adds to the released record: local step counts (fixed by the
# public N_k and B), and norms of models trained with noised steps (post-processing).
BASELINE_RECORD_KEYS = {"client.steps", "client.update_norm", "server_update_norm", "control_norm"}


def test_dp_fedavg_workdir_and_ledger(tmp_path):
  """An attacker's look at a DP-FedAvg run's work dir: only released and public values are
  written, and every client's noisy local steps are within the T the ledger charged."""
  cfg = tiny_config(
    rounds=2,
    progress_bar=False,
    plots=False,
    method="dp_fedavg",
    learning_rate=1.0,
    **{"baseline.local_epochs": 1, "dp.l2_clip_norm": 0.1},
  )
  out = train.train_and_evaluate(cfg, tmp_path)
  listing = {p.name for p in tmp_path.iterdir()}
  assert listing <= set(WORKDIR_FILES), listing
  released = RELEASED_RECORD_KEYS | BASELINE_RECORD_KEYS
  records = checkpointing.read_metrics(tmp_path / "metrics.jsonl")
  assert len(records) == 2
  for r in records:
    assert set(r) <= released, set(r) - released
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert set(info) <= PUBLIC_INFO_KEYS, set(info) - PUBLIC_INFO_KEYS
  assert "seed" not in info
  ledger = accounting.PrivacyLedger.from_dict(
    json.loads((tmp_path / "privacy_ledger.json").read_text())
  )
  sizes = info["client_sizes"]
  # One local epoch of expected batches B = 16: T_k = round(N_k / B) noisy steps, from public N_k.
  steps = [baselines.steps_per_epoch(n, 16) for n in sizes]
  t = max(steps)
  assert ledger.steps_per_round == t == info["steps_per_round"] and ledger.steps == [t, t]
  assert ledger.min_client_size == min(sizes) and ledger.batch_size == 16
  for r, eps in zip(out["records"], ledger.epsilons):
    assert r["client.steps"] == steps  # each client ran its T_k <= T, none ran over
    assert r["epsilon"] == pytest.approx(eps, rel=1e-9)
  assert ledger.epsilon == pytest.approx(
    accounting.epsilon_after_rounds(
      rounds=2,
      noise_multiplier=cfg.dp.noise_multiplier,
      batch_size=16,
      min_client_size=min(sizes),
      steps_per_round=t,
      delta=cfg.dp.delta,
      adjacency=accounting.REPLACE_ONE,
    ),
    rel=1e-9,
  )


def test_debug_nonprivate_stats_writes_them_in_a_named_section(straight, tmp_path):
  cfg = tiny_config(rounds=1, progress_bar=False, plots=False, debug_nonprivate_stats=True)
  out = train.train_and_evaluate(cfg, tmp_path)
  rec = out["records"][0]
  assert set(rec) - {outputs.NONPRIVATE_SECTION} <= RELEASED_RECORD_KEYS
  stats = rec[outputs.NONPRIVATE_SECTION]
  assert set(stats) == {"clip_fraction", "mean_batch_size", "poisson_extra_chunks"}
  assert all(0 <= c <= 1 for c in stats["clip_fraction"]) and len(stats["clip_fraction"]) == 5
  assert all(8 < b < 28 for b in stats["mean_batch_size"])  # B = 16
  assert json.loads((tmp_path / "run_info.json").read_text())["nonprivate_stats"] is True
  assert "WARNING debug_nonprivate_stats=True" in (tmp_path / "train.log").read_text()
  assert (
    "WARNING: metrics.jsonl holds non-private statistics" in (tmp_path / "summary.md").read_text()
  )
  # The DP outputs are those of the run without the flag.
  straight_rec = checkpointing.read_metrics(straight / "metrics.jsonl")[0]
  for k in ("test_accuracy", "epsilon", "matching_loss"):
    assert rec[k] == straight_rec[k]


def test_dp_baseline_metrics_keep_raw_statistics_out_of_the_record():
  from fedlap_jax import baselines  # pylint: disable=g-import-not-at-top

  k = 3
  client = baselines.ClientMetrics(
    loss=jnp.full(k, 2.0),
    steps=jnp.full(k, 4, jnp.int32),
    update_norm=jnp.full(k, 0.5),
    poisson_extra_chunks=jnp.zeros(k, jnp.int32),
    mean_batch_size=jnp.full(k, 63.0),
    clip_fraction=jnp.full(k, 0.9),
  )
  metrics = baselines.BaselineRoundMetrics(
    client, jnp.float32(0.1), jnp.float32(0.2), jnp.float32(0.0)
  )
  released, nonprivate = outputs.summarize_metrics(metrics, k, private=True)
  assert set(released) == {
    "client.steps",
    "client.update_norm",
    "learning_rate",
    "server_update_norm",
    "control_norm",
  }
  assert set(nonprivate) == {
    "client.loss",
    "client.poisson_extra_chunks",
    "client.mean_batch_size",
    "client.clip_fraction",
  }
  everything, none = outputs.summarize_metrics(metrics, k, private=False)
  assert set(everything) == set(released) | set(nonprivate) and none == {}


def test_crash_during_save_keeps_the_previous_checkpoint(crashed_and_resumed):
  _, after_crash, _ = crashed_and_resumed
  assert after_crash["latest"] == 2
  assert "3" not in after_crash["listing"]
  # The metrics file still parses; it holds the record of round 3 (written before the save).
  assert [r["round"] for r in after_crash["records"]] == [1, 2, 3]


def test_resumed_run_equals_straight_run(straight, crashed_and_resumed):
  workdir, _, result = crashed_and_resumed
  a = comparable(checkpointing.read_metrics(straight / "metrics.jsonl"))
  b = comparable(checkpointing.read_metrics(workdir / "metrics.jsonl"))
  assert [r["round"] for r in b] == [1, 2, 3, 4]
  for ra, rb in zip(a, b):
    assert ra.keys() == rb.keys()
    for k in ra:
      np.testing.assert_allclose(
        np.asarray(ra[k], float),
        np.asarray(rb[k], float),
        rtol=1e-6,
        atol=1e-6,
        err_msg=f"round {ra['round']} {k}",
      )
  # The restored state has the same shapes, dtypes and placement: the straight run
  # (same process, same setting) compiled the round; the resumed run compiles nothing.
  assert result["compilations"] == 0


def test_ledger_continues_across_resume(straight, crashed_and_resumed):
  workdir, after_crash, result = crashed_and_resumed
  # The crash happened after round 3's accounting: the live ledger shows 3 rounds ...
  assert after_crash["ledger"]["rounds"] == 3
  # ... the checkpoint of round 2 stored 2, and the resumed run continued from it.
  stored = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
  assert stored["ledger"]["rounds"] == 4 and stored["privacy"]["noise_multiplier"] == 1.0
  final = json.loads((workdir / "privacy_ledger.json").read_text())
  reference = json.loads((straight / "privacy_ledger.json").read_text())
  assert final == reference and final["rounds"] == 4
  assert result["ledger"] == reference
  assert stored["ledger"] == reference


def test_ctrl_c_charges_the_abandoned_round_and_the_resume_equals_the_uninterrupted_run(
  straight, tmp_path, monkeypatch
):
  """Ctrl-C while round 3 is computing: its noisy accesses happened, so the live ledger is
  charged for it (3 rounds) though nothing of it is written; the resume redoes round 3 from
  checkpoint 2 with the same keys, and the ledger and records end as an uninterrupted run's."""
  from fedlap_runs import termination  # pylint: disable=g-import-not-at-top

  wait_for = termination.wait_for
  rounds = []

  def interrupted_in_round_3(fn, *args, **kwargs):
    rounds.append(1)
    out = wait_for(fn, *args, **kwargs)  # the round ran: its Poisson draws and noise happened
    if len(rounds) == 3:
      raise KeyboardInterrupt
    return out

  cfg = tiny_config(checkpoint_every=1, progress_bar=False, plots=False)
  workdir = tmp_path / "run"
  monkeypatch.setattr(termination, "wait_for", interrupted_in_round_3)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(cfg, workdir)
  monkeypatch.undo()
  live = json.loads((workdir / "privacy_ledger.json").read_text())
  assert live["rounds"] == 3  # the abandoned round is charged as spent
  assert [r["round"] for r in checkpointing.read_metrics(workdir / "metrics.jsonl")] == [1, 2]
  assert checkpointing.Checkpointer(workdir / "checkpoints").latest_round() == 2
  log = (workdir / "train.log").read_text()
  assert (
    "interrupted (Ctrl-C) during round 3: the round was abandoned; its noisy accesses are "
    "charged to privacy_ledger.json as spent" in log
  )
  assert f"checkpoint 2 in {workdir / 'checkpoints'} is the last one" in log
  result = train.train_and_evaluate(cfg, workdir)
  reference = json.loads((straight / "privacy_ledger.json").read_text())
  assert json.loads((workdir / "privacy_ledger.json").read_text()) == reference
  assert result["ledger"] == reference and reference["rounds"] == 4
  straight_records = checkpointing.read_metrics(straight / "metrics.jsonl")
  assert comparable(result["records"]) == comparable(straight_records)


def test_finished_run_is_not_rerun(straight):
  cfg = tiny_config(progress_bar=False)
  before = checkpointing.read_metrics(straight / "metrics.jsonl")
  out = train.train_and_evaluate(cfg, straight)
  assert comparable(out["records"]) == comparable(before)
  assert len(out["records"]) == 4


@pytest.mark.parametrize(
  "field,value,fragment",
  [
    ("dp.noise_multiplier", 2.0, "privacy-relevant"),
    ("client.batch_size", 8, "privacy-relevant"),
    ("seed", 1, "privacy-relevant"),
    ("client.batch_loop", 3, "privacy-relevant"),  # T
    ("data.partition", "iid", "privacy-relevant"),
    ("data.partition_seed", 1, "privacy-relevant"),
    ("learning_rate", 0.01, "config differs"),
  ],
)
def test_resume_with_different_fields_is_refused(straight, field, value, fragment):
  cfg = tiny_config(progress_bar=False, **{field: value})
  before = (straight / "metrics.jsonl").read_text()
  with pytest.raises(resume.ResumeError) as err:
    train.train_and_evaluate(cfg, straight)
  msg = str(err.value)
  assert fragment in msg and "new --workdir" in msg
  assert (straight / "metrics.jsonl").read_text() == before


def test_dp_resume_on_another_client_backend_is_refused(straight, capsys):
  """A resumed round repeats the checkpointed keys: on another computation it would release a
  second output under the same noise, and their difference without noise."""
  files = {
    n: (straight / n).read_text()
    for n in ("metrics.jsonl", "privacy_ledger.json", "run_info.json", "config.json")
  }
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    *argv_of(TINY),
    "--config.client_backend=vmap",
    f"--workdir={straight}",
  ]
  assert run.main(argv) == 2
  err = capsys.readouterr().err
  assert "refusing to resume the DP run" in err and "on another computation" in err
  assert "client_backend: checkpoint 'map' vs now 'vmap'" in err
  assert "--config.client_backend=map" in err and "JAX platform 'cpu' with 1 device(s)" in err
  assert "new --workdir" in err
  assert {n: (straight / n).read_text() for n in files} == files


def test_nondp_resume_may_change_the_client_backend(tmp_path, capsys):
  """Without DP there is no noise to repeat: a run may resume on another backend. The first
  round of each process says it compiles, before it does; train.log keeps no such notice."""
  import shutil  # pylint: disable=g-import-not-at-top

  overrides = {
    "dp.enabled": False,
    "rounds": 2,
    "checkpoint_every": 1,
    "progress_bar": False,
    "plots": False,
  }
  first = train.train_and_evaluate(tiny_config(**overrides), tmp_path)
  shutil.rmtree(tmp_path / "checkpoints" / "2")  # as if killed before round 2's checkpoint
  again = train.train_and_evaluate(tiny_config(**overrides, client_backend="vmap"), tmp_path)
  assert [r["round"] for r in again["records"]] == [1, 2]
  assert again["timing"][1]["first_in_process"]  # round 2 was redone, on vmap
  assert comparable(again["records"][:1]) == comparable(first["records"][:1])
  out = capsys.readouterr().out
  first_notice, second_notice = out.find("compiling round 1 "), out.find("compiling round 2 ")
  assert -1 < first_notice < out.find("round   1/2") < second_notice < out.rfind("round   2/2")
  assert (
    out.count("compiling round") == 2 and "compiling" not in (tmp_path / "train.log").read_text()
  )


def test_non_finite_round_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  """Round 2 returns NaN parameters and a NaN matching loss on client 3 (npz source)."""
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top

  x_train, y_train, x_test, y_test = data_lib.load_digits()
  npz = tmp_path / "digits.npz"
  np.savez(npz, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  algorithm = build.algorithm

  def poisoned_build(*args, **kwargs):
    alg = algorithm(*args, **kwargs)
    calls = []

    def round_fn(state, clients):
      state, metrics = alg.round(state, clients)
      calls.append(1)
      if len(calls) == 2:
        state = state._replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
        loss = metrics.client.matching_loss.at[3].set(jnp.nan)
        metrics = metrics._replace(client=metrics.client._replace(matching_loss=loss))
      return state, metrics

    return alg._replace(round=round_fn)

  monkeypatch.setattr(build, "algorithm", poisoned_build)
  cfg = tiny_config(checkpoint_every=1, progress_bar=False)
  cfg.data.source = f"npz:{npz}"
  with pytest.raises(train.NonFiniteError) as err:
    train.train_and_evaluate(cfg, tmp_path / "run")
  msg = str(err.value)
  assert "round 2" in msg and "client 3" in msg and "global parameter" in msg
  assert "last good checkpoint is round 1" in msg
  workdir = tmp_path / "run"
  records = checkpointing.read_metrics(workdir / "metrics.jsonl")
  assert [r["round"] for r in records] == [1]
  assert (workdir / "metrics.jsonl").read_text().endswith("\n")
  ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
  assert ckpt.all_rounds() == [1]
  # The checkpoint's ledger covers round 1; the live ledger also counts the failed round.
  meta = json.loads((workdir / "checkpoints" / "1" / "meta" / "metadata").read_text())
  assert meta["ledger"]["rounds"] == 1
  assert json.loads((workdir / "privacy_ledger.json").read_text())["rounds"] == 2
  assert "ERROR round 2" in (workdir / "train.log").read_text()


def test_report_on_two_runs(straight, crashed_and_resumed, tmp_path):
  workdir, _, _ = crashed_and_resumed
  tables = report.make_report([straight, workdir], tmp_path, epsilons=(1e3,))
  rows, cols, cells = tables["dp_eps1000"]
  info = json.loads((straight / "run_info.json").read_text())
  col = f"FedLAP-DP ({report.cost_label(info['upload_floats_per_client'] / info['num_params'])})"
  assert rows == ["digits"] and cols == [col] and col.endswith("x)")
  text, mean, std, n = cells[("digits", col)]
  final = checkpointing.read_metrics(straight / "metrics.jsonl")[-1]["test_accuracy"]
  assert n == 2 and mean == pytest.approx(100 * final) and std == pytest.approx(0.0, abs=1e-4)
  md = (tmp_path / "report.md").read_text()
  assert "FedLAP-DP" in md and "digits" in md
  with open(tmp_path / "table_dp_eps1000.csv") as f:
    table = list(csv.reader(f))
  assert table[0][:4] == ["dataset", f"{col} mean", f"{col} std", f"{col} n"]
  assert float(table[1][1]) == pytest.approx(100 * final, abs=1e-3)
  with open(tmp_path / "runs.csv") as f:
    assert len(list(csv.DictReader(f))) == 2
  assert (tmp_path / "accuracy_vs_round.png").read_bytes()[:4] == b"\x89PNG"
  # A budget below the first round's epsilon has no entry.
  tables = report.make_report([straight], tmp_path / "low", epsilons=(1e-3,))
  assert tables["dp_eps0.001"][2][("digits", col)][0] == "-"
  assert report.main([str(straight), "--out", str(tmp_path / "cli")]) == 0


def test_baseline_runs_through_the_same_driver(tmp_path):
  pytest.importorskip("fedlap_jax.baselines")
  cfg = tiny_config(
    method="fedavg",
    rounds=2,
    progress_bar=False,
    plots=False,
    **{"dp.enabled": False, "baseline.local_epochs": 1, "client.batch_size": 64},
  )
  out = train.train_and_evaluate(cfg, tmp_path)
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert info["method_label"] == "FedAvg" and info["upload_floats_per_client"] == info["num_params"]
  rec = out["records"][-1]
  assert rec["epsilon"] is None and not (tmp_path / "privacy_ledger.json").exists()
  assert rec["upload_mb"] == pytest.approx(2 * 5 * info["num_params"] * 4 / 1e6)
  per_client = [k for k, v in rec.items() if isinstance(v, list) and len(v) == 5]
  assert per_client, rec.keys()


def test_uint8_data_stays_uint8_on_the_device_and_is_evaluated_normalised(tmp_path):
  """An npz of uint8 pixels: clients and test set stay uint8; metrics use normalised inputs."""
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top
  from fedlap_jax.training import evaluate  # pylint: disable=g-import-not-at-top

  x_train, y_train, x_test, y_test = data_lib.load_digits()
  npz = tmp_path / "pixels.npz"
  to_pixels = lambda x: np.round(x * 255).astype(np.uint8)
  np.savez(
    npz, x_train=to_pixels(x_train), y_train=y_train, x_test=to_pixels(x_test), y_test=y_test
  )
  cfg = tiny_config(rounds=1, progress_bar=False)
  cfg.data.name, cfg.data.source = "custom", f"npz:{npz}"
  setup = build.build_run(cfg)
  assert setup.dataset.x_train.dtype == np.uint8
  chex.assert_type(setup.clients.x, jnp.uint8)
  chex.assert_shape([setup.clients.pixel_scale, setup.clients.pixel_offset], (5, 1))
  first = setup.client_indices[0]
  np.testing.assert_allclose(
    np.asarray(jax.tree.map(lambda a: a[0], setup.clients).images(jnp.arange(len(first)))),
    setup.dataset.normalise(setup.dataset.x_train[first]),
    rtol=1e-5,
    atol=1e-5,
  )
  out = train.train_and_evaluate(cfg, tmp_path / "run")
  record = out["records"][-1]
  params = setup.algorithm.params_of(out["state"])
  x_test = jnp.asarray(setup.dataset.normalise(setup.dataset.x_test))
  want = evaluate(setup.apply_fn, params, x_test, jnp.asarray(setup.dataset.y_test))
  assert record["test_loss"] == pytest.approx(float(want.loss), rel=1e-5)
  assert record["test_accuracy"] == pytest.approx(float(want.accuracy))


def test_a_dp_delta_of_one_over_the_smallest_client_is_refused(tmp_path, capsys):
  """delta >= 1 / min_k N_k would allow releasing a whole record of the smallest client."""
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    "--config.dp.delta=0.004",
    f"--workdir={tmp_path / 'w'}",
  ]
  assert run.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert "dp.delta=0.004 is invalid; allowed: a delta < 1 / N_k = 1/274" in err, err
  assert len(err.splitlines()) == 1 and not (tmp_path / "w" / "config.json").exists()


def test_dp_records_state_the_replace_one_epsilon_with_add_remove_beside_it(straight):
  """Client sizes and classes are released, so the headline epsilon is replace-one; the
  paper's add/remove figure is written beside it under its own name, and run_info says so."""
  info = json.loads((straight / "run_info.json").read_text())
  assert (info["adjacency"], info["epsilon_for"]) == ("replace_one", "replace_one")
  mech = accounting.DpMechanism(
    noise_multiplier=info["noise_multiplier"],
    batch_size=info["batch_size"],
    steps_per_round=info["steps_per_round"],
    delta=info["delta"],
  )
  smallest = min(info["client_sizes"])
  for r in checkpointing.read_metrics(straight / "metrics.jsonl"):
    assert r["epsilon"] == mech.epsilon_after(r["round"], smallest)
    assert r["epsilon_add_remove"] == pytest.approx(
      mech.epsilon_after(r["round"], smallest, adjacency="add_remove"), rel=1e-9
    )
  ledger = json.loads((straight / "privacy_ledger.json").read_text())
  assert ledger["adjacency"] == "replace_one" and len(ledger["epsilons_add_remove"]) == 4
  summary = (straight / "summary.md").read_text()
  assert "replace-one neighbours given the public client sizes and classes" in summary
  assert f"add/remove-one epsilon (the paper's notion): {r['epsilon_add_remove']:.3f}" in summary


# ------------------------------------------------------------------------ damaged state


def _damage_state(ckpt_dir):
  for f in (ckpt_dir / "state").iterdir():
    if f.is_file():
      f.unlink()


def _edit_ledger(ckpt_dir):
  path = ckpt_dir / "meta" / "metadata"
  meta = json.loads(path.read_text())
  meta["ledger"]["epsilons"][-1] = 0.5  # a smaller epsilon than spent
  path.write_text(json.dumps(meta))


def _garbage_meta(ckpt_dir):
  (ckpt_dir / "meta" / "metadata").write_text("garbage{")


def _sigma_edited(ckpt_dir):  # consistent by itself, but not this run's sigma
  path = ckpt_dir / "meta" / "metadata"
  meta = json.loads(path.read_text())
  ledger = dict(meta["ledger"], noise_multiplier=5.0, epsilons=[])
  meta["ledger"] = accounting.PrivacyLedger(**ledger).to_dict()  # epsilons recomputed
  path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
  "damage",
  [_damage_state, _edit_ledger, _garbage_meta, _sigma_edited],
  ids=["deleted_state", "edited_ledger", "garbage_meta", "other_sigma"],
)
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(
  straight, crashed_and_resumed, tmp_path, damage, capsys
):
  import shutil  # pylint: disable=g-import-not-at-top

  source, _, _ = crashed_and_resumed  # checkpoints 3 and 4 of a finished 4-round run
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  damage(workdir / "checkpoints" / "4")
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    *argv_of(TINY),
    "--config.checkpoint_every=1",
    "--config.progress_bar=False",
    "--config.plots=False",
    f"--workdir={workdir}",
  ]
  assert run.main(argv) == 0
  log = (workdir / "train.log").read_text()
  assert "WARNING checkpoint 4 is damaged (" in log
  assert "resuming from round 3" in log and "(add/remove 2.168)" in log
  # Set aside, not deleted; round 4 re-run from checkpoint 3 with its ledger.
  assert (workdir / "damaged_checkpoints" / "4" / "meta").is_dir()
  assert checkpointing.Checkpointer(workdir / "checkpoints").all_rounds() == [3, 4]
  assert comparable(checkpointing.read_metrics(workdir / "metrics.jsonl")) == comparable(
    checkpointing.read_metrics(straight / "metrics.jsonl")
  )
  assert json.loads((workdir / "privacy_ledger.json").read_text()) == json.loads(
    (straight / "privacy_ledger.json").read_text()
  )


def test_the_ema_of_the_rounds_at_decay_0_is_the_last_rounds_model(tmp_path):
  """python -m benchmarks.ema_rounds on a run that kept every round: decay 0 is the last
  round's model (the run's own last accuracy), another decay is a model of its own; a run
  missing a round's checkpoint is refused by the field that kept too few, with status 2."""
  import pathlib
  import shutil
  import subprocess
  import sys

  workdir = tmp_path / "run"
  cfg = tiny_config(checkpoint_every=1, keep_checkpoints=4, progress_bar=False, plots=False)
  result = train.train_and_evaluate(cfg, workdir)

  def ema(*decays):
    argv = ["benchmarks.ema_rounds", str(workdir), "--decay", *map(str, decays)]
    root = pathlib.Path(__file__).resolve().parents[2]  # the repository: benchmarks/ is here
    return subprocess.run([sys.executable, "-m", *argv], cwd=root, capture_output=True, text=True)

  done = ema(0.0, 0.9)
  assert done.returncode == 0, done.stderr[-2000:]
  out = json.loads(done.stdout.splitlines()[-1])
  assert out["rounds"] == 4
  last = result["records"][-1]["test_accuracy"]
  assert out["last"] == out["ema"]["0.0"] == pytest.approx(last, abs=1e-6)
  assert 0.0 <= out["ema"]["0.9"] <= 1.0
  shutil.rmtree(workdir / "checkpoints" / "1")
  refused = ema(0.5)
  assert refused.returncode == 2 and "keep_checkpoints=4 is invalid" in refused.stderr


def test_stray_checkpoint_directory_is_set_aside(crashed_and_resumed, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  source, _, _ = crashed_and_resumed
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  (workdir / "checkpoints" / "9").mkdir()
  out = train.train_and_evaluate(
    tiny_config(checkpoint_every=1, progress_bar=False, plots=False), workdir
  )
  assert [r["round"] for r in out["records"]] == [1, 2, 3, 4] and out["compilations"] == 0
  assert (workdir / "damaged_checkpoints" / "9").is_dir()
  assert "WARNING checkpoint 9 is damaged" in (workdir / "train.log").read_text()


def _snapshot(workdir):
  return {
    p.relative_to(workdir).as_posix(): p.read_bytes()
    for p in sorted(workdir.rglob("*"))
    if p.is_file()
  }


@pytest.mark.parametrize("case", ["all_checkpoints_damaged", "metrics_garbled"])
def test_unusable_state_is_one_line_exit_2_and_nothing_changes(
  crashed_and_resumed, tmp_path, case, capsys
):
  import shutil  # pylint: disable=g-import-not-at-top

  source, _, _ = crashed_and_resumed
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  if case == "all_checkpoints_damaged":
    _garbage_meta(workdir / "checkpoints" / "4")
    _edit_ledger(workdir / "checkpoints" / "3")
    fragment = (
      "every checkpoint is damaged (checkpoint 4: metadata unreadable: JSONDecodeError"
      ": Expecting value: line 1 column 1 (char 0); checkpoint 3: ValueError: "
      "epsilons[2]=0.5 does not match"
    )
  else:
    lines = (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "{garbled\n"
    (workdir / "metrics.jsonl").write_text("".join(lines))
    fragment = "metrics.jsonl holds rounds [1] up to round 4"
  before = _snapshot(workdir)
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    *argv_of(TINY),
    "--config.checkpoint_every=1",
    f"--workdir={workdir}",
  ]
  assert run.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
  assert "nothing was changed" in err
  assert _snapshot(workdir) == before


def test_workdir_that_is_a_file_or_unwritable_exits_2(tmp_path, capsys):
  import subprocess  # pylint: disable=g-import-not-at-top

  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  argv = ["prog", "--config=quickstart:dp_loops", *argv_of(TINY)]
  assert run.main(argv + [f"--workdir={a_file}"]) == 2
  err = capsys.readouterr().err
  assert err == (
    f"error: --workdir='{a_file}' is invalid: {a_file} is an existing file, not a "
    "directory; allowed: a directory this process can create and write (new, or "
    "the work dir of this run to resume it)\n"
  )
  assert run.main(argv + [f"--workdir={a_file}/run"]) == 2
  assert "is invalid: " in capsys.readouterr().err
  locked = tmp_path / "locked"
  locked.mkdir()
  if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
    locked.chmod(0o555)  # without CAP_LINUX_IMMUTABLE: read-only (refused unless root)
  try:
    probe = locked / "probe"
    try:
      probe.write_text("x")
      probe.unlink()
      pytest.skip("cannot make a directory unwritable here (root without chattr)")
    except OSError:
      pass
    assert run.main(argv + [f"--workdir={locked}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --workdir='{locked}/run' is invalid: [Errno ")
    assert err.count("\n") == 1
    assert run.main(argv + [f"--workdir={locked}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --workdir='{locked}' is invalid: [Errno ")
    assert err.count("\n") == 1
  finally:
    subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
    locked.chmod(0o755)


# ------------------------------------------------------------------------ the seed, releasing


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
  """Two rounds through the command line without --config.seed, then the same command again."""
  from fedlap_runs import seeds  # pylint: disable=g-import-not-at-top

  workdir = tmp_path_factory.mktemp("drawn")
  flags = {k: v for k, v in TINY.items() if k != "seed"}
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    *argv_of({**flags, "rounds": 2, "plots": False}),
    f"--workdir={workdir}",
  ]
  assert run.main(argv) == 0
  first = json.loads((workdir / "config.json").read_text())["seed"]
  assert run.main(argv) == 0  # resumes: the seed is read back, not drawn again
  return workdir, first, seeds


def test_a_dp_run_draws_its_seed_keeps_it_secret_and_resumes_with_it(drawn, capsys):
  workdir, first, seeds = drawn
  cfg = json.loads((workdir / "config.json").read_text())
  assert cfg["seed"] == first and seeds.DRAWN_MIN <= first < 2**128
  info = json.loads((workdir / "run_info.json").read_text())
  assert info["seed_origin"] == "drawn" and "seed" not in info
  log = (workdir / "train.log").read_text()
  assert "seed: drawn from the operating system's entropy (128 bits)" in log
  assert "resuming from round 2" in log and "read back from config.json" in log
  summary = (workdir / "summary.md").read_text()
  assert str(first) not in log + summary + (workdir / "metrics.jsonl").read_text()
  assert "NOT PRIVATE" not in summary
  assert "- releasable under the privacy guarantee: synthetic/, metrics.jsonl" in summary
  # A new work dir draws another seed; a resume with another one names no seed value.
  assert seeds.draw() != first
  with pytest.raises(resume.ResumeError) as err:
    train.train_and_evaluate(tiny_config(rounds=2, plots=False, seed=5), workdir)
  assert err.value.fields == ["seed"] and str(first) not in str(err.value)


def test_a_dp_work_dir_without_its_seed_is_not_given_a_new_one(drawn, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  workdir, _, _ = drawn
  copy = tmp_path / "shared"
  shutil.copytree(workdir, copy)
  cfg = json.loads((copy / "config.json").read_text())
  del cfg["seed"]  # shared without its seed, as docs/privacy.md allows
  (copy / "config.json").write_text(json.dumps(cfg))
  flags = {k: v for k, v in TINY.items() if k != "seed"}
  with pytest.raises(resume.ResumeError, match="holds checkpoints but its config.json has no seed"):
    train.train_and_evaluate(
      tiny_config(**{**flags, "rounds": 2, "plots": False, "seed": None}), copy
    )


def test_a_seed_key_is_the_old_one_below_2_64_and_holds_128_bits_above():
  from fedlap_runs import seeds  # pylint: disable=g-import-not-at-top

  assert (jax.random.key_data(seeds.run_key(7)) == jax.random.key_data(jax.random.key(7))).all()
  a, b = seeds.run_key(2**100), seeds.run_key(2**100 + 2**70)
  assert str(jax.random.key_impl(a)) == "rbg"
  assert not (jax.random.key_data(a) == jax.random.key_data(b)).all()
  with raises_field("seed") as err:
    seeds.run_key(2**128)
  assert err.value.value == 2**128


def test_runs_without_dp_keep_seed_0(tmp_path):
  from fedlap_runs import seeds  # pylint: disable=g-import-not-at-top

  assert seeds.resolve(None, private=False, workdir=tmp_path) == seeds.Seed(0, seeds.DEFAULT)
  assert seeds.resolve(3, private=True, workdir=tmp_path).origin == seeds.GIVEN
  assert seeds.resolve(None, private=True, workdir=tmp_path).origin == seeds.DRAWN


def _privacy_md_lists():
  from pathlib import Path  # pylint: disable=g-import-not-at-top

  text = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
  section = text[text.index("## A DP run's work dir") :]
  out = {}
  for kind in ("releasable", "secret", "not covered"):
    start = section.index(f"* **{kind}**")
    end = min(i for i in (section.find("\n* ", start + 1), section.find("\n\n", start)) if i > 0)
    out[kind] = tuple(re.findall(r"`([^`]+)`", section[start:end]))
  return out


def test_summary_lists_what_docs_privacy_md_lists(straight, drawn):
  assert _privacy_md_lists() == {
    "releasable": outputs.RELEASABLE,
    "secret": outputs.SECRET,
    "not covered": outputs.NOT_COVERED,
  }
  for workdir in (straight, drawn[0]):
    summary = (workdir / "summary.md").read_text()
    assert "- releasable under the privacy guarantee" in summary
    assert ", ".join(outputs.RELEASABLE) in summary
    assert "- secret (they determine every noise draw): " + ", ".join(outputs.SECRET) in summary
    assert (
      "- not covered by the guarantee (do not release): " + ", ".join(outputs.NOT_COVERED)
      in summary
    )


def test_the_epsilon_table_computes_what_a_run_prints(straight, drawn):
  """experiments.epsilons, on a run's own config.json, gives its metrics.jsonl's epsilons."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from experiments import epsilons  # pylint: disable=g-import-not-at-top

  for workdir in (straight, drawn[0]):
    cfg = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    spend = epsilons.spend(cfg, "run")
    records = checkpointing.read_metrics(workdir / "metrics.jsonl")
    assert [r["epsilon"] for r in records] == list(spend.epsilons)
    assert [r["epsilon_add_remove"] for r in records] == list(spend.epsilons_add_remove)


# Tiny configs of the three recipe families (a linear model, one digits client): the paper's
# loops, the tuned recipe's averaged targets over batch_loop > 1 batches, and the hybrid's
# noisy_real model steps. The radius stops each trajectory before max_outer, so the summary
# must also leave out the while-loop iterations that did not run.
_RECIPE_BASE = dict(
  ipc=2,
  iterations=2,
  max_outer=4,
  batch_loop=3,
  boost_loop=2,
  inner_loop=1,
  batch_size=64,
  radius=0.05,
  calibrate_radius=False,
  dsa_strategy="",
)
_RECIPES = {
  "paper": {},
  "tuned": {"average_targets": True},
  "hybrid": {"average_targets": True, "model_steps": "noisy_real", "inner_loop": 0},
}


@pytest.mark.parametrize("family", list(_RECIPES))
def test_released_matching_losses_are_those_of_the_rows_written(
  family, linear_apply_fn, linear_params, client_parts
):
  """matching_loss (and _last) of a round's record is the mean (and last) of the losses the
  client wrote: every target of each while-loop iteration that ran under the paper's loops,
  one averaged target per iteration under average_targets. The library's round record and the
  front end's metrics.jsonl summary are the same numbers."""
  from fedlap_jax.methods.fedlap import config  # pylint: disable=g-import-not-at-top
  from fedlap_jax.methods.fedlap import client
  from fedlap_jax.methods.fedlap import state as federated
  from fedlap_jax.methods.fedlap import server
  from fedlap_jax.client_data import ClientData, SyntheticSet  # pylint: disable=g-import-not-at-top
  from fedlap_jax.methods import fedlap  # pylint: disable=g-import-not-at-top
  from fedlap_jax.synthetic import noise_images, synthetic_labels  # pylint: disable=g-import-not-at-top

  cfg = config.ClientConfig(**{**_RECIPE_BASE, **_RECIPES[family]})
  x, y = client_parts[0]
  data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.ones(len(y), bool))
  labels, mask = synthetic_labels([y], cfg.ipc)
  mask = jnp.asarray(mask[0])
  syn = SyntheticSet(noise_images(jax.random.PRNGKey(5), mask, (8, 8, 1)), labels[0], mask)
  _, r_k, m = jax.jit(client.local_approx, static_argnames=("apply_fn", "config"))(
    jax.random.PRNGKey(1), linear_apply_fn, linear_params, syn, data, cfg, learning_rate=0.1
  )
  m = jax.tree.map(lambda a: np.asarray(a)[None], m)  # one client
  loss, runs = m.matching_loss[0], m.outer_iterations[0]  # (R_i, O, targets, R_b), (R_i,)
  assert runs.min() < cfg.max_outer  # some iterations did not run
  # By hand: the rows each iteration writes, of the iterations that ran.
  rows = 1 if cfg.average_targets else cfg.batch_loop
  written = [
    loss[i, o, r, :] for i in range(len(runs)) for o in range(runs[i]) for r in range(rows)
  ]
  assert all(np.all(w > 0) for w in written)
  expected = float(np.mean(np.concatenate(written)))
  expected_last = float(loss[-1, runs[-1] - 1, rows - 1, -1])

  metrics = federated.RoundMetrics(
    m,
    np.asarray(r_k)[None],
    server.ServerMetrics(1, 2, np.float32(0.5), np.float32(np.inf)),
    np.float32(0.1),
  )
  record = fedlap.METHOD.round_record(metrics)
  np.testing.assert_allclose(record["matching_loss"], [expected], rtol=1e-6)
  np.testing.assert_allclose(record["matching_loss_last"], [expected_last], rtol=1e-6)
  released, _ = outputs.summarize_metrics(metrics, 1)
  assert released == record


@pytest.mark.parametrize(
  "config, floats", [("quickstart:dp", 1280 + 1 + 10_986), ("quickstart:nondp", 1280 + 1)]
)
def test_the_quickstarts_upload_is_what_their_clients_send(config, floats):
  """Per client and round: 10 images per class x 2 classes x 8x8x1 and r_k; the hybrid
  (quickstart:dp) also sends its model delta, one float per parameter (10,986): 1.12x the
  model, not the images' 0.117x."""
  from fedlap_runs import flags  # pylint: disable=g-import-not-at-top

  cfg, _ = flags.load_config(config)
  p = build.plan(cfg)
  model = build.init(p, 0).model
  alg = build.algorithm(p, model)
  assert model.num_params == 10_986
  assert alg.upload_floats_per_client == floats
  ratio = report.cost_label(floats / model.num_params)
  assert ratio == ("1.12x" if config == "quickstart:dp" else "0.117x")
