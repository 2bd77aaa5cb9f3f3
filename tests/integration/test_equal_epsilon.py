"""Equal-epsilon runs: dp.target_epsilon calibration, the compare_dp suite and its report."""

import json

import pytest

from experiments import report, run, train

from fedlap_runs import build, calibration, flags, library_configs
from fedlap_runs.configs import compare_dp, quickstart, quickstart_compare
from fedlap_jax import accounting
from conftest import raises_field

# The quickstart's digits partition (records per client); passing it keeps these tests off the
# data where the data does not matter.
SIZES = [274, 283, 276, 278, 280]


def _budgets():
  # The paper-recipe FedLAP-DP on digits (pinned: the quickstart's DP recipe may change).
  fedlap = compare_dp.digits_paper()
  fedavg = quickstart_compare.matched_dp_baseline("dp_fedavg", fedlap)
  return {
    "fedlap_dp": calibration.dp_budget(fedlap, SIZES),
    "dp_fedavg": calibration.dp_budget(fedavg, SIZES),
  }


@pytest.mark.parametrize("method", ["fedlap_dp", "dp_fedavg"])
def test_calibration_hits_the_target_on_the_ledgers_terms_and_is_monotone(method):
  budget = _budgets()[method]
  # The method's own steps per round: FedLAP-DP's real accesses, DP-FedAvg's local steps.
  steps = {"fedlap_dp": 1 * 2 * 5, "dp_fedavg": 2 * round(283 / 64)}[method]
  assert (budget.batch_size, budget.min_client_size, budget.steps_per_round, budget.rounds) == (
    64,
    274,
    steps,
    10,
  )
  sigmas = []
  for target in (2.79, 10.18):
    sigma = budget.calibrate(target, field="dp.target_epsilon")
    eps = budget.epsilon(sigma)
    assert target * (1 - 1e-3) <= eps <= target
    sigmas.append(sigma)
  assert sigmas[0] > 1.5 * sigmas[1]
  # The sigma is the smallest to 1e-4: 1e-3 less overshoots the target.
  assert budget.epsilon(sigmas[1] * (1 - 1e-3)) > 10.18
  # A run's ledger charges what the calibration computes (2 rounds here, to stay fast).
  ledger = budget.mechanism.with_noise_multiplier(sigmas[1]).ledger(274)
  assert (ledger.batch_size, ledger.steps_per_round, ledger.delta) == (64, steps, 1e-5)
  ledger.record_round()
  ledger.record_round()
  assert ledger.epsilon == pytest.approx(budget._replace(rounds=2).epsilon(sigmas[1]), rel=1e-9)


def test_unreachable_target_names_the_bound():
  b = _budgets()["fedlap_dp"]
  with pytest.raises(library_configs.ConfigError) as err:
    b.calibrate(0.01, field="suite.x.dp.target_epsilon")
  msg = str(err.value)
  assert err.value.field == "suite.x.dp.target_epsilon" and "0.01 is unreachable" in msg
  assert "noise_multiplier=100" in msg and "\n" not in msg
  with raises_field("max_noise_multiplier"):
    accounting.calibrate_noise_multiplier(
      1.0,
      delta=1e-5,
      rounds=1,
      batch_size=1,
      min_client_size=10,
      steps_per_round=1,
      max_noise_multiplier=0.0,
    )


@pytest.mark.parametrize(
  "value, config, fragment",
  [
    ("0.001", "quickstart:dp", "dp.target_epsilon=0.001 is unreachable"),
    ("-1", "quickstart:dp", "dp.target_epsilon=-1.0 is invalid"),
    ("0", "quickstart:dp", "dp.target_epsilon=0.0 is invalid"),
    ("3", "quickstart:nondp", "None when dp.enabled is False"),
  ],
)
def test_cli_refuses_a_bad_target_with_exit_2(value, config, fragment, tmp_path, capsys):
  argv = [
    "prog",
    f"--config={config}",
    f"--config.dp.target_epsilon={value}",
    f"--workdir={tmp_path / 'w'}",
  ]
  assert run.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert fragment in err and "allowed" in err and len(err.splitlines()) == 1
  assert not (tmp_path / "w").exists()  # refused before anything was written


