"""Optimisers as optax values: every role's default, any optax transformation in its place, the
server's state carried across rounds and restored from checkpoints (old ones included).

(a) Passing a role's default explicitly is bit for bit the run without it (the explicit
    :func:`fedlap_jax.optim.sgd` runs through optax where the default is written out by hand).
(b) Another optimiser changes the result, and a carried server state advances round by round.
The checkpoints of the server's state (one written before ``opt_state`` included):
``tests/integration/test_resume_opt_state.py``.
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import baselines, optim, rounds
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.methods.fedlap import server
from fedlap_jax.checks import ConfigError
from fedlap_jax.methods.fedlap.client import client_step, local_approx
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns, RunFacts
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods import fedavg as fedavg_methods
from fedlap_jax.methods import fedlap as fedlap_methods
from fedlap_jax.models import count_params
from fedlap_jax.types import PyTree

# The programs compared bit for bit here differ in how an optimiser's state is built and how its
# update is written (through optax or by hand): elementwise arithmetic around the same gradients.
# They agree bit for bit under the tests' default compiler setting (XLA's older fusion emitters,
# conftest's note), checked with XLA:CPU's code for AVX-512, AVX2 and SSE4.2 (xla_cpu_max_isa),
# so no test here carries the ``bitwise`` mark: under XLA's default emitters the file took 2.2
# times the CPU seconds. A comparison that fails here but passes under the mark is a difference
# of fusion, not of the optimiser: mark that test.

K = 5
DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
_CLIENT = dict(
  ipc=2,
  iterations=1,
  max_outer=2,
  batch_loop=1,
  boost_loop=2,
  batch_size=32,
  radius=1e4,  # every while-loop iteration runs, so the model's steps reach the images
  calibrate_radius=False,
  dsa_strategy="",
)
# The paper's recipe (R_l synthetic epochs of the model) and the hybrid one (noisy real steps,
# FedAvg-delta start), both small.
PAPER = FedLAPConfig(
  client=ClientConfig(**_CLIENT, inner_loop=2, model_batch_size=8),
  server=ServerConfig(radius_strategy="constant", max_epochs=2, dsa_strategy=""),
  rounds=3,
  learning_rate=0.5,
  synthetic_init="noise",
)
HYBRID = FedLAPConfig(
  client=ClientConfig(
    **_CLIENT, average_targets=True, model_steps="noisy_real", inner_loop=0, dp=DP
  ),
  server=ServerConfig(
    radius_strategy="constant", max_epochs=1, dsa_strategy="", start="fedavg_delta"
  ),
  rounds=3,
  learning_rate=0.5,
  synthetic_init="noise",
)
FEDAVG = baselines.baseline_config(
  "fedavg", rounds=3, learning_rate=0.1, local_epochs=1, batch_size=32, prox_mu=0.0, dp=None
)
FEDAVG_HALF = baselines.baseline_config(
  "fedavg",
  rounds=3,
  learning_rate=0.1,
  local_epochs=1,
  batch_size=32,
  prox_mu=0.0,
  dp=None,
  server_lr=0.5,
)
ADAM = optax.scale_by_adam()  # one object: optimisers are jit statics hashed by identity


@pytest.fixture(scope="module")
def clients(clients):
  """The five stacked clients as NumPy arrays: picking one client or reading the labels on the
  host compiles nothing (eager indexing of a device array is a program per leaf shape)."""
  return jax.tree.map(np.asarray, clients)


def _pick(tree, k):
  """Entry ``k`` of every leaf, on the host."""
  return jax.tree.map(lambda a: np.asarray(a)[k], tree)


def _differs(a: PyTree, b: PyTree) -> bool:
  return any(
    not np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ------------------------------------------------------------------------------------------
# The derivation: the numeric fields are the SGD spec.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.5, 0.0), (0.9, 5e-4)])
def test_the_default_sgd_is_todays_optax_sgd_bit_for_bit(momentum, weight_decay):
  """``with_rate(sgd(m, wd), lr)`` against the chain the code built before: the same steps."""
  lr = 0.3
  today = optax.sgd(lr, momentum=momentum or None)
  if weight_decay:
    today = optax.chain(optax.add_decayed_weights(weight_decay), today)
  ours = optim.with_rate(optim.sgd(momentum, weight_decay), lr)
  rng = np.random.default_rng(0)  # NumPy inputs: nothing compiled outside the one program
  params = {"w": rng.normal(size=(7, 3)).astype(np.float32)}
  grads = [{"w": rng.normal(size=(7, 3)).astype(np.float32)} for _ in range(3)]

  @jax.jit
  def run(p, gs):
    out = []
    for tx in (today, ours):
      w, s = p, tx.init(p)
      for g in gs:
        u, s = tx.update(g, s, w)
        w = optax.apply_updates(w, u)
      out.append(w)
    return out

  a, b = run(params, grads)
  chex.assert_trees_all_equal(a, b)
  assert len(jax.tree.leaves(ours.init(params))) == (1 if momentum else 0)
  assert optim.sgd(momentum, weight_decay) is optim.sgd(momentum, weight_decay)  # memoised


# ------------------------------------------------------------------------------------------
# The spec: an optimiser as a config value.
# ------------------------------------------------------------------------------------------


def test_the_sgd_spec_is_todays_default_and_equal_specs_share_one_direction():
  """The default spec is plain SGD, the object the roles' defaults use (no new program); a
  role given it writes its step out as before (``written_out_or``: ``None``); equal settings,
  however written, are one spec and one optax object (one compilation)."""
  assert optim.Optimizer() == optim.SGD and optim.SGD.direction() is optim.sgd()
  assert optim.written_out_or(optim.SGD) is None
  spec = optim.Optimizer(momentum=0.9, weight_decay=5e-4)
  assert spec.direction() is optim.server_direction(0.9, 5e-4)
  assert optim.written_out_or(spec) is spec.direction()
  adam = optim.Optimizer(name="adam")
  assert adam == optim.Optimizer(name="adam", b1=0.9, b2=0.999, eps=1e-8)
  assert hash(adam) == hash(optim.Optimizer(name="adam", eps=1e-8))
  assert adam.direction() is optim.Optimizer(name="adam", eps=1e-8).direction()
  assert optim.Optimizer(name="yogi").direction() is not adam.direction()
  described = dataclasses.asdict(optim.Optimizer(name="yogi"))
  assert json.loads(json.dumps(described)) == described
  assert optim.Optimizer(**described) == optim.Optimizer(name="yogi")


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"name": "nadam"}, "name"),
    ({"name": "adam", "momentum": 0.9}, "momentum"),  # a hyper-parameter adam does not use
    ({"name": "adam", "nesterov": True}, "nesterov"),
    ({"b1": 0.9}, "b1"),  # sgd does not use it, even at adam's default
    ({"name": "adagrad", "b2": 0.99}, "b2"),
    ({"name": "sgd", "initial_accumulator": 0.1}, "initial_accumulator"),
    ({"name": "yogi", "b2": 1.0}, "b2"),
    ({"name": "adam", "b1": -0.1}, "b1"),
    ({"name": "adam", "eps": 0.0}, "eps"),
    ({"name": "adagrad", "initial_accumulator": -1.0}, "initial_accumulator"),
    ({"momentum": -0.5}, "momentum"),
    ({"weight_decay": float("nan")}, "weight_decay"),
    ({"nesterov": True}, "nesterov"),  # without momentum
    ({"momentum": 0.9, "nesterov": 1}, "nesterov"),
  ],
)
def test_a_bad_spec_is_refused_naming_the_field(kwargs, field):
  with pytest.raises(ConfigError) as err:
    optim.Optimizer(**kwargs)
  assert err.value.field == field


def test_each_spec_is_optax_own_optimiser_bit_for_bit():
  """``spec.with_rate(lr)`` against optax's optimiser of the name (``optax.adam``,
  ``optax.yogi``, ``optax.adagrad``, ``optax.sgd(nesterov=True)``, weight decay chained before):
  three steps, the same bits. One program for all of them."""
  lr = 0.05
  pairs = [
    (optim.Optimizer(name="adam"), optax.adam(lr)),
    (optim.Optimizer(name="adam", b2=0.99, eps=1e-3), optax.adam(lr, b2=0.99, eps=1e-3)),
    (optim.Optimizer(name="yogi"), optax.yogi(lr)),
    (optim.Optimizer(name="adagrad"), optax.adagrad(lr)),
    (
      optim.Optimizer(momentum=0.9, nesterov=True, weight_decay=1e-3),
      optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(lr, momentum=0.9, nesterov=True)),
    ),
  ]
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(7, 3)).astype(np.float32)}
  grads = [{"w": rng.normal(size=(7, 3)).astype(np.float32)} for _ in range(3)]

  @jax.jit
  def run(p, gs):
    out = []
    for spec, theirs in pairs:
      for tx in (spec.with_rate(lr), theirs):
        w, s = p, tx.init(p)
        for g in gs:
          u, s = tx.update(g, s, w)
          w = optax.apply_updates(w, u)
        out.append(w)
    return out

  out = run(params, grads)
  for i in range(len(pairs)):
    chex.assert_trees_all_equal(out[2 * i], out[2 * i + 1])
    assert _differs(out[2 * i], params)


# ------------------------------------------------------------------------------------------
# (a) The explicit default is the default, role by role.
# ------------------------------------------------------------------------------------------


_local_approx = jax.jit(local_approx, static_argnames=("apply_fn", "config", "image_optimizer"))
_client_step = jax.jit(
  client_step, static_argnames=("apply_fn", "config", "image_optimizer", "model_optimizer")
)


def _fedlap_client(apply_fn, params, clients, config, **optimisers):
  syn = _pick(federated.init_state(jax.random.PRNGKey(1), params, clients, config).synthetic, 0)
  return _client_step(
    jax.random.PRNGKey(2),
    apply_fn,
    params,
    syn,
    _pick(clients, 0),
    config,
    learning_rate=jnp.float32(0.3),
    **optimisers,
  )


def test_the_image_optimiser_default_is_todays_sgd(linear_apply_fn, linear_params, clients):
  c = PAPER.client
  syn = _pick(
    federated.init_state(jax.random.PRNGKey(1), linear_params, clients, PAPER).synthetic, 0
  )
  args = (jax.random.PRNGKey(2), linear_apply_fn, linear_params, syn, _pick(clients, 0), c)
  default = _local_approx(*args, learning_rate=jnp.float32(0.3))
  today = optax.sgd(c.image_lr, momentum=c.image_momentum)
  explicit = _local_approx(*args, learning_rate=jnp.float32(0.3), image_optimizer=today)
  chex.assert_trees_all_equal(default[0], explicit[0])
  adam = _local_approx(
    *args, learning_rate=jnp.float32(0.3), image_optimizer=optax.adam(c.image_lr)
  )
  assert _differs(default[0].x, adam[0].x)


@pytest.mark.parametrize("config", [PAPER, HYBRID], ids=["synthetic_epochs", "noisy_real"])
def test_the_client_model_optimiser_default_is_plain_sgd(
  linear_apply_fn, linear_params, clients, config
):
  default = _fedlap_client(linear_apply_fn, linear_params, clients, config)
  explicit = _fedlap_client(
    linear_apply_fn, linear_params, clients, config, model_optimizer=optim.sgd()
  )
  chex.assert_trees_all_equal(default, explicit)
  other = _fedlap_client(linear_apply_fn, linear_params, clients, config, model_optimizer=ADAM)
  # The model's trajectory moves differently, so the images matched along it do too.
  assert _differs(default[0].synthetic.x, other[0].synthetic.x)
  if config.server.start == "fedavg_delta":
    assert _differs(default[0].model_delta, other[0].model_delta)


_global_update = jax.jit(server.global_update, static_argnames=("apply_fn", "config", "optimizer"))


def _server_args(apply_fn, params, clients) -> tuple:
  """The positional arguments of :func:`fedlap_jax.methods.fedlap.server.global_update` on PAPER's
  initial synthetic sets, every client weighted alike, no radius."""
  state = federated.init_state(jax.random.PRNGKey(1), params, clients, PAPER)
  return (jax.random.PRNGKey(3), apply_fn, params, state.synthetic, np.ones(K, np.float32), np.inf)


@pytest.mark.parametrize(
  "config",
  [
    PAPER.server,
    ServerConfig(
      radius_strategy="constant", max_epochs=2, dsa_strategy="", momentum=0.9, weight_decay=5e-4
    ),
  ],
  ids=["fedlap", "momentum_decay"],
)
def test_the_server_optimiser_default_comes_from_momentum_and_weight_decay(
  linear_apply_fn, linear_params, clients, config
):
  args = _server_args(linear_apply_fn, linear_params, clients)
  default = _global_update(*args, learning_rate=jnp.float32(0.2), config=config)
  explicit = _global_update(
    *args,
    learning_rate=jnp.float32(0.2),
    config=config,
    optimizer=optim.sgd(config.momentum, config.weight_decay),
  )
  chex.assert_trees_all_equal(default, explicit)
  plain = _global_update(
    *args, learning_rate=jnp.float32(0.2), config=config, optimizer=optax.identity()
  )
  assert _differs(default[0], plain[0]) == bool(config.momentum or config.weight_decay)


SPEC_ADAM = optim.Optimizer(name="adam")


@pytest.mark.parametrize("config", [PAPER, HYBRID], ids=["synthetic_epochs", "noisy_real"])
def test_the_configs_model_optimiser_is_the_library_keyword(
  linear_apply_fn, linear_params, clients, config
):
  """``ClientConfig.model_optimizer`` (a config value) is the ``model_optimizer`` keyword:
  Adam from the config and Adam passed in are the same steps, bit for bit, and not SGD's."""
  spec = dataclasses.replace(
    config, client=dataclasses.replace(config.client, model_optimizer=SPEC_ADAM)
  )
  from_config = _fedlap_client(linear_apply_fn, linear_params, clients, spec)
  passed = _fedlap_client(
    linear_apply_fn, linear_params, clients, config, model_optimizer=SPEC_ADAM.direction()
  )
  chex.assert_trees_all_equal(from_config, passed)
  default = _fedlap_client(linear_apply_fn, linear_params, clients, config)
  assert _differs(default[0].synthetic.x, from_config[0].synthetic.x)


