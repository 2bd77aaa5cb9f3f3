"""FedDM, DSC and PSG through the experiment driver: they learn on the digits, PSG's epsilon is the
accountant's, their configs validate and bad settings are refused naming the config field.

Each learning run is the quickstart comparison's config (ConvNet 32 x 2, ipc 10) with shorter
loops: one compilation and a few seconds of rounds each.
"""

import json

import numpy as np
import pytest

from experiments import outputs, report, run, train

from fedlap_runs import build, configs, flags, library_configs
from fedlap_runs.configs import quickstart_compare, synthetic_baselines
from fedlap_jax import accounting

# Long runs of few programs: compiled for speed of execution (conftest).
pytestmark = pytest.mark.run_bound

CHANCE = 0.1


def shrunk(name, **overrides):
  """The quickstart comparison's ``name`` run, shorter (and PSG with a fixed sigma)."""
  cfg = quickstart_compare.get_config().suite[name]
  cfg.progress_bar = False
  cfg.plots = False
  cfg.seed = 0  # given (a DP run draws its seed otherwise)
  if name == "feddm":
    cfg.rounds = 2
    cfg.synthetic_init = "noise"  # only the matching can make the images informative
    cfg.feddm.image_updates = 20
    cfg.server.max_epochs = 50
  else:
    cfg.condense.networks = 4 if name == "psg" else 2
    cfg.condense.inner_loop = 10
    cfg.server.max_epochs = 100
  if name == "psg":
    cfg.condense.batch_loop = 5
    cfg.dp.match_epsilon_of = ""
    cfg.dp.noise_multiplier = 1.0
  for field, value in overrides.items():
    node = cfg
    *parents, leaf = field.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for name in ("feddm", "dsc", "dsc_centralized", "psg"):
    workdir = tmp_path_factory.mktemp(name)
    result = train.train_and_evaluate(shrunk(name), workdir, config_name=name)
    out[name] = (workdir, result)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["feddm", "dsc", "dsc_centralized", "psg"])
def test_each_system_learns_on_the_digits(runs, name):
  workdir, result = runs[name]
  records = result["records"]
  assert len(records) == (2 if name == "feddm" else 1)
  assert records[-1]["test_accuracy"] > 4 * CHANCE, records[-1]
  info = json.loads((workdir / "run_info.json").read_text())
  upload = info["upload_floats_per_client"]
  if name == "dsc_centralized":  # the raw data pooled: the largest client's records
    assert upload == max(info["client_sizes"]) * 64
  else:  # ipc 10 x 2 classes x 8 x 8 pixels
    assert upload == 10 * 2 * 64
  assert (workdir / "synthetic" / f"round_{len(records):04d}.npz").exists()
  assert (workdir / "checkpoints").is_dir()


@pytest.mark.slow
def test_psg_epsilon_is_the_accountants_for_its_q_sigma_and_t(runs):
  workdir, result = runs["psg"]
  cfg = shrunk("psg")
  info = json.loads((workdir / "run_info.json").read_text())
  t = cfg.condense.networks * cfg.condense.outer_loop * cfg.condense.batch_loop
  assert info["steps_per_round"] == t == 4 * 10 * 5
  want = accounting.epsilon_after_rounds(
    rounds=1,
    noise_multiplier=1.0,
    batch_size=cfg.client.batch_size,
    min_client_size=min(info["client_sizes"]),
    steps_per_round=t,
    delta=cfg.dp.delta,
    adjacency="add_remove",  # the paper's figure
  )
  # The paper's add/remove figure, under its explicit name (the headline is replace-one).
  assert result["records"][-1]["epsilon_add_remove"] == pytest.approx(want, rel=1e-9)
  ledger = json.loads((workdir / "privacy_ledger.json").read_text())
  assert ledger["rounds"] == 1 and ledger["epsilons_add_remove"][-1] == pytest.approx(
    want, rel=1e-9
  )
  assert (
    result["records"][-1]["epsilon"]
    == ledger["epsilons"][-1]
    == pytest.approx(
      accounting.epsilon_after_rounds(
        rounds=1,
        noise_multiplier=1.0,
        batch_size=cfg.client.batch_size,
        min_client_size=min(info["client_sizes"]),
        steps_per_round=t,
        delta=cfg.dp.delta,
        adjacency="replace_one",
      ),
      rel=1e-9,
    )
  )
  # The noisy real-data accesses really happened, T of them on every client.
  assert result["records"][-1]["client.real_accesses"] == [float(t)] * 5