def test_target_epsilon_sets_sigma_and_logs_it(tmp_path, capsys, monkeypatch):
  seen = {}

  def fake_train(cfg, workdir, config_name="", built=None):  # the calibrated config reaches it
    seen["cfg"], seen["built"] = cfg, built
    return {"records": [], "seconds": 0.0}

  monkeypatch.setattr(train, "train_and_evaluate", fake_train)
  argv = [
    "prog",
    "--config=quickstart:dp_loops",
    "--config.dp.target_epsilon=5.0",
    f"--workdir={tmp_path}",
  ]
  assert run.main(argv) == 0
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("calibrated:"))
  cfg = seen["cfg"]
  sigma = cfg.dp.noise_multiplier
  assert cfg.dp.target_epsilon == 5.0 and sigma != 1.0
  assert seen["built"].mechanism.noise_multiplier == sigma  # the plan of the calibrated config
  assert line.startswith(f"calibrated: dp.target_epsilon=5 -> dp.noise_multiplier={sigma:.6g} ")
  c = quickstart.dp_config()  # quickstart:dp_loops: q = B / 274, T = R_i x max_outer x batch_loop
  steps = c.client.iterations * c.client.max_outer * c.client.batch_loop
  assert f"q = {c.client.batch_size}/274" in line
  assert f"T = {steps} per round, {c.rounds} rounds" in line
  eps = calibration.dp_budget(cfg, SIZES).epsilon(sigma)
  assert 5.0 * (1 - 1e-3) <= eps <= 5.0 and f"epsilon {eps:.4f})" in line


@pytest.mark.parametrize("name", ["fedlap_dp", "dp_fedavg", "psg"])
def test_the_builder_calibrates_as_experiments_run(name):
  """``build.plan(cfg, calibrate=True)`` (the front ends' calibration of one run) sets the
  sigma and log line ``experiments.run`` does (:func:`calibration.calibrate_noise`), on a copy:
  the library config and mechanism are those of the calibrated sigma."""
  cfg = _dp_configs()[name]
  cfg.dp.target_epsilon, cfg.dp.match_epsilon_of = 5.0, ""  # one run, outside its suite
  given = cfg.dp.noise_multiplier
  planned = build.plan(cfg, calibrate=True)
  assert cfg.dp.noise_multiplier == given != planned.cfg.dp.noise_multiplier
  lines = calibration.calibrate_noise(cfg)  # in place, as experiments.run
  sigma = cfg.dp.noise_multiplier
  assert planned.cfg.dp.noise_multiplier == sigma and planned.calibration == lines[0]
  assert planned.mechanism.noise_multiplier == sigma
  assert planned.mechanism == library_configs.dp_mechanism(cfg, list(planned.facts.client_sizes))
  eps = planned.budget().epsilon(sigma)
  assert 5.0 * (1 - 1e-3) <= eps <= 5.0
  cfg.dp.target_epsilon, cfg.dp.match_epsilon_of = None, "other"
  with pytest.raises(library_configs.ConfigError) as err:
    build.plan(cfg, calibrate=True)
  assert err.value.field == "dp.match_epsilon_of"


def test_an_uncalibrated_target_is_refused_by_the_driver(tmp_path):
  cfg = quickstart.dp_config()
  cfg.dp.target_epsilon = 5.0  # noise_multiplier left at 1.0: epsilon ~19 after 10 rounds
  with raises_field("dp.target_epsilon"):
    train.train_and_evaluate(cfg, tmp_path)
  assert not (tmp_path / "config.json").exists()
  cfg.dp.noise_multiplier = 2.9  # too much noise: epsilon well below the target
  with raises_field("dp.target_epsilon"):
    library_configs.check_target_epsilon(cfg, calibration.dp_budget(cfg, SIZES).epsilon(2.9))
  cfg.dp.noise_multiplier = 3.0
  library_configs.check_target_epsilon(cfg, 4.99)  # within 1 % below the target: accepted


def test_a_target_met_at_the_accounting_floor_is_accepted():
  """A loose target is met by the smallest sigma accounting allows; the run is not refused."""
  cfg = quickstart.dp_config()
  cfg.dp.target_epsilon = 1e6  # far above what sigma = MIN_NOISE_MULTIPLIER reaches
  calibration.calibrate_noise(cfg)
  assert cfg.dp.noise_multiplier == pytest.approx(accounting.MIN_NOISE_MULTIPLIER, rel=1e-3)
  planned = calibration.dp_budget(cfg, SIZES).epsilon(cfg.dp.noise_multiplier)
  assert planned < 0.99 * cfg.dp.target_epsilon
  library_configs.check_target_epsilon(cfg, planned)


def test_target_and_match_are_exclusive():
  config = quickstart_compare.get_config()
  config.suite.dp_fedavg.dp.target_epsilon = 3.0
  with raises_field("dp.target_epsilon"):
    library_configs.validate_config(config.suite.dp_fedavg)


