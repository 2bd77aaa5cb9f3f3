"""DP-SCAFFOLD: its control variates cut the drift between skewed clients, it charges DP-FedAvg's
epsilon for the same settings, and ``experiments.run`` runs it."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import raises_field
from experiments import run
from fedlap_jax import accounting, baselines, optim, rounds, update_bounds
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import stack_clients
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY, dp_scaffold
from fedlap_jax.methods.dp_scaffold import DPScaffoldConfig
from fedlap_jax.models import count_params
from fedlap_jax.training import tree_distance
from fedlap_runs import configs, library_configs

DP = DPConfig(noise_multiplier=0.3, l2_clip_norm=1.0, delta=1e-5)


def _dp_fedavg(max_client_size, rounds=10):
  return baselines.baseline_config(
    "dp_fedavg",
    rounds=rounds,
    learning_rate=0.1,
    batch_size=128,
    local_epochs=1,
    dp=DP,
    max_client_size=max_client_size,
  )


def _skewed_round(digits, apply_fn, params):
  """One DP-SCAFFOLD round of two clients holding digits 0-4 and 5-9:
  ``(clients, config, method, model fns, facts, algorithm, state after the round)``."""
  low = digits.y_train < 5
  x, y = digits.x_train, digits.y_train
  clients = stack_clients([x[low], x[~low]], [y[low], y[~low]])
  n_max = int(np.asarray(clients.mask).sum(1).max())
  config = DPScaffoldConfig(_dp_fedavg(n_max))
  method, fns = REGISTRY.method("dp_scaffold"), ModelFns(apply_fn)
  facts = RunFacts((8, 8, 1), 2, count_params(params), 5, n_max)
  alg = rounds.algorithm(method, config, fns, facts)
  state, _ = alg.round(alg.init(jax.random.PRNGKey(0), params, clients), clients)
  return clients, config, method, fns, facts, alg, state


def test_control_variates_cut_the_drift_of_two_skewed_clients(tiny_apply_fn, tiny_params, digits):
  """Two clients holding digits 0-4 and 5-9: after one round of DP-SCAFFOLD, the next round's
  client models lie at least 3 times closer together than with its control variates zero
  (DP-FedAvg's clients, the same keys and noise): 0.069 against 0.342."""
  clients, config, method, fns, facts, alg, state = _skewed_round(
    digits, tiny_apply_fn, tiny_params
  )

  @jax.jit
  def drift(state):
    plan = method.plan(state, 2, config)

    def client(own, c_k, data):
      return method.client_step(own, fns, plan.message, (c_k,), data, config).update.params

    y = jax.vmap(client)(plan.own, state.client_controls, clients)
    return tree_distance(jax.tree.map(lambda a: a[0], y), jax.tree.map(lambda a: a[1], y))

  zero = jax.tree.map(jnp.zeros_like, (state.control, state.client_controls))
  without = float(drift(state._replace(control=zero[0], client_controls=zero[1])))
  with_controls = float(drift(state))
  assert float(tree_distance(state.control, zero[0])) > 0
  assert with_controls < 0.3 * without, (with_controls, without)


def test_dp_scaffold_charges_dp_fedavgs_epsilon(tiny_apply_fn, tiny_params, clients):
  """The same B, sigma, T and rounds: the same mechanism and epsilon as DP-FedAvg's (the control
  delta is computed from the noisy model), and that epsilon is the accountant's of q, T, M."""
  n = np.asarray(clients.mask).sum(1)
  base = _dp_fedavg(int(n.max()), rounds=5)
  facts = RunFacts((8, 8, 1), 5, count_params(tiny_params), 2, int(n.max()))
  fns = ModelFns(tiny_apply_fn)
  fedavg = rounds.algorithm(REGISTRY.method("dp_fedavg"), base, fns, facts)
  scaffold = rounds.algorithm(REGISTRY.method("dp_scaffold"), DPScaffoldConfig(base), fns, facts)
  assert scaffold.mechanism == fedavg.mechanism and scaffold.dp == fedavg.dp == DP
  assert scaffold.upload_floats_per_client == 2 * fedavg.upload_floats_per_client
  eps = scaffold.mechanism.epsilon_after(5, int(n.min()))
  assert eps == fedavg.mechanism.epsilon_after(5, int(n.min()))
  steps = base.local.scheduled_steps()
  assert steps == round(int(n.max()) / 128)
  want = accounting.epsilon_after_rounds(
    rounds=5,
    noise_multiplier=0.3,
    batch_size=128,
    min_client_size=int(n.min()),
    steps_per_round=steps,
    delta=1e-5,
  )
  assert eps == pytest.approx(want, rel=1e-12)


def test_dp_scaffold_refuses_a_config_without_dp():
  fedavg = baselines.baseline_config("fedavg", rounds=1, learning_rate=0.1, batch_size=8, dp=None)
  with pytest.raises(ConfigError) as err:
    DPScaffoldConfig(fedavg)
  assert err.value.field == "base"


TINY = ["--config.model.width=8", "--config.model.depth=1", "--config.eval_chunk_size=400"]


def test_one_round_runs_through_the_command_line(tmp_path):
  argv = ["prog", "--config=quickstart:dp_loops", "--config.method=dp_scaffold"]
  argv += ["--config.rounds=1", "--config.baseline.local_epochs=1", *TINY]
  assert run.main([*argv, f"--workdir={tmp_path}"]) == 0
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert info["method"] == "dp_scaffold" and info["method_label"] == "DP-SCAFFOLD"
  assert info["upload_floats_per_client"] == 2 * info["num_params"]
  record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  want = accounting.epsilon_after_rounds(
    rounds=1,
    noise_multiplier=info["noise_multiplier"],
    batch_size=info["batch_size"],
    min_client_size=info["min_client_size"],
    steps_per_round=info["steps_per_round"],
    delta=info["delta"],
  )
  assert record["round"] == 1 and record["epsilon"] == pytest.approx(want, rel=1e-9)


def test_a_reply_beyond_what_the_config_allows_is_refused_by_field(
  tiny_apply_fn, tiny_params, digits
):
  """The server's bounds of a DP-SCAFFOLD reply (``||y_k - x||`` and ``||delta c_k||``), from
  eta_m, T, the clip, sigma and B: the honest replies of a round whose client controls are not
  zero stay within them; a control delta or model past them is refused naming its field."""
  clients, config, method, fns, facts, alg, state = _skewed_round(
    digits, tiny_apply_fn, tiny_params
  )
  plan = method.plan(state, 2, config)
  check = method.check_update(config, facts)
  model_bound, control_bound = dp_scaffold.update_bounds_of(config, facts)(plan.message)
  for k in range(2):
    own, c_k, data = (
      jax.tree.map(lambda a: a[k], t) for t in (plan.own, state.client_controls, clients)
    )
    update = method.client_step(own, fns, plan.message, (c_k,), data, config).update
    check(plan.message, update)  # honest: accepted
    control = float(tree_distance(update.control_delta, jax.tree.map(jnp.zeros_like, c_k)))
    assert 0 < control < control_bound, (control, control_bound)
    assert 0 < float(tree_distance(update.params, plan.message.params)) < model_bound
  hostile = {
    "control_delta": update._replace(
      control_delta=jax.tree.map(lambda a: a + control_bound, update.control_delta)
    ),
    "params": update._replace(params=jax.tree.map(lambda a: a + model_bound, update.params)),
  }
  for field, reply in hostile.items():
    with pytest.raises(ConfigError) as e:
      check(plan.message, reply)
    assert e.value.field == field, e.value
  # The mean of t steps' noisy gradients is bounded by the one-step figure (any T_k).
  args = dict(learning_rate=1.0, batch_size=128, l2_clip_norm=1.0, noise_multiplier=0.3)
  mean = [
    update_bounds.local_sgd_update_bound(steps=t, num_params=facts.num_params, **args) / t
    for t in (1, 2, 5, 50, 500)
  ]
  assert mean == sorted(mean, reverse=True), mean


@pytest.mark.parametrize(
  "spec",
  [
    optim.Optimizer(momentum=0.9),
    optim.Optimizer(weight_decay=5e-4),
    optim.Optimizer(momentum=0.9, nesterov=True),
    optim.Optimizer(name="adam"),
  ],
  ids=["momentum", "weight_decay", "nesterov", "adam"],
)
def test_a_client_optimizer_the_server_cannot_bound_is_refused_before_the_data(spec):
  """The server bounds a DP-SCAFFOLD reply only for plain SGD steps: any other client
  optimiser is refused by field, by the library config and by the experiment config's static
  checks (which both front ends run before any data is loaded); plain SGD passes both."""
  with raises_field("client_optimizer"):
    DPScaffoldConfig(dataclasses.replace(_dp_fedavg(100), client_optimizer=spec))
  cfg = configs.load("quickstart:dp_loops")
  cfg.method = "dp_scaffold"
  assert library_configs.validate_config(cfg) is None  # plain SGD: the bounded client
  for field, value in dataclasses.asdict(spec).items():
    cfg.baseline.client_optimizer[field] = value
  with raises_field("baseline.client_optimizer"):
    library_configs.validate_config(cfg)
