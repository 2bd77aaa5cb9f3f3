"""Labels outside ``[0, K)`` (``K`` the model's logits) in client data or synthetic sets.

Where the values are concrete (host helpers, eager calls) each entry point refuses them with a
ConfigError before computing; inside ``jit`` and ``vmap`` the values are unknown at trace time,
and every float output of the step is NaN instead (not only the loss: DP's clipped sums drop
non-finite per-example gradients). A linear classifier on 8x8 digits, tiny loops.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import baselines
from fedlap_jax.methods.fedlap import client
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.fedlap import server
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  num_classes_of,
  pad_client,
  stack_clients,
)
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from conftest import raises_field

N, IPC = 40, 2
LOOPS = ClientConfig(
  ipc=IPC,
  iterations=1,
  max_outer=2,
  batch_loop=1,
  boost_loop=1,
  inner_loop=1,
  batch_size=16,
  radius=1e3,
  mse_weight=0.0,
  calibrate_radius=False,
  dsa_strategy="",
)
DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
SERVER = ServerConfig(radius_strategy="fixed", max_epochs=1, batch_size=8, dsa_strategy="")
LOCAL = baselines.LocalTraining(epochs=1, batch_size=8, fixed_steps=2)
LOCAL_DP = dataclasses.replace(LOCAL, l2_clip_norm=1.0, noise_multiplier=1.0)


@pytest.fixture(scope="module")
def data(client_parts):
  x, y = client_parts[0]
  return jax.device_put(ClientData(x[:N], y[:N], np.ones(N, bool)))


@pytest.fixture(scope="module")
def synthetic():
  """Built with NumPy, then put on the device: compiles nothing (JAX compiles every operation
  it runs outside ``jit`` on a new shape as a program of its own)."""
  y = np.array([5, 5, 6, 6], np.int32)
  x = np.random.default_rng(0).standard_normal((4, 8, 8, 1), np.float32)
  return jax.device_put(SyntheticSet(x, y, np.ones(4, bool)))


def _bad(labels, value):
  labels = np.array(labels)
  labels[1] = value
  return jax.device_put(labels)


def _local(apply_fn, params, synthetic, data, config=LOOPS):
  return client.local_approx(
    jax.random.PRNGKey(1), apply_fn, params, synthetic, data, config, learning_rate=0.1
  )


def _global(apply_fn, params, synthetic):
  stacked = jax.tree.map(lambda a: a[None], synthetic)
  return server.global_update(
    jax.random.PRNGKey(2),
    apply_fn,
    params,
    stacked,
    np.ones(1, np.float32),
    np.inf,
    learning_rate=0.1,
    config=SERVER,
  )


def _baseline(apply_fn, params, data, local=LOCAL):
  return baselines.client_update(
    jax.random.PRNGKey(3), apply_fn, params, data, learning_rate=0.1, local=local, num_steps=2
  )


def _condense(apply_fn, params, synthetic, data):
  config = condensation.CondensationConfig(
    ipc=IPC, networks=1, outer_loop=1, inner_loop=1, batch_loop=1, batch_size=4
  )
  return condensation.condense(
    jax.random.PRNGKey(4), apply_fn, lambda k: params, synthetic, data, config
  )


def _floats(tree):
  return [np.asarray(a) for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]


def _all_finite(leaves):
  return all(bool(np.all(np.isfinite(np.asarray(a)))) for a in leaves)


def _all_nan(leaves):
  return all(bool(np.all(np.isnan(np.asarray(a)))) for a in leaves)


# The traced runs, each ``run(f, p, s, d)`` jitted once for the file (the model static): the
# parametrised tests share their programs.
_TRACED_RUNS = {
  "local_approx, data": lambda f, p, s, d: _local(f, p, s, d),
  "local_approx under DP, data": lambda f, p, s, d: _local(
    f, p, s, d, dataclasses.replace(LOOPS, dp=DP)
  ),
  "baseline": lambda f, p, s, d: _baseline(f, p, d),
  "baseline under DP": lambda f, p, s, d: _baseline(f, p, d, LOCAL_DP),
  "condense": lambda f, p, s, d: _condense(f, p, s, d),
}


@functools.lru_cache(maxsize=None)
def _jitted(name):
  return jax.jit(_TRACED_RUNS[name], static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _global_jit(f, p, s):
  return _global(f, p, s)


@functools.partial(jax.jit, static_argnums=0)
def _vmapped_dp_baseline(f, p, two):
  return jax.vmap(lambda d: _baseline(f, p, d, LOCAL_DP))(two)


def test_the_class_count_is_the_model_output_width(linear_apply_fn, linear_params):
  assert num_classes_of(linear_apply_fn, linear_params, (8, 8, 1)) == 10
  with raises_field("apply_fn"):
    num_classes_of(lambda p, x: jnp.sum(x), linear_params, (8, 8, 1))


@pytest.mark.parametrize("value", [10, 12, -1])
def test_concrete_labels_out_of_range_are_refused_before_anything_runs(
  value, linear_apply_fn, linear_params, synthetic, data
):
  """a27beca: finite outputs (a label -1 trained as class 9, 12 as no class at all)."""
  f, p = linear_apply_fn, linear_params
  bad_data = data._replace(y=_bad(data.y, value))
  bad_syn = synthetic._replace(y=_bad(synthetic.y, value))
  fedlap = FedLAPConfig(client=LOOPS, server=SERVER, rounds=2, synthetic_init="noise")
  calls = {
    "client_data.y": lambda: _local(f, p, synthetic, bad_data),
    "synthetic.y": lambda: _local(f, p, bad_syn, data),
    "data.y": lambda: _baseline(f, p, bad_data),
    "client_data.y ": lambda: _condense(f, p, synthetic, bad_data),
    "synthetic.y ": lambda: _global(f, p, bad_syn),
    "client_data.y  ": lambda: client.client_step(
      jax.random.PRNGKey(1), f, p, synthetic, bad_data, fedlap, learning_rate=0.1
    ),
    "synthetic.y  ": lambda: baselines.client_step(
      jax.random.PRNGKey(3),
      f,
      p,
      bad_data,
      baselines.baseline_config(
        "fedavg", rounds=2, learning_rate=0.1, batch_size=8, dp=None, max_client_size=N
      ),
      learning_rate=0.1,
    ),
  }
  for field, call in calls.items():
    with pytest.raises(ConfigError) as err:
      call()
    want = "data.y" if field == "synthetic.y  " else field.strip()
    assert err.value.field == want and err.value.value == [value], (field, err.value)
    assert "in [0, 10)" in str(err.value) and "10 output logits" in str(err.value)


def test_a_client_with_weight_zero_is_not_checked(linear_apply_fn, linear_params, synthetic):
  two = jax.device_put(
    jax.tree.map(
      lambda a, b: np.stack([a, b]), synthetic, synthetic._replace(y=_bad(synthetic.y, 12))
    )
  )
  params, _ = server.global_update(  # eager: the labels are concrete, checked on the host
    jax.random.PRNGKey(2),
    linear_apply_fn,
    linear_params,
    two,
    np.array([1.0, 0.0], np.float32),
    np.inf,
    learning_rate=0.1,
    config=SERVER,
  )
  assert _all_finite(jax.tree.leaves(params))


@pytest.mark.parametrize("value", [12, -1])
def test_traced_labels_out_of_range_make_every_float_output_nan(
  value, linear_apply_fn, linear_params, synthetic, data
):
  f, p = linear_apply_fn, linear_params
  bad_data = data._replace(y=_bad(data.y, value))
  bad_syn = synthetic._replace(y=_bad(synthetic.y, value))
  for name in _TRACED_RUNS:
    run = _jitted(name)
    good = run(f, p, synthetic, data)
    assert _all_finite(_floats(good)), name
    out = run(f, p, synthetic, bad_data)
    assert _floats(out) and _all_nan(_floats(out)), name
  for name, out in {
    # The program of "local_approx under DP, data" above, run on the bad synthetic labels.
    "local_approx, synthetic": _jitted("local_approx under DP, data")(f, p, bad_syn, data),
    "global_update": _global_jit(f, p, bad_syn),
  }.items():
    assert _all_nan(_floats(out)), name
  # Vmapped clients: only the client with the bad label is poisoned.
  two = jax.tree.map(lambda a, b: np.stack([a, b]), data, bad_data)
  w, _ = _vmapped_dp_baseline(f, p, two)
  for leaf in jax.tree.leaves(w):
    leaf = np.asarray(leaf)
    assert bool(np.all(np.isfinite(leaf[0]))) and bool(np.all(np.isnan(leaf[1])))


def test_in_range_labels_give_the_same_numbers_as_before(
  linear_apply_fn, linear_params, synthetic, data
):
  """The check adds nothing to a valid step: eager (checked on the host) and jitted (folded
  in) agree bit for bit."""
  f, p = linear_apply_fn, linear_params
  eager = _baseline(f, p, data)
  traced = jax.jit(lambda d: _baseline(f, p, d))(data)
  chex.assert_trees_all_equal(eager, traced)


def test_stack_clients_and_pad_client_know_the_class_count(client_parts):
  (x0, y0), (x1, y1) = client_parts[:2]
  stack_clients([x0, x1], [y0, y1], num_classes=10)
  with pytest.raises(ConfigError) as err:
    stack_clients([x0, x1], [y0, np.where(y1 == y1[0], 10, y1)], num_classes=10)
  assert err.value.field == "ys[1]" and err.value.value == [10]
  with raises_field("num_classes"):
    stack_clients([x0], [y0], num_classes=0)
  one = pad_client(x0, y0, capacity=400, num_classes=10)
  assert one.x.shape == (400, 8, 8, 1) and int(one.mask.sum()) == len(y0)
  np.testing.assert_array_equal(np.asarray(one.y[: len(y0)]), y0)
  with pytest.raises(ConfigError) as err:
    pad_client(x0, y0, capacity=len(y0) - 1)
  assert (err.value.field, err.value.value) == ("capacity", len(y0) - 1)
  with raises_field("ys[0]"):
    pad_client(x0, np.full_like(y0, 12), capacity=400, num_classes=10)


def _nan_at(x, value=np.nan):
  x = np.array(x)
  x[1, 0, 0, 0] = value
  return jax.device_put(x)


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize(
  "entry", ["pad_client", "stack_clients", "local_approx", "client_step", "baseline", "condense"]
)
def test_concrete_non_finite_images_are_refused_before_anything_runs(
  entry, value, linear_apply_fn, linear_params, synthetic, data
):
  """51512fe: accepted, and under DP clipped away (finite outputs from all-NaN data)."""
  f, p = linear_apply_fn, linear_params
  bad = data._replace(x=_nan_at(data.x, value))
  fedlap = FedLAPConfig(client=LOOPS, server=SERVER, rounds=2, synthetic_init="noise")
  calls = {
    "pad_client": ("xs[0]", lambda: pad_client(np.asarray(bad.x), np.asarray(bad.y), capacity=N)),
    "stack_clients": (
      "xs[1]",
      lambda: stack_clients([np.asarray(data.x), np.asarray(bad.x)], [data.y, data.y]),
    ),
    "local_approx": ("client_data.x", lambda: _local(f, p, synthetic, bad)),
    "client_step": (
      "client_data.x",
      lambda: client.client_step(
        jax.random.PRNGKey(1), f, p, synthetic, bad, fedlap, learning_rate=0.1
      ),
    ),
    "baseline": (
      "data.x",
      lambda: baselines.client_step(
        jax.random.PRNGKey(3),
        f,
        p,
        bad,
        baselines.baseline_config(
          "fedavg", rounds=2, learning_rate=0.1, batch_size=8, dp=None, max_client_size=N
        ),
        learning_rate=0.1,
      ),
    ),
    "condense": ("client_data.x", lambda: _condense(f, p, synthetic, bad)),
  }
  field, call = calls[entry]
  with pytest.raises(ConfigError) as err:
    call()
  assert err.value.field == field and "record 1" in str(err.value)
  with pytest.raises(ConfigError) as err:  # the synthetic set's images are checked alike
    _local(f, p, synthetic._replace(x=_nan_at(synthetic.x, value)), data)
  assert err.value.field == "synthetic.x"


def test_traced_non_finite_images_make_every_float_output_nan(
  linear_apply_fn, linear_params, synthetic, data
):
  """All-NaN data under DP: 51512fe returned a finite synthetic set (every per-example gradient
  clipped away), now every float output is NaN."""
  f, p = linear_apply_fn, linear_params
  run = _jitted("local_approx under DP, data")
  out = run(f, p, synthetic, data._replace(x=jax.device_put(np.full(data.x.shape, np.nan))))
  assert _floats(out) and _all_nan(_floats(out))
  out = _jitted("baseline under DP")(f, p, synthetic, data._replace(x=_nan_at(data.x)))
  assert _all_nan(_floats(out))


@pytest.mark.parametrize(
  "fields, field",
  [
    ({"noise_multiplier": 0.01}, "dp.noise_multiplier"),
    ({"noise_multiplier": 0.29}, "dp.noise_multiplier"),
    ({"delta": 0.5}, "dp.delta"),
    ({"delta": 0.9}, "dp.delta"),
  ],
)
def test_dp_configs_no_ledger_accepts_are_refused_when_built(fields, field):
  """51512fe built them and trained; only the ledger refused them, after training."""
  with pytest.raises(ConfigError) as err:
    DPConfig(**{"noise_multiplier": 1.0, "l2_clip_norm": 1.0, "delta": 1e-5, **fields})
  assert err.value.field == field and err.value.value == next(iter(fields.values()))
  DPConfig(noise_multiplier=0.3, l2_clip_norm=1.0, delta=0.49)  # the edges are accepted


def test_local_approx_refuses_a_delta_of_one_over_the_records_it_sees(
  linear_apply_fn, linear_params, synthetic, data
):
  f, p = linear_apply_fn, linear_params
  n = int(np.sum(data.mask))  # 40 records
  for delta in (1.0 / n, 0.1):
    config = dataclasses.replace(LOOPS, dp=dataclasses.replace(DP, delta=delta))
    with pytest.raises(ConfigError) as err:
      _local(f, p, synthetic, data, config)
    assert (err.value.field, err.value.value) == ("dp.delta", delta)
  _local(f, p, synthetic, data, dataclasses.replace(LOOPS, dp=dataclasses.replace(DP, delta=0.02)))