# --------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("epsilon_for", ["replace_one", "add_remove"])
def test_the_comparison_suites_match_every_method_on_one_notion(epsilon_for):
  """compare_dp and quickstart_compare calibrate every DP run on the guarantee by default, on
  the paper's add/remove figure only when asked, and then every method alike."""
  arg = "" if epsilon_for == "replace_one" else f",epsilon_for={epsilon_for}"
  suites = [
    compare_dp.get_config(f"digits,lrs=1{arg}").suite,
    quickstart_compare.get_config(*([epsilon_for] if arg else [])).suite,
  ]
  for suite in suites:
    dp = [suite[k] for k in suite.keys() if suite[k].dp.enabled]
    assert len(dp) >= 4 and {c.dp.epsilon_for for c in dp} == {epsilon_for}
  with pytest.raises(ValueError, match="quickstart_compare:rdp is invalid"):
    quickstart_compare.get_config("rdp")


def test_quickstart_compare_gives_every_dp_method_the_same_guarantee():
  config = quickstart_compare.get_config()
  calibration.calibrate_noise(config)
  suite = config.suite
  sizes = calibration.client_sizes(suite.fedlap_dp)
  eps = {
    k: calibration.dp_budget(suite[k], sizes).epsilon(suite[k].dp.noise_multiplier)
    for k in ("fedlap_dp", "dp_fedavg", "dp_fedprox", "psg")
  }
  assert all(e == pytest.approx(eps["fedlap_dp"], rel=2e-4) for e in eps.values()), eps
  assert eps["fedlap_dp"] == pytest.approx(28.64, abs=0.005)  # quickstart:dp_loops' guarantee


def test_compare_dp_expands_into_every_method_grid_point_and_epsilon():
  suite = compare_dp.get_config("digits").suite
  variants = compare_dp.default_variants()
  assert variants[0] == "paper"
  expected = {f"fedlap_dp_{v}__eps{e}" for v in variants for e in ("2p79", "10p18")} | {
    f"{m}_lr{lr}__eps{e}"
    for m in ("dp_fedavg", "dp_fedprox")
    for lr in ("0p1", "0p3", "1", "3", "10")
    for e in ("2p79", "10p18")
  }
  assert set(suite.keys()) == expected
  for key in suite.keys():
    cfg = suite[key]
    library_configs.validate_config(cfg)
    assert cfg.dp.enabled and cfg.dp.target_epsilon == (2.79 if key.endswith("2p79") else 10.18)
    assert cfg.dp.match_epsilon_of == "" and cfg.data.normalisation == "test_split"
    assert (cfg.data.name, cfg.model.width, cfg.model.depth) == ("digits", 32, 2)
  paper = suite.fedlap_dp_paper__eps2p79
  assert paper.label == "FedLAP-DP (paper)" and paper.client.batch_size == 64
  assert library_configs.library_config(paper).client.real_accesses_per_round == 10
  assert suite.dp_fedavg_lr1__eps2p79.client.batch_size == 64
  assert suite.dp_fedprox_lr0p3__eps2p79.learning_rate == 0.3
  assert suite.dp_fedprox_lr0p3__eps2p79.method == "dp_fedprox"


def test_a_variant_without_configs_is_left_out_until_they_exist(monkeypatch):
  monkeypatch.setitem(
    compare_dp.FEDLAP_VARIANTS, "ghost", ("FedLAP-DP (ghost)", {"digits": "no_such_config"})
  )
  assert "ghost" not in compare_dp.default_variants()
  assert not any(k.startswith("fedlap_dp_ghost") for k in compare_dp.get_config("digits").suite)
  with pytest.raises(ValueError, match="variants='ghost'"):
    compare_dp.get_config("digits,variants=ghost")


