"""Named configs, the config -> core converter, and static + data validation."""

import dataclasses
import re

import numpy as np
import pytest

from fedlap_jax import accounting
from fedlap_jax import dp_config
from fedlap_jax.methods.fedlap import config as core

from conftest import raises_field
from fedlap_runs import data as data_lib
from experiments import run
from fedlap_runs import flags, library_configs
from fedlap_runs import configs
from fedlap_runs.configs import default, quickstart

NAMED = [
  ("mnist_nondp", None),
  ("mnist_dp", None),
  ("fmnist_nondp", None),
  ("fmnist_dp", None),
  ("cifar_nondp", None),
  ("cifar_dp", None),
  ("quickstart", None),
  ("quickstart", "dp"),
  ("quickstart", "dp_loops"),
  ("quickstart", "nondp"),
  ("quickstart_nondp", None),
  ("cifar_iid", None),
  ("cifar_iid", "dp"),
  ("mnist_dp_tuned", None),
  ("fmnist_dp_tuned", None),
  ("cifar_dp_tuned", None),
  ("digits_dp_tuned", None),
  ("digits_dp_hybrid", None),
  ("mnist_dp_hybrid", None),
  ("fmnist_dp_hybrid", None),
]
NAMED += [("cifar_ablation_radius", s) for s in ("min", "max", "median", "fixed")]
NAMED += [("cifar_ablation_ipc", str(i)) for i in (10, 20, 50, 100, 150, 200)]
NAMED += [("cifar_ablation_fraction", str(p)) for p in (5, 10, 50, 100)]


def load(name, arg=None):
  return configs.load(name if arg is None else f"{name}:{arg}")


@pytest.mark.parametrize("name,arg", NAMED)
def test_every_named_config_builds_and_validates(name, arg):
  cfg = load(name, arg)
  runs = [cfg.suite[k] for k in cfg.suite.keys()] if "suite" in cfg else [cfg]
  for c in runs:
    library_configs.validate_config(c)
    fc = library_configs.library_config(c)
    assert (fc.dp is not None) == c.dp.enabled
  path, label = flags.resolve_config_arg(name + (f":{arg}" if arg else ""))
  assert path.startswith(str(flags.CONFIG_DIR))
  assert label == name + (f"_{arg}" if arg else "")


def test_published_settings_equal_the_core_paper_configs():
  assert library_configs.library_config(load("cifar_nondp")) == core.paper_nondp_config()
  dp = library_configs.library_config(load("cifar_dp"))
  assert dp == core.paper_dp_config()
  assert dp.client.real_accesses_per_round == 200
  for name in ("mnist_dp", "fmnist_dp"):
    assert library_configs.library_config(load(name)) == core.paper_dp_config()
  assert load("mnist_nondp").data.name == "mnist"
  assert load("fmnist_dp").data.name == "fashion_mnist"


def test_ablation_values():
  assert load("cifar_ablation_ipc", "150").client.ipc == 150
  assert load("cifar_ablation_fraction", "5").data.train_fraction == pytest.approx(0.05)
  fixed = library_configs.library_config(load("cifar_ablation_radius", "fixed"))
  assert fixed.server.radius_strategy == "fixed" and not fixed.client.calibrate_radius
  assert load("cifar_iid").data.partition == "iid"
  with pytest.raises(ValueError, match="allowed"):
    load("cifar_ablation_radius", "average")
  with pytest.raises(ValueError, match="percentage"):
    load("cifar_ablation_fraction", "0")


@pytest.mark.parametrize(
  "name,expected", [("auto", "map"), ("vmap", "vmap"), ("map", "map"), ("shard", "shard")]
)
def test_client_backend_auto_runs_clients_one_by_one(name, expected):
  from fedlap_jax.dispatch import resolve_client_backend  # pylint: disable=g-import-not-at-top

  assert default.get_config().client_backend == "auto"
  assert resolve_client_backend(name) == expected


def test_config_sections_map_one_to_one_onto_the_core_dataclasses():
  cfg = default.get_config()
  for section, cls, skip in (
    ("client", core.ClientConfig, {"dp"}),
    ("server", core.ServerConfig, set()),
    ("dp", dp_config.DPConfig, set()),
  ):
    names = {f.name for f in dataclasses.fields(cls)} - skip
    assert names <= set(cfg[section].keys()), (section, names - set(cfg[section].keys()))


