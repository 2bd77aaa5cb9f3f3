"""The library's dataclasses are the schema of the experiment configs' client / server / dp."""

import dataclasses

import ml_collections
import pytest

from fedlap_jax import baselines, optim
from fedlap_jax import dp_config
from fedlap_jax.methods.fedlap import config as core
from fedlap_jax.checks import ConfigError

from fedlap_runs import library_configs, method_entries
from fedlap_runs.configs import default, fedlap, schema
from conftest import raises_field


def test_sections_are_the_dataclasses_fields_and_defaults():
  cfg = default.get_config()
  assert set(cfg.client.keys()) == {f.name for f in dataclasses.fields(core.ClientConfig)} - {"dp"}
  assert set(cfg.server.keys()) == {f.name for f in dataclasses.fields(core.ServerConfig)}
  fedlap = library_configs.library_config(cfg)
  assert fedlap.client == core.ClientConfig()
  assert fedlap.server == core.ServerConfig(weighting="size")  # None resolved without DP
  cfg.dp.enabled = True
  assert method_entries.dp_config(cfg) == core.PAPER_DP


def test_optional_fields_are_typed_placeholders():
  client = schema.section(core.ClientConfig, exclude=("dp",))
  assert client.calibration_eval_size is None and client.get_type("calibration_eval_size") is int
  assert client.get_type("real_dsa_strategy") is str
  client.calibration_eval_size = 7  # an override gets the field's type
  with pytest.raises(TypeError):
    client.calibration_eval_size = "7"


def test_section_needs_a_value_for_fields_without_default():
  with pytest.raises(TypeError, match="noise_multiplier has no default"):
    schema.section(dp_config.DPConfig)
  with pytest.raises(TypeError, match="no fields"):
    schema.section(core.ServerConfig, nosuch=1)


def test_baseline_section_is_baseline_configs_arguments_and_defaults():
  cfg = default.get_config()
  cfg.method = "fedprox"
  built = library_configs.library_config(cfg)
  ref = baselines.baseline_config(
    "fedprox", rounds=cfg.rounds, learning_rate=0.1, batch_size=256, dp=None
  )
  assert (
    (built.local.epochs, built.local.prox_mu) == (ref.local.epochs, ref.local.prox_mu) == (5, 0.1)
  )
  assert {k: cfg.baseline[k] for k in ("local_epochs", "prox_mu", "server_lr")} == {
    "local_epochs": 5,
    "prox_mu": 0.1,
    "server_lr": 1.0,
  }
  assert set(cfg.baseline) == {
    "local_epochs",
    "prox_mu",
    "server_lr",
    "client_optimizer",
    "server_optimizer",
  }
  for name in ("client_optimizer", "server_optimizer"):  # plain SGD, today's FedAvg
    assert cfg.baseline[name].to_dict() == schema.section(optim.Optimizer).to_dict()
    assert getattr(built, name) == optim.SGD
  assert built.server_lr == ref.server_lr == 1.0
  with pytest.raises(TypeError, match="no argument 'nosuch'"):
    schema.arguments(baselines.baseline_config, "nosuch")
  with pytest.raises(TypeError, match="no argument 'rounds' with a default"):
    schema.arguments(baselines.baseline_config, "rounds")


@pytest.mark.parametrize(
  ("field", "value", "allowed"),
  [("local_epochs", 0, "an integer >= 1"), ("prox_mu", -0.5, "a finite number >= 0")],
)
def test_baseline_section_is_checked_by_the_library_naming_the_path(field, value, allowed):
  cfg = default.get_config()  # method fedlap: the section is checked all the same
  cfg.baseline[field] = value
  with raises_field(f"baseline.{field}") as err:
    library_configs.validate_config(cfg)
  assert err.value.value == value and allowed in err.value.allowed


@pytest.mark.parametrize(
  ("method", "path", "value", "field", "allowed"),
  [
    ("fedlap", "server_optimizer.name", "nadam", "name", "one of ('sgd', 'adam'"),
    ("fedavg", "server_optimizer.momentum", 0.9, "momentum", "name='yogi' does not use it"),
    ("fedavg", "client_optimizer.b2", 0.99, "b2", "name='sgd' does not use it"),
    ("fedavg", "server_lr", 0.0, "", "a finite number > 0"),
    ("fedlap", "server_optimizer.momentum", 0.9, "", "plain SGD"),  # fedlap does not read it
    ("fedadam", "server_optimizer.name", "adam", "", "FedAdam's server optimiser"),
    ("fedadam", "server_lr", 0.5, "", "FedAdam's server rate is server.learning_rate"),
  ],
)
def test_the_baselines_optimisers_are_checked_naming_the_path(method, path, value, field, allowed):
  """``baseline.server_optimizer`` / ``client_optimizer`` / ``server_lr``: a bad value is
  refused naming its path; a method that does not read them (FedLAP) or has its own server
  (FedAdam) refuses a choice there rather than ignoring it."""
  cfg = default.get_config()
  cfg.method = method
  section, _, name = path.partition(".")
  if path == "server_optimizer.momentum" and method == "fedavg":
    cfg.baseline.server_optimizer.name = "yogi"
  if name:
    cfg.baseline[section][name] = value
  else:
    cfg.baseline[section] = value
  with pytest.raises(ConfigError) as err:
    library_configs.library_config(cfg, max_client_size=500)
    library_configs.validate_config(cfg)
  where = f"baseline.{section}" + (f".{field}" if field else "")
  assert err.value.field == where and allowed in str(err.value), str(err.value)


def test_paper_dp_setting_is_written_once():
  assert library_configs.library_config(fedlap.get_config("cifar_dp")) == core.paper_dp_config()