def test_compare_dp_options_and_one_line_variants(monkeypatch, tmp_path):
  monkeypatch.setitem(
    compare_dp.FEDLAP_VARIANTS, "tuned", ("FedLAP-DP (tuned)", {"mnist": "mnist_dp"})
  )
  npz = tmp_path / "x.npz"
  suite = compare_dp.get_config(
    f"mnist=npz:{npz},eps=1+5,lrs=0.5,seeds=0+2,rounds=3,variants=paper+tuned"
  ).suite
  assert len(suite) == 2 * 2 * (2 + 2 * 1)
  cfg = suite["fedlap_dp_tuned__eps5__s2"]
  assert (cfg.label, cfg.seed, cfg.rounds, cfg.dp.target_epsilon) == (
    "FedLAP-DP (tuned)",
    2,
    3,
    5.0,
  )
  assert all(
    suite[k].data.source == f"npz:{npz}" and suite[k].data.name == "mnist" for k in suite.keys()
  )
  assert suite["dp_fedavg_lr0p5__eps1__s0"].model.width == 128  # the FedLAP-DP model
  only = compare_dp.get_config("digits,variants=none,lrs=10,eps=3").suite
  assert set(only.keys()) == {"dp_fedavg_lr10__eps3", "dp_fedprox_lr10__eps3"}
  assert only.dp_fedavg_lr10__eps3.model.width == 32
  with pytest.raises(ValueError, match="compare_dp:digits,eps=0 is invalid"):
    compare_dp.get_config("digits,eps=0")
  with pytest.raises(ValueError, match="epsilon_for='rdp'; allowed: one of"):
    compare_dp.get_config("digits,epsilon_for=rdp")
  _, label = flags.resolve_config_arg(f"compare_dp:npz:{npz}")
  assert "/" not in label


# --------------------------------------------------------------------------- the report


def _fake_run(path, *, method, label="", lr, seed, target, accs, dp_method_label):
  """A run dir as experiments.run writes it, with made-up accuracies (one per round)."""
  path.mkdir(parents=True)
  cfg = {
    "method": method,
    "label": label,
    "seed": seed,
    "rounds": len(accs),
    "learning_rate": lr,
    "data": {"name": "digits"},
    "model": {"width": 32},
    "dp": {"enabled": True, "target_epsilon": target, "noise_multiplier": 1.0 + lr},
  }
  (path / "config.json").write_text(json.dumps(cfg))
  (path / "run_info.json").write_text(json.dumps({"dp": True, "method_label": dp_method_label}))
  with open(path / "metrics.jsonl", "w") as f:
    for i, a in enumerate(accs):
      f.write(
        json.dumps(
          {
            "round": i + 1,
            "test_accuracy": a,
            "wall_seconds": 1.0,
            "round_seconds": 1.0,
            "epsilon": target * (i + 1) / len(accs),
          }
        )
        + "\n"
      )
  return path


def test_report_picks_the_best_grid_point_per_checkpoint(tmp_path):
  dirs = []
  for target, good in ((2.79, 0.5), (10.18, 0.8)):
    for seed in (0, 1):
      dirs.append(
        _fake_run(
          tmp_path / f"fl{target}{seed}",
          method="fedlap",
          label="FedLAP-DP (paper)",
          lr=0.05,
          seed=seed,
          target=target,
          accs=[0.1, 0.4 + 0.1 * seed],
          dp_method_label="FedLAP-DP",
        )
      )
      for lr, acc in ((0.1, 0.2), (1.0, good), (3.0, good - 0.1), (10.0, 2 * good - 0.7)):
        dirs.append(
          _fake_run(
            tmp_path / f"fa{target}{lr}{seed}",
            method="dp_fedavg",
            lr=lr,
            seed=seed,
            target=target,
            accs=[0.0, acc + 0.02 * seed],
            dp_method_label="DP-FedAvg",
          )
        )
  tables = report.make_report(dirs, tmp_path / "out", best_of_grid=True)
  _, cols, cells = tables["dp_eps2.79"]
  assert cols == ["FedLAP-DP (paper)", "DP-FedAvg"]
  text, mean, std, n = cells[("digits", "DP-FedAvg")]
  assert (round(mean, 6), round(std, 6), n) == (51.0, 1.0, 2)  # lr 1.0, not 0.1 or 3.0
  assert text.endswith("[learning_rate=1.0]")  # in the middle of the grid
  assert cells[("digits", "FedLAP-DP (paper)")][1] == pytest.approx(45.0)
  text, mean, _, _ = tables["dp_eps10.18"][2][("digits", "DP-FedAvg")]
  assert mean == pytest.approx(91.0) and text.endswith("[learning_rate=10.0, grid edge]")
  assert cells[("digits", "FedLAP-DP (paper)")][0] == "45.00 ± 5.00 (n=2)"
  grid = tables["grid"][2.79][("digits", "DP-FedAvg")]
  assert [(k, round(v[1], 6)) for k, v in grid.items()] == [  # in numeric order
    ("learning_rate=0.1", 21.0),
    ("learning_rate=1.0", 51.0),
    ("learning_rate=3.0", 41.0),
    ("learning_rate=10.0", 31.0),
  ]
  md = (tmp_path / "out" / "report.md").read_text()
  assert "accuracy at epsilon 2.79 (best of grid)" in md
  assert "accuracy at epsilon 10.18 (best of grid)" in md
  assert (
    "| digits | DP-FedAvg | learning_rate=1.0 | 51.00 ± 1.00 (n=2) | 81.00 ± 1.00 (n=2) |" in md
  )
  assert md.index("learning_rate=3.0 |") < md.index("learning_rate=10.0 |")
  assert "not covered by the epsilon" in md
  assert (tmp_path / "out" / "grid_dp.csv").read_text().count("\n") == 1 + 2 * 5