def test_the_configs_image_optimiser_is_the_library_keyword(
  linear_apply_fn, linear_params, clients
):
  """``ClientConfig.image_optimizer`` (a config value, stepped at ``image_lr``) is the
  ``image_optimizer`` keyword, bit for bit; without it, the paper's SGD of ``image_momentum``."""
  c = PAPER.client
  syn = _pick(
    federated.init_state(jax.random.PRNGKey(1), linear_params, clients, PAPER).synthetic, 0
  )
  spec = dataclasses.replace(c, image_optimizer=SPEC_ADAM, image_momentum=0.0)
  rest = (jax.random.PRNGKey(2), linear_apply_fn, linear_params, syn, _pick(clients, 0))
  from_config = _local_approx(*rest, spec, learning_rate=jnp.float32(0.3))
  passed = _local_approx(
    *rest, c, learning_rate=jnp.float32(0.3), image_optimizer=optax.adam(c.image_lr)
  )
  chex.assert_trees_all_equal(from_config, passed)
  default = _local_approx(*rest, c, learning_rate=jnp.float32(0.3))
  assert _differs(default[0].x, from_config[0].x)


def test_the_configs_server_optimiser_is_the_library_keyword(
  linear_apply_fn, linear_params, clients
):
  """``ServerConfig.optimizer`` (a config value) is the ``optimizer`` keyword of the server's
  descent, bit for bit; without it the direction is the SGD of momentum and weight decay (the
  same object, so today's program)."""
  args = _server_args(linear_apply_fn, linear_params, clients)
  config = PAPER.server
  assert config.direction() is optim.sgd(config.momentum, config.weight_decay)
  spec = dataclasses.replace(config, optimizer=SPEC_ADAM)
  from_config = _global_update(*args, learning_rate=jnp.float32(0.2), config=spec)
  passed = _global_update(
    *args, learning_rate=jnp.float32(0.2), config=config, optimizer=SPEC_ADAM.direction()
  )
  chex.assert_trees_all_equal(from_config, passed)
  default = _global_update(*args, learning_rate=jnp.float32(0.2), config=config)
  assert _differs(default[0], from_config[0])
  chex.assert_trees_all_equal(
    server.server_state(linear_params, spec),
    server.server_state(linear_params, config, SPEC_ADAM.direction()),
  )