def test_quickstart_matches_the_recipe():
  suite = quickstart.get_config().suite
  assert sorted(suite.keys()) == ["fedlap", "fedlap_dp"]
  # The DP default is the hybrid recipe (digits_dp_hybrid); the older loops stay as dp_loops.
  assert suite.fedlap_dp == quickstart.get_config("dp") == load("digits_dp_hybrid")
  assert library_configs.library_config(suite.fedlap_dp).client.model_steps == "noisy_real"
  assert suite.fedlap == load("quickstart_nondp")
  assert quickstart.get_config("dp_loops") == quickstart.dp_config()
  fc = library_configs.library_config(quickstart.get_config("dp_loops"))
  assert fc.dp == dp_config.DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
  assert (
    fc.client.ipc,
    fc.client.max_outer,
    fc.client.batch_loop,
    fc.client.inner_loop,
    fc.client.batch_size,
    fc.rounds,
    fc.learning_rate,
  ) == (10, 2, 5, 1, 64, 10, 0.05)
  # digits_dp_tuned is the quickstart's FedLAP-DP with the tuned recipe.
  tc = library_configs.library_config(load("digits_dp_tuned"))
  assert tc.dp == dp_config.DPConfig(noise_multiplier=2.38, l2_clip_norm=1.0, delta=1e-5)
  assert (
    tc.client.ipc,
    tc.client.max_outer,
    tc.client.batch_loop,
    tc.client.inner_loop,
    tc.client.batch_size,
    tc.rounds,
    tc.learning_rate,
  ) == (10, 2, 10, 5, 46, 3, 0.2)
  assert tc.client.average_targets and tc.lr_schedule == "cosine_open"
  nd = library_configs.library_config(quickstart.get_config("nondp"))
  assert nd.dp is None and nd.client.calibrate_radius and nd.client.image_lr == 10.0


def _override(cfg, field, value):
  node = cfg
  *parents, leaf = field.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value


