"""Data sets and models are rows: a data set is one row of :mod:`fedlap_runs.catalog`
(SVHN, run end to end on ``tfds.testing.mock_data``)."""

import numpy as np
import pytest

from fedlap_runs import catalog, library_configs
from fedlap_runs.configs import fedlap


def tiny_run_config(name: str, source: str, cache_dir: str):
  """A one-round non-DP FedLAP run on ``name`` with a tiny ConvNet."""
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top

  cfg = quickstart.nondp_config()
  cfg.data.name, cfg.data.source, cfg.data.cache_dir = name, source, cache_dir
  cfg.model.width, cfg.model.depth = 8, 1
  c = cfg.client
  c.ipc, c.max_outer, c.batch_loop, c.boost_loop, c.batch_size = 1, 1, 1, 1, 4
  c.calibration_epochs, c.dsa_strategy, cfg.server.dsa_strategy = 2, "", ""
  cfg.server.max_epochs, cfg.rounds, cfg.progress_bar, cfg.plots = 2, 1, False, False
  return cfg


def test_the_named_configs_read_the_table():
  """The paper's data sets' facts come from their rows, with the numbers they always had."""
  assert fedlap.DATASETS == {"mnist": "mnist", "fmnist": "fashion_mnist", "cifar": "cifar10"}
  assert fedlap.MIN_CLIENT_SIZE == {"mnist": 11339, "fmnist": 12000, "cifar": 10000}
  assert fedlap.TUNED_BATCH_SIZE == {"mnist": 1916, "fmnist": 2028, "cifar": 1690}
  assert catalog.TFDS_NAMES == ("mnist", "fashion_mnist", "cifar10", "svhn_cropped")


def test_svhn_is_one_row_and_runs_end_to_end(tmp_path):
  """``data.name='svhn_cropped'``: loaded through tfds (mocked), normalised with its
  published constants, partitioned, one round trained and evaluated."""
  tfds = pytest.importorskip("tensorflow_datasets")
  from fedlap_runs import data as data_lib  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top

  cfg = tiny_run_config("svhn_cropped", "tfds", str(tmp_path / "cache"))
  library_configs.validate_config(cfg)
  with tfds.testing.mock_data(num_examples=100):
    out = train.train_and_evaluate(cfg, tmp_path / "run")
  (rec,) = out["records"]
  assert rec["round"] == 1 and 0.0 <= rec["test_accuracy"] <= 1.0
  assert len(rec["client_radius"]) == 5
  ds = data_lib.load_dataset(cfg.data)  # from the npz cache the run wrote, outside the mock
  assert ds.x_train.shape == (100, 32, 32, 3) and ds.num_classes == 10
  assert ds.normalisation == "published"
  np.testing.assert_allclose(ds.mean, (0.4377, 0.4438, 0.4728), rtol=1e-6)
  np.testing.assert_allclose(ds.std, (0.1980, 0.2010, 0.1970), rtol=1e-6)


# --------------------------------------------------------------------- a user's model

TINY = {  # quickstart:dp_loops at its smallest: 1 round, one noisy gradient per client
  "rounds": 1,
  "client.ipc": 1,
  "client.max_outer": 1,
  "client.batch_loop": 1,
  "client.boost_loop": 1,
  "client.inner_loop": 0,
  "client.dsa_strategy": "",
  "server.dsa_strategy": "",
  "server.max_epochs": 1,
  "progress_bar": False,
  "plots": False,
  "seed": 0,
}


def argv_of(config: str, workdir, **overrides):
  flags = [f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()]
  return ["prog", f"--config={config}", *flags, f"--workdir={workdir}"]


