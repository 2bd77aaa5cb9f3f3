"""Which models DP accepts, for every per-example method: BatchNorm (statistics of a batch, state
outside the parameters) is refused in flax.linen, Flax NNX and Equinox models alike, ``auto``
included; NNX, Equinox and plain-JAX models without it get ``vmap``, and the layer-wise path's
refusal says which models it serves."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

from fedlap_jax import baselines, per_example, privacy
from fedlap_jax.methods.fedlap import client
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.methods.fedlap.config import ClientConfig
from fedlap_jax.dp_config import DPConfig
from conftest import raises_field

METHODS = ("auto", "vmap", "layerwise", "jax_privacy")
# NumPy inputs: built without compiling anything (JAX compiles every operation it runs outside
# ``jit`` on a new shape as a program of its own).
X = np.random.default_rng(0).standard_normal((8, 4, 4, 1), np.float32)
Y = np.arange(8, dtype=np.int32) % 3
PAD = np.zeros(8, bool)


def _flat(x):
  return x.reshape(x.shape[0], -1)


# flax.linen: BatchNorm's statistics reach the model through the variables it is applied with.
class LinenBN(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(5)(_flat(x))
    return nn.Dense(3)(nn.BatchNorm(use_running_average=not train)(x))


def linen_models():
  m = LinenBN()
  v = jax.jit(m.init)(jax.random.key(1), X)
  stats = v["batch_stats"]
  return {
    "linen, running averages": (
      lambda p, x: m.apply({"params": p, "batch_stats": stats}, x, train=False),
      v["params"],
    ),
    "linen, batch statistics": (
      lambda p, x: m.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])[0],
      v["params"],
    ),
  }


class NnxNet(nnx.Module):
  def __init__(self, norm, rngs):
    self.a = nnx.Linear(16, 5, rngs=rngs)
    self.norm = norm(5, rngs=rngs)
    self.b = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.b(self.norm(self.a(_flat(x))))


class Trainer:  # a user's object holding the model
  def __init__(self, model):
    self.model = model

  def apply(self, params, x):
    graphdef, _, rest = nnx.split(self.model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)(x)


def _nnx_net(norm):
  """``NnxNet(norm, Rngs(0))``, initialised in one program (``nnx.jit``)."""
  return nnx.jit(lambda: NnxNet(norm, nnx.Rngs(0)))()


def nnx_models():
  train = _nnx_net(nnx.BatchNorm)
  graphdef, state = nnx.split(train)  # Param and BatchStat, one pytree passed as params
  evaluated = _nnx_net(nnx.BatchNorm)
  evaluated.eval()  # running averages, held in the closure
  g_eval, p_eval, rest = nnx.split(evaluated, nnx.Param, ...)
  trainer = Trainer(evaluated)
  return {
    "nnx, whole state as params": (lambda s, x: nnx.merge(graphdef, s)(x), state),
    "nnx, statistics in the closure": (lambda p, x: nnx.merge(g_eval, p, rest)(x), p_eval),
    "nnx, a trainer's bound method": (trainer.apply, p_eval),
  }


def equinox_models():
  def make(key):
    k1, k2 = jax.random.split(key)
    return eqx.nn.Sequential(
      [
        eqx.nn.Lambda(lambda x: x.reshape(-1)),
        eqx.nn.Linear(16, 5, key=k1),
        eqx.nn.BatchNorm(5, axis_name="batch"),
        eqx.nn.Linear(5, 3, key=k2),
      ]
    )

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, state = eqx.filter_jit(eqx.nn.make_with_state(make))(jax.random.key(2))
  model = eqx.nn.inference_mode(model)
  params, static = eqx.partition(model, eqx.is_array)

  def apply(p, x):
    net = eqx.combine(p, static)
    return jax.vmap(lambda xi: net(xi, state)[0])(x)

  return {"equinox, BatchNorm": (apply, params)}


BATCHNORM = {**linen_models(), **nnx_models(), **equinox_models()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(BATCHNORM))
def test_batchnorm_is_refused_under_dp_for_every_method(name, method):
  """a27beca: accepted without a word (``auto`` fell back to vmap)."""
  apply_fn, params = BATCHNORM[name]
  fn = jax.jit(
    functools.partial(privacy.clipped_gradient_sum, apply_fn, l2_clip_norm=1.0, method=method)
  )
  with pytest.raises(per_example.NotDpSafe) as err:
    fn(params, X, Y, PAD)
  assert isinstance(err.value, ConfigError) and err.value.field == "apply_fn"
  assert "BatchNorm" in str(err.value) or "BatchStat" in str(err.value)
  assert "for every dp.per_example_method" in str(err.value)


def _clean_models():
  graphdef, state = nnx.split(_nnx_net(nnx.LayerNorm))
  net = eqx.nn.Sequential(
    [eqx.nn.Lambda(lambda x: x.reshape(-1)), eqx.nn.Linear(16, 3, key=jax.random.key(3))]
  )
  params, static = eqx.partition(net, eqx.is_array)
  return {
    "nnx": (lambda s, x: nnx.merge(graphdef, s)(x), state),
    "equinox": (lambda p, x: jax.vmap(eqx.combine(p, static))(x), params),
    "plain jax": (lambda w, x: _flat(x) @ w, np.full((16, 3), 0.1, np.float32)),
  }


@pytest.mark.parametrize("name", ["nnx", "equinox", "plain jax"])
def test_other_models_get_vmap_and_layerwise_says_whom_it_serves(name):
  apply_fn, params = _clean_models()[name]
  assert per_example.auto_plan(apply_fn, params, X) == ("vmap", None)
  with pytest.raises(per_example.Unsupported) as err:
    per_example.clipped_gradient_sum(apply_fn, params, X, Y, PAD, l2_clip_norm=1.0)
  assert isinstance(err.value, ConfigError) and err.value.field == "dp.per_example_method"
  assert "serves flax.linen models" in str(err.value) and "NNX" in str(err.value)
  got = {
    m: jax.jit(
      functools.partial(privacy.clipped_gradient_sum, apply_fn, l2_clip_norm=1.0, method=m)
    )(params, X, Y, PAD)
    for m in ("auto", "vmap")
  }
  for a, b in zip(jax.tree.leaves(got["auto"]), jax.tree.leaves(got["vmap"])):
    np.testing.assert_array_equal(a, b)


def test_local_approx_refuses_a_batchnorm_model_only_under_dp():
  apply_fn, params = BATCHNORM["nnx, statistics in the closure"]
  data = ClientData(X, Y, np.ones(8, bool))
  synthetic = SyntheticSet(X[:3], np.arange(3, dtype=np.int32), np.ones(3, bool))
  config = ClientConfig(
    ipc=1,
    iterations=1,
    max_outer=1,
    batch_loop=1,
    boost_loop=1,
    inner_loop=0,
    batch_size=4,
    radius=1.0,
    calibrate_radius=False,
    dsa_strategy="",
  )
  run = jax.jit(
    functools.partial(client.local_approx, apply_fn=apply_fn, learning_rate=0.1),
    static_argnames=("config",),
  )
  run(jax.random.key(1), params=params, synthetic=synthetic, client_data=data, config=config)
  dp = dataclasses.replace(config, dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-3))
  with raises_field("apply_fn", per_example.NotDpSafe):
    run(jax.random.key(1), params=params, synthetic=synthetic, client_data=data, config=dp)


@pytest.mark.parametrize("entry", ["local_approx", "baseline", "condense"])
def test_a_train_mode_nnx_batchnorm_gets_not_dp_safe_before_any_trace(entry):
  """51512fe: Flax's TraceContextError (``Cannot mutate BatchStat from a different trace
  level``) from the first abstract trace of the model, the class count's; eval mode was
  already refused clearly."""
  model = _nnx_net(nnx.BatchNorm)  # train mode: each call updates the statistics
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def apply_fn(p, x):
    return nnx.merge(graphdef, p, rest)(x)

  data = ClientData(X, Y, np.ones(8, bool))
  synthetic = SyntheticSet(X[:3], np.arange(3, dtype=np.int32), np.ones(3, bool))
  dp = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-3)
  key = jax.random.key(1)
  calls = {
    "local_approx": lambda: client.local_approx(
      key,
      apply_fn,
      params,
      synthetic,
      data,
      ClientConfig(
        ipc=1,
        iterations=1,
        max_outer=1,
        batch_loop=1,
        boost_loop=1,
        inner_loop=0,
        batch_size=4,
        radius=1.0,
        calibrate_radius=False,
        dsa_strategy="",
        dp=dp,
      ),
      learning_rate=0.1,
    ),
    "baseline": lambda: baselines.client_update(
      key,
      apply_fn,
      params,
      data,
      learning_rate=0.1,
      local=baselines.LocalTraining(
        epochs=1, batch_size=4, fixed_steps=1, l2_clip_norm=1.0, noise_multiplier=1.0
      ),
      num_steps=1,
    ),
    "condense": lambda: condensation.condense(
      key,
      apply_fn,
      lambda k: params,
      synthetic,
      data,
      condensation.CondensationConfig(
        ipc=1,
        networks=1,
        outer_loop=1,
        inner_loop=1,
        batch_loop=1,
        batch_size=4,
        classwise=False,
        dp=dp,
      ),
    ),
  }
  with raises_field("apply_fn", per_example.NotDpSafe):
    jax.jit(calls[entry])()