# (overrides on quickstart (DP) or quickstart_nondp, expected message fragments)
BAD = [
  ("dp", {"method": "fedlapp"}, ["method='fedlapp'", "fedavg"]),
  ("dp", {"data.name": "svhn"}, ["data.name='svhn'", "cifar10"]),
  ("dp", {"data.source": "hdf5:/x"}, ["data.source='hdf5:/x'", "npz:PATH"]),
  ("dp", {"data.source": "npz:/no/such/file.npz"}, ["data.source", "existing"]),
  ("dp", {"data.source": "tfds"}, ["data.source='tfds'", "digits"]),
  ("dp", {"data.partition": "pathological"}, ["data.partition='pathological'", "dirichlet"]),
  ("dp", {"data.dirichlet_alpha": 0.0}, ["data.dirichlet_alpha=0.0", "> 0"]),
  ("dp", {"data.num_clients": 0}, ["data.num_clients=0", ">= 1"]),
  ("dp", {"data.train_fraction": 1.5}, ["data.train_fraction=1.5", "(0, 1]"]),
  ("dp", {"data.train_fraction": 0.0}, ["data.train_fraction=0.0"]),
  ("dp", {"model.norm": "batch"}, ["model.norm='batch'", "instance"]),
  ("dp", {"model.width": 0}, ["model.width=0"]),
  ("dp", {"model.conv_bias": None}, ["model.conv_bias=None", "True or False"]),
  ("dp", {"seed": -1}, ["seed=-1"]),
  ("dp", {"data.partition_seed": -1}, ["data.partition_seed=-1", ">= 0 (public)"]),
  ("dp", {"termination_grace_seconds": -1.0}, ["termination_grace_seconds=-1.0", ">= 0"]),
  ("dp", {"rounds": 0}, ["rounds=0", ">= 1"]),
  ("dp", {"learning_rate": 0.0}, ["learning_rate=0.0", "> 0"]),
  ("dp", {"learning_rate": -0.1}, ["learning_rate=-0.1"]),
  ("dp", {"client.ipc": 0}, ["client.ipc=0", ">= 1"]),
  ("dp", {"lr_schedule": "step"}, ["lr_schedule='step'", "cosine_open"]),
  ("dp", {"client.radius": -1.0}, ["client.radius=-1.0", "> 0"]),
  ("dp", {"client.radius": 0.0}, ["client.radius=0.0"]),
  ("dp", {"client.batch_size": 0}, ["client.batch_size=0"]),
  ("dp", {"client.image_lr": 0.0}, ["client.image_lr=0.0"]),
  ("dp", {"client.dsa_strategy": "color_blur"}, ["client.dsa_strategy", "blur"]),
  ("dp", {"server.dsa_strategy": "blur"}, ["server.dsa_strategy", "blur"]),
  ("dp", {"client.real_dsa_strategy": "spin"}, ["client.real_dsa_strategy='spin'", "spin"]),
  ("dp", {"server.radius_strategy": "average"}, ["server.radius_strategy='average'", "median"]),
  ("dp", {"server.radius_strategy": "min"}, ["server.radius_strategy='min'", "DP is on"]),
  ("dp", {"synthetic_init": "real"}, ["synthetic_init='real'", "noise"]),
  ("dp", {"dp.noise_multiplier": 0.0}, ["dp.noise_multiplier=0.0", "no privacy guarantee"]),
  ("dp", {"dp.noise_multiplier": -1.0}, ["dp.noise_multiplier=-1.0"]),
  ("dp", {"dp.l2_clip_norm": 0.0}, ["dp.l2_clip_norm=0.0"]),
  ("dp", {"dp.delta": 0.0}, ["dp.delta=0.0", "(0, 1/2)"]),
  ("dp", {"dp.delta": 1.0}, ["dp.delta=1.0"]),
  ("dp", {"client.calibrate_radius": True}, ["client.calibrate_radius=True", "not private"]),
  ("dp", {"method": "fedavg"}, ["dp.enabled=True", "dp_fedavg"]),
  ("nondp", {"method": "dp_fedprox"}, ["dp.enabled=False", "True for method='dp_fedprox'"]),
  ("dp", {"client_backend": "pmap"}, ["client_backend='pmap'", "vmap"]),
  ("dp", {"checkpoint_every": 0}, ["checkpoint_every=0"]),
  ("dp", {"snapshot_rounds": (0,)}, ["snapshot_rounds=(0,)"]),
  ("dp", {"baseline.local_epochs": 0}, ["baseline.local_epochs=0"]),
  (
    "nondp",
    {"server.radius_strategy": "median", "client.calibrate_radius": False},
    ["client.calibrate_radius=False", "median"],
  ),
  # DP-safe normalisation, exact Poisson buffers, 1/K weighting under DP.
  (
    "dp",
    {"data.normalisation": "auto"},
    [
      "data.normalisation='auto' is invalid",
      "('published', 'given', 'test_split') with DP",
      "private training split",
    ],
  ),
  ("dp", {"data.normalisation": "train_split"}, ["data.normalisation='train_split'", "with DP"]),
  ("dp", {"data.normalisation": "published"}, ["data.normalisation='published'", "digits"]),
  ("dp", {"data.normalisation": "minmax"}, ["data.normalisation='minmax'", "test_split"]),
  ("dp", {"data.normalisation": "given"}, ["data.mean=None", "one per channel"]),
  (
    "dp",
    {"data.normalisation": "given", "data.mean": (0.3,), "data.std": (0.0,)},
    ["data.std=(0.0,)", "> 0"],
  ),
  ("dp", {"data.mean": (0.3,)}, ["data.mean=(0.3,)", "data.normalisation='given'"]),
  (
    "dp",
    {"client.batch_size": 64, "client.poisson_capacity": 64},
    ["client.poisson_capacity=64 is invalid", ">= 88", "overflows often"],
  ),
  (
    "dp",
    {"server.weighting": "size"},
    ["server.weighting='size' is invalid", "'uniform' or None when DP is on", "1/K"],
  ),
  (
    "dp",
    {"method": "dp_fedavg", "server.weighting": "size"},
    ["server.weighting='size' is invalid", "'uniform' or None"],
  ),
  (
    "dp",
    {"method": "dp_fedprox", "client.batch_size": 64, "client.poisson_capacity": 70},
    ["client.poisson_capacity=70 is invalid", ">= 88"],
  ),
]


@pytest.mark.parametrize("base,overrides,fragments", BAD, ids=[str(b[1]) for b in BAD])
def test_invalid_config_is_rejected_with_field_value_and_allowed(base, overrides, fragments):
  cfg = quickstart.dp_config() if base == "dp" else quickstart.nondp_config()
  for field, value in overrides.items():
    _override(cfg, field, value)
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_config(cfg)
  msg = str(err.value)
  assert "allowed" in msg or "Allowed" in msg or "allowed families" in msg
  for fragment in fragments:
    assert fragment in msg, msg