@pytest.mark.slow
def test_report_puts_them_in_the_tables_with_their_cost(runs, tmp_path):
  tables = report.make_report([runs[n][0] for n in runs], tmp_path, epsilons=(2.79, 1e3))

  def cost(name):
    info = json.loads((runs[name][0] / "run_info.json").read_text())
    return report.cost_label(info["upload_floats_per_client"] / info["num_params"])

  assert cost("feddm") == "0.117x" and cost("dsc_centralized") == "1.65x"
  _, cols, cells = tables["nondp"]
  assert cols == [
    f"FedDM ({cost('feddm')})",
    f"DSC federated ({cost('dsc')})",
    f"DSC centralized ({cost('dsc_centralized')})",
  ]
  acc = 100 * runs["feddm"][1]["records"][-1]["test_accuracy"]
  assert cells[("digits", cols[0])][1] == pytest.approx(acc)
  _, cols, cells = tables["dp_final"]
  assert cols == [f"PSG ({cost('psg')})"]
  # PSG's epsilon is the guarantee (replace-one), as every named config's; its paper sigma's
  # add/remove figure stands beside it in the records.
  key = report.Run(runs["psg"][0]).epsilon_key
  assert key == "epsilon"
  eps = runs["psg"][1]["records"][-1][key]
  assert eps > runs["psg"][1]["records"][-1]["epsilon_add_remove"]  # replace-one costs more
  assert cells[("digits", cols[0])][0].endswith(f", ε={eps:.3g})")
  assert (
    tables["dp_eps1000"][2][("digits", cols[0])][0]
    == cells[("digits", cols[0])][0].split(", ε")[0] + ")"
  )
  assert eps > 2.79 and tables["dp_eps2.79"][2][("digits", cols[0])][0] == "-"
  assert "DP, final accuracy at the epsilon spent" in (tmp_path / "report.md").read_text()
  lines = (tmp_path / "runs.csv").read_text().splitlines()
  assert (
    lines[0].endswith(
      "upload_floats_per_client,upload_vs_model,first_round_seconds,later_round_seconds"
    )
    and len(lines) == 5
  )


# ------------------------------------------------------------------ configs


NAMES = [f"{ds}_{m}" for ds in ("mnist", "fmnist", "cifar") for m in ("feddm", "dsc", "psg")]


@pytest.mark.parametrize("name", NAMES)
def test_named_configs_validate_with_the_published_settings(name):
  cfg = configs.load(name)
  library_configs.validate_config(cfg)
  path, label = flags.resolve_config_arg(name)
  assert path.startswith(str(flags.CONFIG_DIR)) and label == name
  if name.endswith("feddm"):
    fedlap = configs.load(f"{name.split('_')[0]}_nondp")
    core = library_configs.library_config(cfg)
    # FedLAP's partition, ipc and rounds: equal upload (0.96x on CIFAR-10).
    assert (cfg.data.partition, cfg.client.ipc, cfg.rounds) == (
      fedlap.data.partition,
      fedlap.client.ipc,
      fedlap.rounds,
    )
    assert (core.image_updates, core.rho, core.image_lr, core.batch_size) == (1000, 5.0, 1.0, 256)
    assert (core.server.max_epochs, core.server.momentum, core.learning_rate) == (500, 0.9, 0.01)
  else:
    core = library_configs.library_config(cfg)
    assert cfg.rounds == 1 and core.condensation.networks == 1000
    assert core.condensation.image_lr == 0.1 and core.condensation.net_lr == 0.01
  if name.endswith("dsc"):
    assert core.method == "dsc_centralized" and core.condensation.ipc == 50
    assert (core.condensation.outer_loop, core.condensation.inner_loop) == (50, 10)
    assert core.condensation.classwise and core.dp is None


@pytest.mark.parametrize(
  "variant, method, ipc",
  [
    ("", "dsc_centralized", 50),
    ("10", "dsc_centralized", 10),
    ("federated", "dsc", 50),
    ("federated10", "dsc", 10),
    ("centralized50", "dsc_centralized", 50),
  ],
)
def test_dsc_variants(variant, method, ipc):
  cfg = synthetic_baselines.get_dsc_config("cifar", variant)
  library_configs.validate_config(cfg)
  assert (cfg.method, cfg.client.ipc) == (method, ipc)
  assert library_configs.library_config(cfg).condensation.outer_loop == (10 if ipc == 10 else 50)


def test_bad_dsc_variant_is_refused():
  with pytest.raises(ValueError, match="allowed"):
    synthetic_baselines.get_dsc_config("cifar", "federated20")


@pytest.mark.parametrize("dataset", ["mnist", "fmnist", "cifar"])
def test_psg_sigma_gives_epsilon_32_in_the_federated_setting(dataset):
  cfg = synthetic_baselines.get_psg_config(dataset)
  core = library_configs.library_config(cfg)
  t = core.condensation.real_accesses_per_round
  assert t == 1000 * 10 * 10 and core.condensation.batch_size == 256
  eps = accounting.epsilon_after_rounds(
    rounds=1,
    noise_multiplier=cfg.dp.noise_multiplier,
    batch_size=256,
    min_client_size=synthetic_baselines.MIN_CLIENT_SIZE[dataset],
    steps_per_round=t,
    delta=1e-5,
    adjacency="add_remove",  # the paper's figure
  )
  assert 31.9 < eps <= synthetic_baselines.PSG_TARGET_EPSILON
  assert (cfg.dp.l2_clip_norm, core.condensation.classwise) == (0.1, False)


