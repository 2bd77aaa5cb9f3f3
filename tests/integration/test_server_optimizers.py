"""The FedAvg family's server optimiser as a config choice, end to end on the digits:
``baseline.server_optimizer.name=yogi`` (FedYogi) learns through the command line, and FedAvg
with the server optimiser ``adam`` at FedAdam's settings is ``--config=quickstart:fedadam``
(FedAdam is FedAvg with a server-optimiser preset, one algorithm)."""

from __future__ import annotations

import json

import pytest

from experiments import run

from fedlap_runs import checkpointing, configs, flags, library_configs
from fedlap_jax.baselines import BaselineConfig
from fedlap_jax.methods import REGISTRY

TINY = [
  "--config.model.width=8",
  "--config.model.depth=1",
  "--config.eval_chunk_size=400",
  "--config.plots=False",
  "--config.progress_bar=False",
]
VOLATILE = ("round_seconds", "wall_seconds", "first_in_process")


def _records(workdir):
  return [
    {k: v for k, v in r.items() if k not in VOLATILE}
    for r in checkpointing.read_metrics(workdir / "metrics.jsonl")
  ]


def _run(workdir, *flags):
  argv = ["prog", "--config=quickstart:fedadam", *TINY, *flags, f"--workdir={workdir}"]
  assert run.main(argv) == 0
  return _records(workdir)


def test_fedyogi_is_a_config_and_learns_the_digits(tmp_path):
  """3 rounds of FedAvg's clients with Yogi on the server (rate 0.03): far above chance (10 %),
  and still learning in round 3, where the clients' cosine rate is about 0 and only the server's
  momentum moves the model (plain SGD's server stands still there). Measured on CPU: 37.8 %,
  61.2 %, 72.0 %; with plain SGD's server, the same clients: 44.6 %, 65.5 %, 65.5 %."""
  records = _run(
    tmp_path,
    "--config.method=fedavg",
    "--config.baseline.server_optimizer.name=yogi",
    "--config.baseline.server_lr=0.03",
    "--config.rounds=3",
  )
  accuracy = [r["test_accuracy"] for r in records]
  assert [r["round"] for r in records] == [1, 2, 3]
  assert accuracy[-1] > 0.6 and accuracy[2] > accuracy[1] > accuracy[0], accuracy
  # The clients' last cosine rate: the schedule's floor, 1 % of round 1's.
  assert records[2]["learning_rate"] == pytest.approx(0.01 * records[0]["learning_rate"])
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert info["method"] == "fedavg"


def test_fedadam_is_fedavg_with_an_adam_server_preset():
  """``quickstart:fedadam`` builds FedAvg's library config with FedAdam's settings as its server
  optimiser (the one FedAvg with ``baseline.server_optimizer.name=adam`` builds), and FedAdam's
  method runs FedAvg's steps, the same objects: one algorithm under two names."""
  fedadam = configs.load("quickstart:fedadam")
  fedavg = configs.load("quickstart:fedadam")
  fedavg.method = "fedavg"
  del fedavg["fedadam"]
  fedavg.baseline.server_optimizer.update(name="adam", b1=0.9, b2=0.99, eps=0.001)
  fedavg.baseline.server_lr = fedadam.fedadam.learning_rate
  built = library_configs.library_config(fedadam)
  assert built == library_configs.library_config(fedavg)
  assert built.server_optimizer.name == "adam" and built.server_lr == 0.03
  ours, theirs = REGISTRY["fedadam"], REGISTRY["fedavg"]
  for step in ("init", "plan", "client_step", "server_step", "wire", "upload_floats"):
    assert getattr(ours, step) is getattr(theirs, step), step
  assert (ours.name, ours.label(False), ours.config_type) == ("fedadam", "FedAdam", BaselineConfig)


# FedLAP on digits, small: one round, one model epoch between the two while-loop iterations,
# so the client model's optimiser runs, and a short server descent; no DSA augmentation (a
# smaller program to compile for each run).
FEDLAP_TINY = [
  "--config=quickstart:nondp",
  *TINY,
  "--config.rounds=1",
  "--config.client.inner_loop=1",
  "--config.client.batch_loop=2",
  "--config.client.boost_loop=1",
  "--config.client.calibration_epochs=2",
  "--config.server.max_epochs=2",
  "--config.client.dsa_strategy=",
  "--config.server.dsa_strategy=",
]


def _fedlap(workdir, *flags):
  assert run.main(["prog", *FEDLAP_TINY, *flags, f"--workdir={workdir}"]) == 0
  return _records(workdir)


def test_fedlaps_server_and_client_model_optimisers_are_configs_of_experiments_run(tmp_path):
  """``server.optimizer`` (the trust-region descent), ``client.model_optimizer`` (the client
  model's epochs on its synthetic set) and ``client.image_optimizer`` (the synthetic images, at
  ``client.image_lr``) chosen on the command line are the library config's; a run with one
  changes the result, and the run's config holds the choice. That each library field is the
  optimiser its step takes: ``tests/unit/test_optim.py``."""
  chosen = [
    "--config.server.optimizer.name=adam",
    "--config.client.model_optimizer.name=adam",
    "--config.client.image_optimizer.name=yogi",
    "--config.client.image_momentum=0.0",
    "--config.client.image_lr=0.1",
  ]
  built = library_configs.library_config(
    flags.parse_argv(["prog", *FEDLAP_TINY, *chosen])[0].config
  )
  assert (
    built.server.optimizer.name,
    built.client.model_optimizer.name,
    built.client.image_optimizer.name,
    built.client.image_lr,
  ) == ("adam", "adam", "yogi", 0.1)
  default = _fedlap(tmp_path / "sgd")
  adam_server = _fedlap(tmp_path / "adam_server", chosen[0])
  assert [r["round"] for r in default] == [r["round"] for r in adam_server] == [1]
  assert adam_server[-1]["test_loss"] != default[-1]["test_loss"]
  config = json.loads((tmp_path / "adam_server" / "config.json").read_text())
  assert config["server"]["optimizer"]["name"] == "adam"