# ------------------------------------------------------------ data-dependent


@pytest.fixture(scope="module")
def digits():
  cfg = quickstart.dp_config()
  ds = data_lib.load_dataset(cfg.data)
  return ds, data_lib.client_split(ds, cfg.data)


def _data_error(cfg, ds, idx):
  library_configs.validate_config(cfg)
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_data(cfg, ds, idx)
  return str(err.value)


def test_valid_data_passes(digits):
  ds, idx = digits
  for cfg in (quickstart.dp_config(), quickstart.nondp_config()):
    library_configs.validate_data(cfg, ds, idx)


def test_batch_size_larger_than_smallest_client(digits):
  ds, idx = digits
  cfg = quickstart.dp_config()
  cfg.client.batch_size = 275
  msg = _data_error(cfg, ds, idx)
  assert "client.batch_size=275" in msg and "at most 274" in msg and "client 2" in msg


def test_client_with_no_data(digits):
  ds, idx = digits
  msg = _data_error(quickstart.dp_config(), ds, [idx[0], np.array([], np.int64)] + idx[2:])
  assert "client 1 has no data" in msg and "allowed" in msg


def test_ipc_larger_than_a_class_with_real_init(digits):
  ds, idx = digits
  cfg = quickstart.nondp_config()
  cfg.client.ipc = 200
  msg = _data_error(cfg, ds, idx)
  assert "client.ipc=200" in msg and "synthetic_init='real'" in msg and "at most" in msg
  cfg = quickstart.dp_config()  # noise init draws no real records: allowed
  cfg.client.ipc = 200
  library_configs.validate_data(cfg, ds, idx)


def test_class_no_client_holds(digits):
  ds, idx = digits
  drop = [i[ds.y_train[i] != 3] for i in idx]
  msg = _data_error(quickstart.dp_config(), ds, drop)
  assert "class 3" in msg and "no synthetic label covers it" in msg


def test_model_too_deep_for_the_images(digits):
  ds, idx = digits
  cfg = quickstart.dp_config()
  cfg.model.depth = 4
  msg = _data_error(cfg, ds, idx)
  assert "model.depth=4" in msg and "at most 3" in msg


def test_paper_partition_needs_a_divisor_of_the_classes(digits):
  ds, _ = digits
  with raises_field("data.num_clients") as err:
    data_lib.partition(ds.y_train, num_clients=3, scheme="paper", num_classes=10)
  assert err.value.value == 3 and "a divisor of 10" in err.value.allowed


# ------------------------------------------------------------------- CLI


def test_cli_rejects_bad_override(tmp_path, capsys):
  rc = run.main(
    ["prog", "--config=quickstart:dp", "--config.client.ipc=0", f"--workdir={tmp_path}"]
  )
  assert rc == 2
  assert "client.ipc=0 is invalid; allowed: an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
  "arg,fragment", [("--config.client.ipcc=3", "ipcc"), ("--config.client.ipc=abc", "abc")]
)
def test_cli_rejects_unknown_field_and_bad_type(tmp_path, capsys, arg, fragment):
  rc = run.main(["prog", "--config=quickstart:dp", arg, f"--workdir={tmp_path}"])
  assert rc == 2
  assert fragment in capsys.readouterr().err


def test_cli_unknown_config_name_lists_the_available_ones(capsys):
  assert run.main(["prog", "--config=cifar_pd"]) == 2  # was 1 (a SystemExit with a message)
  err = capsys.readouterr().err
  assert re.fullmatch(
    r"error: --config='cifar_pd' is invalid: no fedlap_runs/configs/cifar_pd.py;"
    r" allowed: one of \[.*'cifar_dp'.*\] \(optionally NAME:ARG\), or a path to a config \.py "
    r"file\n",
    err,
    re.S,
  ), err


def test_cli_says_how_to_set_a_field_of_a_suite_run(tmp_path, capsys):
  assert run.main(["prog", "--config=quickstart", "--config.seed=1", f"--workdir={tmp_path}"]) == 2
  assert capsys.readouterr().err == (
    "error: --config.seed=1: quickstart is a suite of the runs ['fedlap', 'fedlap_dp']; a run's "
    "field is set as --config.suite.RUN.FIELD=VALUE (e.g. --config.suite.fedlap.seed=1)\n"
  )
  config, _ = flags.load_config("quickstart", ["suite.fedlap.seed=1"])  # the way it says
  assert config.suite.fedlap.seed == 1 and config.suite.fedlap_dp.seed == 0
  assert list(tmp_path.iterdir()) == []  # refused before anything ran