@pytest.mark.parametrize(
  "method, field, value, path",
  [
    ("dsc", "rounds", 2, "rounds"),
    ("feddm", "dp.enabled", True, "dp.enabled"),
    ("psg", "dp.enabled", False, "dp.enabled"),
    ("dsc", "condense.networks", 0, "condense.networks"),
    ("dsc", "condense.lr_decay", 2.0, "condense.lr_decay"),
    ("dsc", "client.ipc", 7, "client.ipc"),  # no published loops for ipc 7 (loops left None)
    ("feddm", "feddm.rho", -1.0, "feddm.rho"),
    ("feddm", "feddm.image_updates", 0, "feddm.image_updates"),
    ("feddm", "server.radius_strategy", "min", "server.radius_strategy"),
    ("psg", "synthetic_init", "real", "synthetic_init"),
    ("psg", "server.weighting", "size", "server.weighting"),
    ("dsc", "server.momentum", 1.5, "server.momentum"),
    # The images' optimiser: a spec beside a non-zero momentum (one source), a bad spec, or
    # one in the section of another method (it would be ignored).
    ("feddm", "feddm.image_optimizer.name", "adam", "feddm.image_momentum"),
    ("feddm", "feddm.image_optimizer.name", "nadam", "feddm.image_optimizer.name"),
    ("feddm", "feddm.image_optimizer.momentum", 0.9, "feddm.image_optimizer"),
    ("dsc", "condense.image_optimizer.name", "yogi", "condense.image_momentum"),
    ("psg", "condense.image_optimizer.b1", 0.5, "condense.image_optimizer.b1"),
    ("feddm", "condense.image_optimizer.name", "adam", "condense.image_optimizer"),
    ("dsc", "feddm.image_optimizer.name", "adam", "feddm.image_optimizer"),
    ("feddm", "client.image_optimizer.name", "adam", "client.image_optimizer"),
    ("feddm", "server.carry_state", True, "server.carry_state"),
  ],
)
def test_bad_settings_name_the_config_field(method, field, value, path):
  cfg = quickstart_compare.get_config().suite[method]
  cfg.dp.match_epsilon_of = ""
  cfg.data.normalisation = "test_split"  # DP-safe: dp.enabled=True fails on the method alone
  cfg.condense.outer_loop = cfg.condense.inner_loop = None  # the published loops for client.ipc
  library_configs.validate_config(cfg)
  *parents, leaf = field.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_config(cfg)
  assert err.value.field == path, str(err.value)
  assert str(err.value).startswith(f"{path}=") and "allowed" in str(err.value)


def test_ipc_larger_than_a_class_is_refused_with_real_initialisation():
  cfg = quickstart_compare.get_config().suite.feddm
  cfg.client.ipc = 500
  with pytest.raises(library_configs.ConfigError) as err:
    build.build_run(cfg)
  assert err.value.field == "client.ipc" and "synthetic_init='real'" in str(err.value)
  np.testing.assert_equal(err.value.value, 500)


