"""Labels outside ``[0, K)`` (``K`` the model's logits) in client data or synthetic sets.

Where the values are concrete (host helpers, eager calls) each entry point refuses them with a
ConfigError before computing; inside ``jit`` and ``vmap`` the values are unknown at trace time,
and every float output of the step is NaN instead (not only the loss: DP's clipped sums drop
non-finite per-example gradients). A linear classifier on 8x8 digits, tiny loops.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import baselines, client, condensation, server
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  num_classes_of,
  pad_client,
  stack_clients,
)
from fedlap_jax.config import ClientConfig, DPConfig, FedLAPConfig, ServerConfig

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
  return ClientData(jnp.asarray(x[:N]), jnp.asarray(y[:N]), jnp.ones(N, bool))


@pytest.fixture(scope="module")
def synthetic():
  y = jnp.array([5, 5, 6, 6], jnp.int32)
  return SyntheticSet(jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 1)), y, jnp.ones(4, bool))


def _bad(labels, value):
  return labels.at[1].set(value)


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
    jnp.ones(1),
    jnp.inf,
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
  return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]


def test_the_class_count_is_the_model_output_width(linear_apply_fn, linear_params):
  assert num_classes_of(linear_apply_fn, linear_params, (8, 8, 1)) == 10
  with pytest.raises(ConfigError, match="apply_fn"):
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
  two = jax.tree.map(
    lambda a, b: jnp.stack([a, b]), synthetic, synthetic._replace(y=_bad(synthetic.y, 12))
  )
  params, _ = server.global_update(
    jax.random.PRNGKey(2),
    linear_apply_fn,
    linear_params,
    two,
    jnp.array([1.0, 0.0]),
    jnp.inf,
    learning_rate=0.1,
    config=SERVER,
  )
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(params))


@pytest.mark.parametrize("value", [12, -1])
def test_traced_labels_out_of_range_make_every_float_output_nan(
  value, linear_apply_fn, linear_params, synthetic, data
):
  f, p = linear_apply_fn, linear_params
  bad_data = data._replace(y=_bad(data.y, value))
  bad_syn = synthetic._replace(y=_bad(synthetic.y, value))
  dp = dataclasses.replace(LOOPS, dp=DP)
  runs = {
    "local_approx, data": lambda s, d: _local(f, p, s, d),
    "local_approx under DP, data": lambda s, d: _local(f, p, s, d, dp),
    "baseline": lambda s, d: _baseline(f, p, d),
    "baseline under DP": lambda s, d: _baseline(f, p, d, LOCAL_DP),
    "condense": lambda s, d: _condense(f, p, s, d),
  }
  for name, run in runs.items():
    good = jax.jit(run)(synthetic, data)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in _floats(good)), name
    out = jax.jit(run)(synthetic, bad_data)
    assert _floats(out) and all(bool(jnp.all(jnp.isnan(a))) for a in _floats(out)), name
  for name, out in {
    "local_approx, synthetic": jax.jit(lambda s: _local(f, p, s, data, dp))(bad_syn),
    "global_update": jax.jit(lambda s: _global(f, p, s))(bad_syn),
  }.items():
    assert all(bool(jnp.all(jnp.isnan(a))) for a in _floats(out)), name
  # Vmapped clients: only the client with the bad label is poisoned.
  two = jax.tree.map(lambda a, b: jnp.stack([a, b]), data, bad_data)
  w, _ = jax.jit(jax.vmap(lambda d: _baseline(f, p, d, LOCAL_DP)))(two)
  for leaf in jax.tree.leaves(w):
    assert bool(jnp.all(jnp.isfinite(leaf[0]))) and bool(jnp.all(jnp.isnan(leaf[1])))


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
  with pytest.raises(ConfigError, match="num_classes"):
    stack_clients([x0], [y0], num_classes=0)
  one = pad_client(x0, y0, capacity=400, num_classes=10)
  assert one.x.shape == (400, 8, 8, 1) and int(one.mask.sum()) == len(y0)
  np.testing.assert_array_equal(np.asarray(one.y[: len(y0)]), y0)
  with pytest.raises(ConfigError) as err:
    pad_client(x0, y0, capacity=len(y0) - 1)
  assert (err.value.field, err.value.value) == ("capacity", len(y0) - 1)
  with pytest.raises(ConfigError, match=r"ys\[0\] holds labels \[12\]"):
    pad_client(x0, np.full_like(y0, 12), capacity=400, num_classes=10)