@pytest.mark.parametrize(
  "field,typo,suggestion", [("roundz", "roundz", "rounds"), ("client.ipcc", "ipcc", "ipc")]
)
def test_cli_a_typo_on_a_suite_gets_the_single_configs_suggestion(
  tmp_path, capsys, field, typo, suggestion
):
  for name in ("quickstart", "quickstart:nondp"):
    assert (
      run.main(["prog", f"--config={name}", f"--config.{field}=3", f"--workdir={tmp_path}"]) == 2
    )
    err = capsys.readouterr().err
    assert f'"{suggestion}" instead of "{typo}"' in err, err
    assert f"suite.fedlap.{field}" not in err, err  # the typo is not repeated as the way to go
  assert list(tmp_path.iterdir()) == []


def test_cli_names_a_label_outside_the_datasets_classes(tmp_path, capsys):
  x, y, x_test, y_test = data_lib.load_digits()
  y = y.copy()
  y[7] = 12
  path = tmp_path / "bad.npz"
  np.savez(path, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  argv = ["prog", "--config=quickstart:nondp", f"--config.data.source=npz:{path}"]
  assert run.main(argv + [f"--workdir={tmp_path / 'w'}"]) == 2
  err = capsys.readouterr().err
  assert "y_train" in err and "[12]" in err and "[0, 9]" in err, err
  assert "num_clients" not in err, err


def test_cli_a_config_argument_its_file_refuses_is_one_line(capsys):
  assert run.main(["prog", "--config=quickstart:bogus"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --config='quickstart:bogus' is invalid: quickstart:bogus is ")
  assert err.count("\n") == 1 and "Traceback" not in err and "allowed: one of (" in err


def test_cli_help_lists_every_config_name_and_exits_0(capsys):
  for argv in (["prog", "--help"], ["prog", "-h"], ["prog", "--config=quickstart", "--help"]):
    assert run.main(argv) == 0, argv
    out = capsys.readouterr().out
    assert out.startswith("Runs one experiment from a named config.")
    listed = out.split("NAME is one of (fedlap_runs/configs/ and its aliases):", 1)[1]
    assert re.split(r"[,\s]+", listed.strip()) == list(configs.names())
  # Without --config: the same text on stderr, a one-line error, exit status 2.
  assert run.main(["prog"]) == 2
  err = capsys.readouterr().err
  assert "NAME is one of" in err
  assert err.endswith("error: --config=NAME is required (--help: this text)\n")


def test_dp_normalisation_choices_that_read_no_training_record_pass():
  for overrides in (
    {"data.normalisation": "test_split"},
    {"data.normalisation": "given", "data.mean": (0.3,), "data.std": (0.4,)},
    {"data.name": "mnist", "data.source": "tfds", "data.normalisation": "auto"},
  ):
    cfg = quickstart.dp_config()
    for field, value in overrides.items():
      _override(cfg, field, value)
    library_configs.validate_config(cfg)
  nondp = quickstart.nondp_config()
  assert nondp.data.normalisation == "auto"  # train_split for digits: allowed without DP
  library_configs.validate_config(nondp)


def test_cli_resolves_names_args_and_default_workdir():
  argv, name = flags.rewrite_argv(["prog", "--config", "cifar_ablation_ipc:20", "--x=1"])
  assert argv[1] == "--config" and argv[2].endswith("configs/fedlap.py:cifar_ablation_ipc:20")
  assert name == "cifar_ablation_ipc_20" and argv[3] == "--x=1"


def test_suite_validates_every_run_first_then_runs_each_and_compares(tmp_path, capsys, monkeypatch):
  from experiments import report, train  # pylint: disable=g-import-not-at-top

  calls, reports = [], []

  def fake_train(cfg, workdir, config_name="", built=None):
    del built
    calls.append((config_name, str(workdir), cfg.dp.enabled))
    return {"records": [{"round": 1, "test_accuracy": 0.5, "epsilon": None}], "seconds": 0.0}

  monkeypatch.setattr(train, "train_and_evaluate", fake_train)
  monkeypatch.setattr(report, "make_report", lambda dirs, out, **kw: reports.append((dirs, out)))
  rc = run.main(
    [
      "prog",
      "--config=quickstart",
      "--config.suite.fedlap_dp.dp.noise_multiplier=0",
      f"--workdir={tmp_path}",
    ]
  )
  assert rc == 2 and not calls
  assert "quickstart/fedlap_dp: dp.noise_multiplier=0.0 is invalid" in capsys.readouterr().err
  assert (
    run.main(
      ["prog", "--config=quickstart", "--config.suite.fedlap.seed=3", f"--workdir={tmp_path}"]
    )
    == 0
  )
  assert calls == [
    ("quickstart/fedlap", str(tmp_path / "fedlap"), False),
    ("quickstart/fedlap_dp", str(tmp_path / "fedlap_dp"), True),
  ]
  assert reports == [
    ([str(tmp_path / "fedlap"), str(tmp_path / "fedlap_dp")], str(tmp_path / "report"))
  ]


# (config, nominal smallest client of the paper partition): q = B / N_k ~ 0.17.
TUNED = [
  ("mnist_dp_tuned", 11339),
  ("fmnist_dp_tuned", 12000),
  ("cifar_dp_tuned", 10000),
  ("digits_dp_tuned", 274),
]


@pytest.mark.parametrize("name,min_size", TUNED)
def test_tuned_dp_configs_carry_the_recipe_at_epsilon_2_79(name, min_size):
  cfg = load(name)
  library_configs.validate_config(cfg)
  fc = library_configs.library_config(cfg)
  c = fc.client
  assert (
    c.iterations,
    c.max_outer,
    c.batch_loop,
    c.boost_loop,
    c.inner_loop,
    c.radius,
    c.average_targets,
    c.model_steps,
  ) == (1, 2, 10, 50, 5, 10.0, True, "synthetic")
  assert (fc.rounds, fc.learning_rate, fc.lr_schedule, fc.server.max_epochs, fc.server.start) == (
    3,
    0.2,
    "cosine_open",
    30,
    "global",
  )
  assert c.batch_size / min_size == pytest.approx(0.169, abs=0.002)
  eps = accounting.epsilon_after_rounds(
    rounds=fc.rounds,
    noise_multiplier=fc.dp.noise_multiplier,
    batch_size=c.batch_size,
    min_client_size=min_size,
    steps_per_round=c.real_accesses_per_round,
    delta=fc.dp.delta,
    adjacency="add_remove",  # the paper's figure
  )
  assert 2.75 <= eps <= 2.80  # sigma 2.38 is the q ~ 0.17 calibration, rounded up


def test_digits_hybrid_config_carries_the_recipe_at_epsilon_2_79():
  # The hybrid: DP-SGD client path on un-augmented real batches, FedAvg start, then
  # 5 epochs of refinement on the synthetic sets at the server's own rate.
  fc = library_configs.library_config(load("digits_dp_hybrid"))
  c, s = fc.client, fc.server
  assert (c.iterations, c.max_outer, c.batch_loop, c.boost_loop, c.batch_size, c.radius) == (
    1,
    20,
    1,
    20,
    46,
    1e4,
  )
  assert (c.average_targets, c.model_steps, c.real_dsa_strategy, c.dsa_strategy) == (
    True,
    "noisy_real",
    "",
    quickstart.dp_config().client.dsa_strategy,
  )
  assert (s.start, s.radius_strategy, s.learning_rate, s.max_epochs) == (
    "fedavg_delta",
    "constant",
    0.03,
    5,
  )
  assert (fc.rounds, fc.learning_rate, fc.lr_schedule) == (5, 0.3, "cosine_open")
  eps = accounting.epsilon_after_rounds(
    rounds=fc.rounds,
    noise_multiplier=fc.dp.noise_multiplier,
    batch_size=c.batch_size,
    min_client_size=274,
    steps_per_round=c.real_accesses_per_round,
    delta=fc.dp.delta,
    adjacency="add_remove",  # the paper's figure
  )
  assert c.real_accesses_per_round == 20 and 2.75 <= eps <= 2.80


# (config, nominal smallest client, (C, eta_0), the 10k-subset's (B, smallest client)).
HYBRID = [
  ("mnist_dp_hybrid", 11339, (0.1, 2.0), (256, 1513)),
  ("fmnist_dp_hybrid", 12000, (1.0, 0.3), (263, 1555)),
]


@pytest.mark.parametrize("name,min_size,clip_lr,subset", HYBRID)
def test_mnist_hybrid_configs_split_the_budget_over_10_rounds_at_epsilon_2_79(
  name, min_size, clip_lr, subset
):
  # The digits' hybrid with the split that won on mnist10k / fmnist10k: T 35, 10 rounds, q 0.169.
  cfg = load(name)
  library_configs.validate_config(cfg)
  fc = library_configs.library_config(cfg)
  c, s = fc.client, fc.server
  assert (c.iterations, c.max_outer, c.batch_loop, c.boost_loop, c.radius) == (1, 35, 1, 20, 1e4)
  assert (c.average_targets, c.model_steps, c.real_dsa_strategy) == (True, "noisy_real", "")
  assert (s.start, s.radius_strategy, s.learning_rate, s.max_epochs) == (
    "fedavg_delta",
    "constant",
    0.03,
    5,
  )
  assert (fc.rounds, fc.lr_schedule) == (10, "cosine_open")
  assert (fc.dp.l2_clip_norm, fc.learning_rate) == clip_lr
  assert c.batch_size / min_size == pytest.approx(0.169, abs=0.001)
  for batch, smallest in ((c.batch_size, min_size), subset):  # the README's B for the subset
    eps = accounting.epsilon_after_rounds(
      rounds=fc.rounds,
      noise_multiplier=fc.dp.noise_multiplier,
      batch_size=batch,
      min_client_size=smallest,
      steps_per_round=c.real_accesses_per_round,
      delta=fc.dp.delta,
      adjacency="add_remove",  # the paper's figure
    )
    assert c.real_accesses_per_round == 35 and 2.75 <= eps <= 2.79, (batch, eps)


def test_paper_dp_configs_are_unchanged_by_the_recipe():
  # mnist_dp / cifar_dp keep the published loops: eps 2.79 after round 1, 10.18 after 15.
  for name in ("mnist_dp", "cifar_dp"):
    fc = library_configs.library_config(load(name))
    assert not fc.client.average_targets and fc.client.model_steps == "synthetic"
    assert fc.lr_schedule == "cosine" and fc.server.learning_rate is None
    assert fc.server.start == "global" and fc.client.real_accesses_per_round == 200
    eps = [
      accounting.epsilon_after_rounds(
        rounds=m,
        noise_multiplier=fc.dp.noise_multiplier,
        batch_size=fc.client.batch_size,
        min_client_size=10000,
        steps_per_round=200,
        delta=fc.dp.delta,
        adjacency="add_remove",  # the paper's figure
      )
      for m in (1, 15)
    ]
    np.testing.assert_allclose(eps, [2.79, 10.18], atol=0.02)


@pytest.mark.parametrize(
  "name, fields",
  [
    (
      "quickstart:nondp",
      ["synthetic_init", "client.calibrate_radius", "server.radius_strategy", "data.normalisation"],
    ),
    ("cifar_nondp", ["synthetic_init", "client.calibrate_radius", "server.radius_strategy"]),
  ],
)
def test_dp_on_a_non_dp_config_names_every_coupled_field_at_once(name, fields, capsys):
  """--config.dp.enabled=True on a non-DP config: one error with every field DP needs changed
  and the flags that change them; with those flags the config is a valid DP run."""
  from fedlap_runs import library_configs  # pylint: disable=g-import-not-at-top

  config, _ = flags.load_config(name, ["dp.enabled=True"])
  with pytest.raises(library_configs.ConfigError) as err:
    library_configs.validate_config(config)
  assert err.value.field == "dp.enabled"
  assert [f for f, *_ in library_configs.dp_coupled_fields(config)] == fields
  assert f"needs {len(fields)} other fields changed with it" in str(err.value)
  added = re.search(r"allowed: add (.*?), or start from a DP config", str(err.value)).group(1)
  assert (
    run.main(["prog", f"--config={name}", "--config.dp.enabled=True", "--workdir=/nonexistent/x"])
    == 2
  )
  assert capsys.readouterr().err.startswith(
    f"error: {name.replace(':', '_')}: dp.enabled=True needs"
  )
  fixed, _ = flags.load_config(
    name, ["dp.enabled=True", *(f[len("--config.") :] for f in added.split())]
  )
  library_configs.validate_config(fixed)
  assert library_configs.dp_coupled_fields(fixed) == []