@pytest.mark.parametrize(
  ("make", "field"),
  [
    # Heavy-ball SGD is server.momentum / server.weight_decay: one source.
    (lambda: ServerConfig(optimizer=optim.Optimizer(momentum=0.9)), "server.optimizer"),
    (lambda: ServerConfig(momentum=0.9, optimizer=SPEC_ADAM), "server.momentum"),
    (lambda: ServerConfig(weight_decay=5e-4, optimizer=SPEC_ADAM), "server.weight_decay"),
    (lambda: ServerConfig(optimizer="adam"), "server.optimizer"),
    # A model optimiser where the model takes no step would be ignored.
    (lambda: ClientConfig(inner_loop=0, model_optimizer=SPEC_ADAM), "model_optimizer"),
    (lambda: ClientConfig(max_outer=1, inner_loop=2, model_optimizer=SPEC_ADAM), "model_optimizer"),
    (lambda: ClientConfig(inner_loop=1, model_optimizer="adam"), "model_optimizer"),
    # The images' SGD is image_momentum: one source.
    (lambda: ClientConfig(image_optimizer=SPEC_ADAM), "image_momentum"),
    (
      lambda: ClientConfig(image_momentum=0.0, image_optimizer=optim.Optimizer(momentum=0.5)),
      "image_optimizer",
    ),
  ],
)
def test_fedlaps_optimiser_fields_refuse_naming_the_field(make, field):
  with pytest.raises(ConfigError) as err:
    make()
  assert err.value.field == field