@pytest.mark.parametrize("name", ["user_models:MLP", "user_models:mlp"])
def test_a_users_model_runs_in_experiments_run(name, tmp_path):
  """``model.name=MODULE:ATTR``: a class or a function of ``num_classes``; the ConvNet's
  fields are not read (a depth the 8x8 digits cannot take is no error)."""
  import json  # pylint: disable=g-import-not-at-top

  from experiments import run  # pylint: disable=g-import-not-at-top

  argv = argv_of("quickstart:nondp", tmp_path, **{"model.name": name, "model.depth": 9})
  assert run.main(argv) == 0
  (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rec["round"] == 1 and 0.0 <= rec["test_accuracy"] <= 1.0
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert info["num_params"] == 64 * 16 + 16 + 16 * 10 + 10  # the MLP's, not a ConvNet's


@pytest.mark.parametrize(
  "name", ["resnet", "user_models", "user_models:Missing", "no_such_module:MLP"]
)
def test_a_model_name_that_names_nothing_is_refused_by_its_field(name):
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top

  cfg = quickstart.nondp_config()
  cfg.model.name = name
  with pytest.raises(ConfigError) as err:
    library_configs.validate_config(cfg)
  assert err.value.field == "model.name"


@pytest.mark.parametrize("name", ["user_models:BatchNormMLP", "user_models:batch_stats_mlp"])
def test_a_users_model_with_batchnorm_is_refused_under_dp(name, tmp_path):
  """The library's DP refusal applies to a user's model as to any other."""
  from experiments import train  # pylint: disable=g-import-not-at-top
  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top
  from fedlap_jax.per_example import NotDpSafe  # pylint: disable=g-import-not-at-top

  cfg = quickstart.dp_config()
  cfg.update_from_flattened_dict({**TINY, "model.name": name})
  library_configs.validate_config(cfg)
  with pytest.raises(NotDpSafe) as err:
    train.train_and_evaluate(cfg, tmp_path / "run")
  assert err.value.field == "apply_fn"


def test_a_model_callable_that_returns_no_module_is_refused_by_its_field():
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  from fedlap_runs import build  # pylint: disable=g-import-not-at-top
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top

  model_cfg = ml_collections.ConfigDict({"name": "user_models:not_a_module"})
  with pytest.raises(ConfigError) as err:
    build.init_model(model_cfg, (8, 8, 1), 10, jax.random.key(0))
  assert err.value.field == "model.name"


@pytest.mark.parametrize(
  "config, name, overrides",
  [
    ("quickstart:dp_loops", "scatternet_cnn", {}),
    ("quickstart:dp", "scatternet_linear", {"method": "dp_fedavg", "baseline.local_epochs": 1}),
  ],
)
def test_the_scatternets_run_in_experiments_run_under_dp(config, name, overrides, tmp_path):
  """A ScatterNet is a named model like the ConvNet, for FedLAP-DP and DP-FedAvg alike: the
  DP checks accept it (no statistics, no state) and a round trains and reports."""
  import json  # pylint: disable=g-import-not-at-top

  from experiments import run  # pylint: disable=g-import-not-at-top

  argv = argv_of(config, tmp_path, **{"model.name": name, "model.depth": 9, **overrides})
  assert run.main(argv) == 0
  (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rec["round"] == 1 and 0.0 <= rec["test_accuracy"] <= 1.0 and rec["epsilon"] > 0
  info = json.loads((tmp_path / "run_info.json").read_text())
  head = {"scatternet_linear": 81 * 2 * 2 * 10 + 10}.get(name, info["num_params"] - 2 * 81)
  assert info["num_params"] == 2 * 81 + head  # GroupNorm on 81 channels of 2x2 and the head


def test_a_scatternet_refuses_images_of_a_side_not_a_multiple_of_4_by_its_field():
  import types  # pylint: disable=g-import-not-at-top

  from fedlap_runs.configs import quickstart  # pylint: disable=g-import-not-at-top
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top

  cfg = quickstart.nondp_config()
  cfg.model.name = "scatternet_linear"
  library_configs.validate_config(cfg)
  clients = [np.arange(10)] * cfg.data.num_clients
  for shape in [(10, 10, 1), (8, 12, 1)]:
    with pytest.raises(ConfigError) as err:
      library_configs.validate_data(cfg, types.SimpleNamespace(image_shape=shape), clients)
    assert err.value.field == "model.name" and f"{shape[0]}x{shape[1]}" in str(err.value)
