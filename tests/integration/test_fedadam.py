"""FedAdam: it learns on the digits, its Adam state advances across rounds and is
checkpointed, and ``--config=quickstart:fedadam`` runs (and resumes) through the command line."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from experiments import run, train

from fedlap_runs import checkpointing, configs
from fedlap_jax import baselines, rounds
from fedlap_jax.checks import ConfigError
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods.fedavg import AdamServer, adam_preset
from fedlap_jax.models import count_params
from fedlap_jax.training import evaluate

ROUNDS = 3


def _config(server_lr=0.03):
  clients = baselines.baseline_config(
    "fedavg", rounds=ROUNDS, learning_rate=0.1, local_epochs=2, batch_size=64, dp=None
  )
  return adam_preset(clients, AdamServer(learning_rate=server_lr))


def test_fedadam_learns_digits(apply_fn, params, clients, digits):
  """3 rounds of 5 two-class clients: well above chance (10 %); Adam's step count is 3 and
  its moments moved."""
  facts = RunFacts((8, 8, 1), 5, count_params(params), 2)
  alg = rounds.algorithm(REGISTRY.method("fedadam"), _config(), ModelFns(apply_fn), facts)
  assert alg.name == "fedadam" and alg.mechanism is None and alg.dp is None
  assert alg.upload_floats_per_client == count_params(params)
  state = alg.init(jax.random.PRNGKey(0), params, clients)
  for _ in range(ROUNDS):
    state, metrics = alg.round(state, clients)
  adam = state.opt_state[0]
  assert int(state.round) == ROUNDS and int(adam.count) == ROUNDS
  assert all(float(np.abs(m).max()) > 0 for m in jax.tree.leaves(adam.mu))
  assert int(metrics.client.steps.min()) >= 1
  acc = float(evaluate(apply_fn, state.params, digits.x_test, digits.y_test).accuracy)
  assert acc > 0.5, acc


def test_fedadam_refuses_bad_server_settings_and_another_client_method():
  for field, value in (("learning_rate", 0.0), ("b1", 1.0), ("b2", -0.1), ("eps", 0.0)):
    with pytest.raises(ConfigError) as err:
      AdamServer(**{field: value})
    assert err.value.field == field
  fedprox = baselines.baseline_config("fedprox", rounds=1, learning_rate=0.1, batch_size=8, dp=None)
  with pytest.raises(ConfigError) as err:
    adam_preset(fedprox, AdamServer())
  assert err.value.field == "method"


TINY = ["--config.model.width=8", "--config.model.depth=1", "--config.eval_chunk_size=400"]


def test_quickstart_fedadam_names_a_bad_server_setting():
  cfg = configs.load("quickstart:fedadam")
  cfg.fedadam.b1 = 1.5
  with pytest.raises(ConfigError) as err:
    train.train_and_evaluate(cfg, "/nonexistent-never-written")
  assert err.value.field == "fedadam.b1"


def test_quickstart_fedadam_runs_through_the_command_line_and_resumes_as_it_ran(
  tmp_path, monkeypatch
):
  """``--config=quickstart:fedadam`` runs FedAdam through the command line; its Adam state is
  checkpointed: a run stopped after round 2 and resumed ends where the straight run ends,
  record for record."""
  argv = ["prog", "--config=quickstart:fedadam", "--config.rounds=3", "--config.checkpoint_every=1"]
  assert run.main([*argv, *TINY, f"--workdir={tmp_path / 'straight'}"]) == 0
  info = json.loads((tmp_path / "straight" / "run_info.json").read_text())
  assert info["method"] == "fedadam" and info["method_label"] == "FedAdam"
  assert "FedAdam on digits" in (tmp_path / "straight" / "summary.md").read_text()
  cfg = configs.load("quickstart:fedadam")
  cfg.rounds, cfg.checkpoint_every = 3, 1
  cfg.model.width, cfg.model.depth, cfg.eval_chunk_size = 8, 1, 400

  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  handler = ocp.handlers.JsonCheckpointHandler
  save = handler.async_save
  saves = []

  def crash_on_round_3(self, *args, **kwargs):
    saves.append(1)
    if len(saves) == 3:
      raise RuntimeError("simulated crash inside the checkpoint save")
    return save(self, *args, **kwargs)

  monkeypatch.setattr(handler, "async_save", crash_on_round_3)
  with pytest.raises(RuntimeError, match="simulated crash"):
    train.train_and_evaluate(cfg, tmp_path / "resumed")
  monkeypatch.undo()
  # What the resume starts from: round 2's state, Adam's moments included.
  assert checkpointing.Checkpointer(tmp_path / "resumed" / "checkpoints").latest_round() == 2
  train.train_and_evaluate(cfg, tmp_path / "resumed")

  def records(d):
    return [
      {k: v for k, v in r.items() if k not in ("round_seconds", "wall_seconds", "first_in_process")}
      for r in checkpointing.read_metrics(d / "metrics.jsonl")
    ]

  assert records(tmp_path / "resumed") == records(tmp_path / "straight")
  assert [r["round"] for r in records(tmp_path / "straight")] == [1, 2, 3]