_baseline_client = jax.jit(
  baselines.client_step, static_argnames=("apply_fn", "config", "optimizer")
)


def test_the_baseline_client_default_is_sgd_written_out(linear_apply_fn, linear_params, clients):
  args = (jax.random.PRNGKey(4), linear_apply_fn, linear_params, _pick(clients, 0), FEDAVG)
  default = _baseline_client(*args, learning_rate=jnp.float32(0.1))
  explicit = _baseline_client(*args, learning_rate=jnp.float32(0.1), optimizer=optim.sgd())
  chex.assert_trees_all_equal(default, explicit)
  momentum = _baseline_client(*args, learning_rate=jnp.float32(0.1), optimizer=optim.sgd(0.9))
  assert _differs(default[0], momentum[0])


def test_the_baseline_server_default_is_fedavgs_step_written_out():
  rng = np.random.default_rng(5)  # NumPy inputs; both steps jitted (eagerness is not the point)
  x = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.array([0.1, -0.2], np.float32)}
  ys = jax.tree.map(
    lambda a: a[None] + np.float32(0.3) * rng.normal(size=(3, *a.shape)).astype(np.float32), x
  )
  n = np.array([10, 20, 5], np.int32)
  step = jax.jit(baselines.server_step_with_state, static_argnames=("config", "optimizer"))
  for cfg in (FEDAVG, FEDAVG_HALF):
    today, _, w = step(x, ys, cfg, (), num_records=n)  # optimizer=None: written out
    explicit = step(
      x, ys, cfg, baselines.server_state(x, cfg, optim.sgd()), num_records=n, optimizer=optim.sgd()
    )
    chex.assert_trees_all_equal(today, explicit[0])
    chex.assert_trees_all_equal(w, explicit[2])
    adam = step(x, ys, cfg, baselines.server_state(x, cfg, ADAM), num_records=n, optimizer=ADAM)
    assert _differs(today, adam[0])