# --------------------------------------------------------------------------- one mechanism


def test_epsilon_for_selects_the_figure_a_target_calibrates():
  """dp.epsilon_for='replace_one' (default: the guarantee with public N_k) or 'add_remove' (the
  paper's notion): the same target gives different sigmas, each meeting its own figure."""
  cfg = quickstart.dp_config()
  replace = calibration.dp_budget(cfg, SIZES)
  assert replace.epsilon_for == "replace_one" and replace.mechanism.adjacency == "replace_one"
  sigma_r = replace.calibrate(5.0, field="dp.target_epsilon")
  cfg.dp.epsilon_for = "add_remove"
  add = calibration.dp_budget(cfg, SIZES)
  sigma_a = add.calibrate(5.0, field="dp.target_epsilon")
  assert add.mechanism == replace.mechanism and sigma_r != sigma_a
  mech = replace.mechanism
  assert 5.0 * (1 - 1e-3) <= mech.with_noise_multiplier(sigma_r).epsilon_after(10, 274) <= 5.0
  assert (
    5.0 * (1 - 1e-3)
    <= mech.with_noise_multiplier(sigma_a).epsilon_after(10, 274, adjacency="add_remove")
    <= 5.0
  )
  # One notion in every named config and suite: the guarantee, unless asked for explicitly.
  assert compare_dp.digits_paper().dp.epsilon_for == "replace_one"
  cfg.dp.epsilon_for = "either"
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_config(cfg)
  assert (err.value.field, err.value.value) == ("dp.epsilon_for", "either")


def _dp_configs():
  suite = quickstart_compare.get_config().suite
  return {
    "fedlap_dp": quickstart.dp_config(),
    "dp_fedavg": suite.dp_fedavg,
    "dp_fedprox": suite.dp_fedprox,
    "psg": suite.psg,
  }


@pytest.mark.parametrize("name", ["fedlap_dp", "dp_fedavg", "dp_fedprox", "psg"])
def test_calibration_and_the_algorithm_read_one_mechanism(name):
  """The mechanism the run's algorithm carries (its ledgers compose it) is the one calibration
  reads: the method declares T once."""
  cfg = _dp_configs()[name]
  setup = build.build_run(cfg)
  sizes = [len(i) for i in setup.client_indices]
  mech = setup.algorithm.mechanism
  assert (
    mech == library_configs.dp_mechanism(cfg, sizes) == calibration.dp_budget(cfg, sizes).mechanism
  )
  assert (mech.noise_multiplier, mech.delta, mech.batch_size) == (
    cfg.dp.noise_multiplier,
    cfg.dp.delta,
    cfg.client.batch_size,
  )
  assert setup.algorithm.dp_steps_per_round == mech.steps_per_round
  steps = {"fedlap_dp": 1 * 2 * 5, "psg": 500}.get(name, 2 * round(max(sizes) / 64))
  assert mech.steps_per_round == steps


@pytest.mark.parametrize(
  "overrides, builds",
  [([], 1), (["--config.dp.target_epsilon=5.0"], 2)],  # the calibrated sigma: built again
)
def test_a_runs_library_config_is_built_once_per_noise(overrides, builds, tmp_path, monkeypatch):
  """``experiments.run`` builds a run's library config once, checks and plan alike, and again
  only for the noise multiplier its calibration sets."""
  built, real = [], library_configs.library_config
  monkeypatch.setattr(
    library_configs, "library_config", lambda cfg, **kw: built.append(1) or real(cfg, **kw)
  )
  monkeypatch.setattr(train, "train_and_evaluate", lambda *a, **kw: {"records": [], "seconds": 0})
  argv = ["prog", "--config=quickstart:dp_loops", *overrides, f"--workdir={tmp_path}"]
  assert run.main(argv) == 0
  assert len(built) == builds