@pytest.mark.parametrize(
  "section,field,value,allowed",
  [
    ("client", "ipcc", 3, "a field of ClientConfig"),
    ("server", "radius", 1.0, "a field of ServerConfig"),
    ("dp", "sigma", 1.0, "a field of DPConfig"),
  ],
)
def test_unknown_field_is_refused_naming_it(section, field, value, allowed):
  cfg = fedlap.get_config("cifar_dp")
  cfg[section][field] = value
  with pytest.raises(ConfigError) as err:
    library_configs.validate_config(cfg)
  assert err.value.field == f"{section}.{field}" and err.value.value == value
  assert allowed in err.value.allowed


@pytest.mark.parametrize(
  "path,value,allowed",
  [
    ("client.average_targets", 1, "True or False"),
    ("client.dsa_family_draw", 0, "a string"),
    ("client.calibration_eval_size", 2.5, "an integer or None"),
    ("server.learning_rate", "0.1", "a finite number or None"),
    ("dp.per_example_method", None, "a string"),
  ],
)
def test_mistyped_field_is_refused_naming_it(path, value, allowed):
  cfg = fedlap.get_config("cifar_dp")
  section, field = path.split(".")
  del cfg[section][field]  # a config file may write any type
  cfg[section][field] = value
  with pytest.raises(ConfigError) as err:
    library_configs.validate_config(cfg)
  assert err.value.field == path and err.value.allowed == allowed
  assert str(err.value).startswith(f"{path}={value!r} is invalid")


def test_build_keeps_the_dataclass_validation():
  section = schema.section(core.ServerConfig)
  section.max_epochs = 0
  with raises_field("server.max_epochs"):
    schema.build(core.ServerConfig, section, "server")
  section.max_epochs = 3
  assert schema.build(core.ServerConfig, section, "server") == core.ServerConfig(max_epochs=3)


def test_write_fedlap_round_trips():
  fedlap = core.paper_dp_config(rounds=3)
  cfg = schema.write_fedlap(default.get_config(), fedlap)
  assert isinstance(cfg, ml_collections.ConfigDict)
  assert library_configs.library_config(cfg) == fedlap


@pytest.mark.parametrize(
  ("method", "settings", "field", "allowed"),
  [
    # A bad value, named by its path.
    ("fedlap", {"server.optimizer.name": "nadam"}, "server.optimizer.name", "one of ('sgd',"),
    ("fedlap", {"client.model_optimizer.b1": 0.9}, "client.model_optimizer.b1", "does not use"),
    # Heavy-ball SGD has one source: server.momentum / server.weight_decay.
    ("fedlap", {"server.optimizer.momentum": 0.9}, "server.optimizer", "server.momentum and"),
    # A spec is the whole direction: FedDM's SGD momentum must be 0 beside it.
    ("feddm", {"server.optimizer.name": "adam"}, "server.momentum", "when server.optimizer"),
    # A choice the method would ignore.
    ("fedlap", {"client.model_optimizer.name": "adam"}, "client.model_optimizer", "no step"),
    ("fedavg", {"server.optimizer.name": "adam"}, "server.optimizer", "does not read"),
    ("fedlap", {"client.image_optimizer.name": "adam"}, "client.image_momentum", "0.0 when"),
    ("feddm", {"client.image_optimizer.name": "adam"}, "client.image_optimizer", "not read"),
    ("dp_fedavg", {"client.model_optimizer.name": "adam"}, "client.model_optimizer", "FedLAP's"),
    ("feddm", {"client.model_optimizer.name": "adam"}, "client.model_optimizer", "not read"),
  ],
)
def test_fedlaps_optimisers_are_checked_naming_the_path(method, settings, field, allowed):
  """``client.model_optimizer`` / ``server.optimizer``: a bad value, a second source of the
  server's SGD, and a choice the method does not read are refused naming the field."""
  cfg = default.get_config()
  cfg.method = method
  if method == "feddm":
    cfg.server.radius_strategy = "fixed"
  if method == "dp_fedavg":
    cfg.dp.enabled = True
    cfg.synthetic_init, cfg.client.calibrate_radius = "noise", False
    cfg.server.radius_strategy, cfg.server.weighting = "constant", "uniform"
  if method == "feddm" and "server.optimizer.name" in settings:
    cfg.server.momentum = 0.9  # FedDM's published server: SGD with momentum
  for path, value in settings.items():
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    node[leaf] = value
  with pytest.raises(ConfigError) as err:
    library_configs.validate_config(cfg)
    library_configs.library_config(cfg, max_client_size=500)
  assert err.value.field == field and allowed in str(err.value), str(err.value)


def test_fedlaps_optimisers_default_to_todays_and_a_spec_reaches_the_library_config():
  """The sections default to plain SGD: the library config is today's (no server spec, the
  model's plain SGD); a spec chosen there is the library config's."""
  cfg = default.get_config()
  built = library_configs.library_config(cfg)
  assert built == core.FedLAPConfig()
  assert built.server.optimizer is None and built.client.model_optimizer == optim.SGD
  assert built.client.image_optimizer is None
  assert built.server.direction() is optim.server_direction(0.0, 0.0)
  cfg.server.optimizer.name = "yogi"
  cfg.client.model_optimizer.name = "adam"
  cfg.client.inner_loop = 1
  built = library_configs.library_config(cfg)
  assert built.server.optimizer == optim.Optimizer(name="yogi")
  assert built.client.model_optimizer == optim.Optimizer(name="adam")
  assert built.server.direction() is optim.Optimizer(name="yogi").direction()
  cfg.client.image_optimizer.name = "adam"
  cfg.client.image_momentum = 0.0
  assert library_configs.library_config(cfg).client.image_optimizer == optim.Optimizer(name="adam")