def test_a_round_with_every_default_passed_is_the_default_round(
  linear_apply_fn, linear_params, clients
):
  defaults = dict(
    image_optimizer=optim.image_sgd(PAPER.client.image_lr, PAPER.client.image_momentum),
    model_optimizer=optim.sgd(),
    server_optimizer=optim.sgd(),
  )
  state = federated.init_state(jax.random.PRNGKey(7), linear_params, clients, PAPER)
  model = ModelFns(linear_apply_fn)
  run = dict(config=PAPER, model=model, client_backend="map")
  a, _ = rounds._round_jit(state, clients, method=REGISTRY["fedlap"], **run)
  b, _ = rounds._round_jit(state, clients, method=fedlap_methods.method(**defaults), **run)
  chex.assert_trees_all_equal(a, b)

  base = baselines.init_baseline_state(jax.random.PRNGKey(8), linear_params, clients, FEDAVG)
  run = dict(config=FEDAVG, model=model, client_backend="map")
  c, _ = rounds._round_jit(base, clients, method=REGISTRY["fedavg"], **run)
  explicit = base._replace(opt_state=baselines.server_state(linear_params, FEDAVG, optim.sgd()))
  sgd_written = fedavg_methods.family(
    "fedavg", client_optimizer=optim.sgd(), server_optimizer=optim.sgd()
  )
  d, _ = rounds._round_jit(explicit, clients, method=sgd_written, **run)
  chex.assert_trees_all_equal(c.params, d.params)
  chex.assert_trees_all_equal(c.key, d.key)