@pytest.mark.parametrize(
  "config, arg, message",
  [
    (
      "mnist_psg",
      "--config.dp.enabled=False",
      "dp.enabled=False is invalid; allowed: True for method='psg'",
    ),
    ("mnist_feddm", "--config.feddm.rho=-1.0", "feddm.rho=-1.0 is invalid; allowed: "),
    ("cifar_dsc", "--config.rounds=3", "rounds=3 is invalid; allowed: 1 for method="),
    (
      "cifar_psg",
      "--config.condense.networks=0",
      "condense.networks=0 is invalid; allowed: an integer >= 1",
    ),
    (
      "fmnist_psg",
      "--config.client.poisson_capacity=256",
      "client.poisson_capacity=256 is invalid; allowed: None (the default",
    ),
  ],
)
def test_cli_refuses_bad_settings_in_one_line_with_exit_2(config, arg, message, tmp_path, capsys):
  assert run.main(["prog", f"--config={config}", arg, f"--workdir={tmp_path / 'run'}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {config}: {message}") and err.count("\n") == 1, err
  assert not (tmp_path / "run").exists()


def test_psg_metrics_leave_raw_statistics_out_of_a_dp_record():
  """PSG's clip fraction, realised batch sizes and extra chunks are raw statistics of the
  records: a DP run releases the rest and keeps these for debug_nonprivate_stats."""
  from fedlap_jax.methods.condensation import one_shot as condensation  # pylint: disable=g-import-not-at-top

  k = 3
  client = condensation.CondensationMetrics(
    matching_loss=np.ones((k, 4), np.float32),
    real_accesses=np.full(k, 200, np.int32),
    poisson_extra_chunks=np.zeros(k, np.int32),
    mean_batch_size=np.full(k, 63.0),
    clip_fraction=np.full(k, 0.9),
  )
  metrics = condensation.OneShotMetrics(
    client, np.int32(300), np.int32(600), np.float32(1.5), np.float32(0.01)
  )
  released, nonprivate = outputs.summarize_metrics(metrics, k, private=True)
  assert set(released) == {
    "client.matching_loss",
    "client.real_accesses",
    "server_epochs",
    "server_steps",
    "server_distance",
    "learning_rate",
  }
  assert set(nonprivate) == {
    "client.poisson_extra_chunks",
    "client.mean_batch_size",
    "client.clip_fraction",
  }
  everything, none = outputs.summarize_metrics(metrics, k, private=False)
  assert set(everything) == set(released) | set(nonprivate) and none == {}


@pytest.mark.parametrize(
  ("method", "resolved"), [("feddm", "size"), ("dsc", "size"), ("psg", "uniform")]
)
def test_server_weighting_none_is_the_documented_default_for_feddm_dsc_and_psg(method, resolved):
  """``server.weighting=None`` means ``uniform`` with DP and ``size`` without, for every method
  whose config holds a server (FedLAP's rule): the library config resolves it when it is built,
  so no round meets a ``None`` weighting."""
  cfg = shrunk(method, **{"server.weighting": None})
  built = library_configs.library_config(cfg, max_client_size=400)
  assert built.server.weighting == resolved


def tiny_run(method: str) -> list[str]:
  """``method`` on ``quickstart:nondp`` at its smallest through the command line (ConvNet 8 x 1,
  one round, one image a class): the tests below that run FedDM share its programs."""
  return [
    "--config=quickstart:nondp",
    f"--config.method={method}",
    "--config.server.radius_strategy=fixed",
    "--config.rounds=1",
    "--config.model.width=8",
    "--config.model.depth=1",
    "--config.client.ipc=1",
    "--config.feddm.image_updates=3",
    "--config.condense.networks=1",
    "--config.condense.outer_loop=2",
    "--config.condense.inner_loop=1",
    "--config.server.max_epochs=2",
    "--config.progress_bar=False",
    "--config.plots=False",
  ]


@pytest.mark.slow
def test_the_images_optimiser_is_a_config_of_experiments_run(tmp_path):
  """``feddm.image_optimizer`` / ``condense.image_optimizer`` chosen on the command line (Adam
  at the section's ``image_lr``, its ``image_momentum`` at 0) is the images' optimiser of the
  method's library config; FedDM's run with it changes its synthetic images and result, the
  run's config holds the choice, and a checkpoint's config from before the field ran with plain
  SGD (the default). That the library config's optimiser is the one the clients' matching steps
  (FedDM's and DSC's alike): ``tests/unit/test_condensation.py``."""
  from experiments import resume  # pylint: disable=g-import-not-at-top

  def adam(section):
    return [
      f"--config.{section}.image_optimizer.name=adam",
      f"--config.{section}.image_momentum=0.0",
      f"--config.{section}.image_lr=0.05",
    ]

  for method, section in (("feddm", "feddm"), ("dsc", "condense")):
    cfg = flags.parse_argv(["prog", *tiny_run(method), *adam(section)])[0].config
    built = library_configs.library_config(cfg, max_client_size=400)
    images = built if method == "feddm" else built.condensation
    assert (images.image_optimizer.name, images.image_momentum, images.image_lr) == (
      "adam",
      0.0,
      0.05,
    )
    assert resume.ADDED_FIELDS[f"{section}.image_optimizer.name"] == "sgd"

  tiny = tiny_run("feddm")
  images, records = {}, {}
  for name, extra in (("sgd", []), ("adam", adam("feddm"))):
    workdir = tmp_path / name
    assert run.main(["prog", *tiny, *extra, f"--workdir={workdir}"]) == 0
    records[name] = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    with np.load(workdir / "synthetic" / "round_0001.npz") as z:
      images[name] = {k: z[k] for k in z.files}
  assert records["sgd"]["test_loss"] != records["adam"]["test_loss"]
  x = [k for k in images["sgd"] if k.endswith("x")]
  assert x and not all(np.array_equal(images["sgd"][k], images["adam"][k]) for k in x)
  config = json.loads((tmp_path / "adam" / "config.json").read_text())
  assert config["feddm"]["image_optimizer"]["name"] == "adam"