# ------------------------------------------------------------------------------------------
# (b) Another optimiser; the server's state carried across rounds.
# ------------------------------------------------------------------------------------------


def _count(opt_state) -> int:
  """The step count of the one Adam state inside ``opt_state``."""
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
  return int(adam.count)


def test_fedadams_server_state_is_carried_across_rounds(linear_apply_fn, linear_params, clients):
  facts = rounds.run_facts(linear_params, clients)
  model = ModelFns(linear_apply_fn)
  fedadam_server = fedavg_methods.family("fedavg", server_optimizer=ADAM)
  adam = rounds.algorithm(fedadam_server, FEDAVG, model, facts)
  plain = rounds.algorithm(REGISTRY["fedavg"], FEDAVG, model, facts)
  key = jax.random.PRNGKey(9)
  s0 = adam.init(key, linear_params, clients)
  assert _count(s0.opt_state) == 0
  s1, _ = adam.round(s0, clients)
  s2, _ = adam.round(s1, clients)
  assert (_count(s1.opt_state), _count(s2.opt_state)) == (1, 2)
  # The second moment accumulates over both rounds' mean deltas.
  assert _differs(s1.opt_state, s2.opt_state)
  p0 = plain.init(key, linear_params, clients)
  assert p0.opt_state == ()
  p1, _ = plain.round(p0, clients)
  assert _differs(p1.params, s1.params)
  chex.assert_trees_all_equal(p1.key, s1.key)


def test_fedlap_carries_its_server_state_only_when_asked(linear_apply_fn, linear_params, clients):
  facts = RunFacts(tuple(clients.x.shape[2:]), K, count_params(linear_params), 10)
  model = ModelFns(linear_apply_fn)
  common = dict(client_backend="map")
  adam_server = fedlap_methods.method(server_optimizer=ADAM)
  carrying = dataclasses.replace(PAPER, server=dataclasses.replace(PAPER.server, carry_state=True))
  carried = rounds.algorithm(adam_server, carrying, model, facts, **common)
  fresh = rounds.algorithm(adam_server, PAPER, model, facts, **common)
  key = jax.random.PRNGKey(10)
  s0 = carried.init(key, linear_params, clients)
  s1, m1 = carried.round(s0, clients)
  s2, m2 = carried.round(s1, clients)
  steps = int(m1.server.steps), int(m2.server.steps)
  assert (_count(s0.opt_state), _count(s1.opt_state), _count(s2.opt_state)) == (
    0,
    steps[0],
    steps[0] + steps[1],
  )
  f0 = fresh.init(key, linear_params, clients)
  assert f0.opt_state == ()  # the paper's recipe: the server's optimiser starts afresh
  f1, _ = fresh.round(f0, clients)
  f2, _ = fresh.round(f1, clients)
  assert f2.opt_state == ()
  chex.assert_trees_all_equal(f1.params, s1.params)  # round 1 starts from a fresh state both ways
  assert _differs(f2.params, s2.params)  # round 2 starts from Adam's moments of round 1
  d1, _ = rounds.algorithm(REGISTRY["fedlap"], PAPER, model, facts, **common).round(f0, clients)
  assert _differs(d1.params, f1.params)
