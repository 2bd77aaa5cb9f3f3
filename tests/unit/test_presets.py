"""What a library user needs for a loop of their own: DP on in one call, clients padded to one
capacity (one compilation for every client), a client's first synthetic set."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlap_jax as fl
from fedlap_jax import baselines
from fedlap_jax.checks import ConfigError
from conftest import raises_field

DP = fl.DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)


def test_with_dp_turns_dp_on_in_one_call():
  """a27beca: four coupled fields (client.dp, calibrate_radius, synthetic_init, the radius
  strategy, and weighting) refused one error at a time."""
  plain = fl.FedLAPConfig()
  with pytest.raises(ConfigError):
    dataclasses.replace(plain, client=dataclasses.replace(plain.client, dp=DP))
  private = plain.with_dp(DP)
  assert private.dp is DP and private.client.calibrate_radius is False
  assert private.synthetic_init == "noise"
  assert (private.server.radius_strategy, private.server.weighting) == ("constant", "uniform")
  # Nothing else moves.
  assert dataclasses.replace(private.client, dp=None, calibrate_radius=True) == plain.client
  assert private.rounds == plain.rounds and private.learning_rate == plain.learning_rate
  fixed = dataclasses.replace(plain, server=fl.ServerConfig(radius_strategy="fixed"))
  assert fixed.with_dp(DP).server.radius_strategy == "fixed"
  assert fl.ClientConfig().with_dp(DP) == dataclasses.replace(
    fl.ClientConfig(), dp=DP, calibrate_radius=False
  )
  assert fl.accounting.DpMechanism.from_config(private).steps_per_round == 1 * 5 * 40
  with raises_field("dp"):
    plain.with_dp(None)


def test_client_synthetic_is_initial_synthetic_of_one_client(client_parts):
  (x0, y0), (x1, y1) = client_parts[:2]
  # On the host (NumPy): the set-up's loops over clients and the slicing compile nothing.
  stacked = fl.stack_clients([x0, x1], [y0, y1], on_host=True)
  many, _ = fl.initial_synthetic(jax.random.key(3), stacked, 4, "noise")
  one = fl.client_synthetic(jax.random.key(3), jax.tree.map(lambda a: a[0], stacked), 4)
  np.testing.assert_array_equal(np.asarray(one.y), np.asarray(many.y)[0])
  np.testing.assert_array_equal(np.asarray(one.mask), np.asarray(many.mask)[0])
  assert one.x.shape == (8, 8, 8, 1) and bool(np.all(np.isfinite(np.asarray(one.x))))
  padded = fl.client_synthetic(
    jax.random.key(3), fl.pad_client(x0, y0, capacity=400), 4, max_classes=3
  )
  assert padded.x.shape == (12, 8, 8, 1) and int(padded.mask.sum()) == 8
  with raises_field("max_classes"):
    fl.client_synthetic(jax.random.key(3), fl.pad_client(x0, y0, capacity=400), 4, max_classes=1)


class _Compiles:
  """Counts the programs XLA builds (or reads from a cache) inside ``with``."""

  def __enter__(self):
    self.n = 0
    self._on = lambda event, seconds, **kw: setattr(
      self, "n", self.n + (event == "/jax/core/compile/backend_compile_duration")
    )
    jax.monitoring.register_event_duration_secs_listener(self._on)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._on)


def test_pad_client_compiles_nothing_and_client_synthetic_one_program(client_parts):
  """Run eagerly, pad_client compiled 6 programs and client_synthetic 14 per shape; now
  pad_client pads on the host and client_synthetic draws its images in one program, with the
  numbers of the op-by-op computation bit for bit."""
  (x0, y0), (x1, y1) = client_parts[:2]
  x0, x1 = x0[:, :, :5], x1[:, :, :5]  # (N, 8, 5, 1): an image shape no other test uses
  with _Compiles() as built:
    data = fl.pad_client(x0, y0, capacity=401, num_classes=10)
    again = fl.pad_client(x1, y1, capacity=401, num_classes=10)
  assert built.n == 0
  with jax.disable_jit():  # the eager path: a one-client stack on the device, sliced
    eager_data = jax.tree.map(lambda a: a[0], fl.stack_clients([x0], [y0], capacity=401))
  chex.assert_trees_all_equal(data, eager_data)  # values, dtypes and shapes
  chex.assert_trees_all_equal_shapes_and_dtypes(data, again)
  for max_classes in (None, 3):
    with _Compiles() as built:
      one = fl.client_synthetic(jax.random.key(5), data, 4, max_classes=max_classes)
    assert built.n == 1  # one program per (image shape, slots)
    with _Compiles() as built:
      other = fl.client_synthetic(jax.random.key(6), again, 4, max_classes=max_classes)
    assert built.n == 0  # the same shapes: the program is reused
    assert not np.array_equal(np.asarray(one.x), np.asarray(other.x))
    with jax.disable_jit():
      eager = fl.client_synthetic(jax.random.key(5), data, 4, max_classes=max_classes)
    chex.assert_trees_all_equal(one, eager)  # bit for bit
    slots = 4 * (max_classes or 2)
    chex.assert_shape([one.x, one.y, one.mask], [(slots, 8, 5, 1), (slots,), (slots,)])
  # The one-client draw is initial_synthetic's for a one-client stack (images included).
  many, _ = fl.initial_synthetic(
    jax.random.key(5), jax.tree.map(lambda a: a[None], eager_data), 4, "noise"
  )
  chex.assert_trees_all_equal(
    fl.client_synthetic(jax.random.key(5), data, 4), jax.tree.map(lambda a: a[0], many)
  )


def test_a_loop_over_padded_clients_compiles_once(linear_apply_fn, linear_params, client_parts):
  """Clients of different N_k: one program per size unpadded, one for all padded."""
  sizes = [150, 170, 190]
  parts = [(x[:n], y[:n]) for (x, y), n in zip(client_parts, sizes)]
  config = fl.ClientConfig(
    ipc=2,
    iterations=1,
    max_outer=1,
    batch_loop=1,
    boost_loop=1,
    inner_loop=0,
    batch_size=16,
    radius=1.0,
    calibrate_radius=False,
    dsa_strategy="",
  ).with_dp(DP)
  compiled = []

  def count(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(event)

  def loop(padded):
    step = jax.jit(fl.local_approx, static_argnames=("apply_fn", "config"))
    compiled.clear()
    for k, (x, y) in enumerate(parts):
      if padded:
        data = fl.pad_client(x, y, capacity=max(sizes), num_classes=10)
      else:
        data = fl.ClientData(jnp.asarray(x), jnp.asarray(y), jnp.ones(len(y), bool))
      syn = fl.client_synthetic(jax.random.key(k), data, 2, max_classes=2)
      jax.block_until_ready(
        step(
          jax.random.key(k), linear_apply_fn, linear_params, syn, data, config, learning_rate=0.1
        )
      )
    return len(compiled)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    unpadded, padded = loop(False), loop(True)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert padded < unpadded
  assert unpadded >= len(sizes) * padded  # one set of programs per distinct N_k


@pytest.mark.parametrize("given_to", ["client_synthetic", "pad_client"])
def test_clients_of_2_and_3_classes_share_one_program_and_stack(
  linear_apply_fn, linear_params, digits, given_to
):
  """Padded records alone left a 2-class client 4 synthetic slots and a 3-class one 6: a
  second compilation, and sets that do not stack. With one synthetic capacity (ipc x the
  most classes a client owns) the loop compiles once and the sets stack; given to
  pad_client, padding is the only call that needs it (client_synthetic reads it from the
  data)."""
  parts = [
    (digits.x_train[np.isin(digits.y_train, c)][:n], digits.y_train[np.isin(digits.y_train, c)][:n])
    for c, n in (((0, 1), 60), ((2, 3, 4), 80))
  ]
  config = fl.ClientConfig(
    ipc=2,
    iterations=1,
    max_outer=1,
    batch_loop=1,
    boost_loop=1,
    inner_loop=0,
    batch_size=16,
    radius=1.0,
    calibrate_radius=False,
    dsa_strategy="",
  ).with_dp(DP)

  def approx(key, apply_fn, params, syn, data, config):  # its own function: its own cache
    return fl.local_approx(key, apply_fn, params, syn, data, config, learning_rate=0.1)

  step = jax.jit(approx, static_argnames=("apply_fn", "config"))
  sets = []
  for k, (x, y) in enumerate(parts):
    if given_to == "pad_client":
      data = fl.pad_client(x, y, capacity=80, num_classes=10, max_classes=3)
      syn = fl.client_synthetic(jax.random.key(k), data, 2)
    else:
      data = fl.pad_client(x, y, capacity=80, num_classes=10)
      syn = fl.client_synthetic(jax.random.key(k), data, 2, max_classes=3)
    sets.append(step(jax.random.key(k), linear_apply_fn, linear_params, syn, data, config)[0])
  assert step._cache_size() == 1
  stacked = jax.tree.map(lambda *a: np.stack(a), *sets)
  assert stacked.x.shape == (2, 6, 8, 8, 1)
  np.testing.assert_array_equal(np.asarray(stacked.mask).sum(axis=1), [4, 6])


def test_pad_client_refuses_a_max_classes_that_contradicts_the_data(digits):
  """max_classes below the client's own classes, above num_classes, or not an integer is
  refused by name; the fact is static: it survives jit as a Python int, no leaf."""
  x, y = digits.x_train[:40], digits.y_train[:40]
  owned = len(np.unique(y))
  for bad in (owned - 1, 11, 3.0):
    with pytest.raises(ConfigError) as raised:
      fl.pad_client(x, y, capacity=40, num_classes=10, max_classes=bad)
    assert raised.value.field == "max_classes"
  data = fl.pad_client(x, y, capacity=40, num_classes=10, max_classes=10)
  assert len(jax.tree.leaves(data)) == 3
  assert jax.jit(lambda d: d)(data).max_classes == 10
  assert fl.client_synthetic(jax.random.key(0), data, 2).x.shape[0] == 20


def test_the_entry_points_take_numpy_arrays(linear_apply_fn, linear_params, client_parts):
  """Outside jit, NumPy client data, synthetic sets, weights and parameters failed with a
  TracerArrayConversionError (the lax loops index them with traced indices); now each entry
  point copies them to the device and returns what it returns for jax arrays, bit for bit."""
  x, y = client_parts[0]
  data_np = fl.stack_clients([x[:40]], [y[:40]], on_host=True)
  assert isinstance(data_np.x, np.ndarray)
  chex.assert_trees_all_equal(  # stack_clients: device arrays in, the same as NumPy in
    fl.stack_clients([jnp.asarray(x[:40])], [jnp.asarray(y[:40])]),
    fl.stack_clients([x[:40]], [y[:40]]),
  )
  data_np = jax.tree.map(lambda a: a[0], data_np)
  syn_np = jax.tree.map(np.asarray, fl.client_synthetic(jax.random.key(1), data_np, 2))
  params_np = jax.tree.map(np.asarray, linear_params)
  client = fl.ClientConfig(
    ipc=2,
    iterations=1,
    max_outer=1,
    batch_loop=2,
    boost_loop=1,
    inner_loop=1,
    batch_size=8,
    radius=1.5,
    mse_weight=0.0,
    calibrate_radius=False,
    dsa_strategy="",
  )
  server = fl.ServerConfig(
    radius_strategy="constant", max_epochs=2, batch_size=8, dsa_strategy="", weighting="size"
  )
  config = fl.FedLAPConfig(client=client, server=server, synthetic_init="noise")
  local = baselines.LocalTraining(epochs=1, batch_size=8, fixed_steps=2)
  key, f = jax.random.key(2), linear_apply_fn

  def one(c, tree):  # a one-client stack, NumPy or on the device as c puts it
    return jax.tree.map(lambda a: c(np.asarray(a)[None]), tree)

  calls = {
    "local_approx": lambda p, s, d, c: fl.local_approx(key, f, p, s, d, client, learning_rate=0.05),
    "client_step": lambda p, s, d, c: fl.client_step(key, f, p, s, d, config, learning_rate=0.05),
    "global_update": lambda p, s, d, c: fl.global_update(
      key, f, p, one(c, s), c(np.ones(1, np.float32)), 1.0, learning_rate=0.05, config=server
    ),
    "server_step_with_state": lambda p, s, d, c: fl.server_step_with_state(
      key,
      f,
      p,
      one(c, fl.ClientUpdate(s, np.float32(1.5))),
      config,
      None,
      learning_rate=0.05,
      num_records=c(np.array([40])),
    ),
    "baselines.client_step": lambda p, s, d, c: baselines.client_step(
      key,
      f,
      p,
      d,
      baselines.BaselineConfig(method="fedavg", rounds=1, local=local),
      learning_rate=0.05,
    ),
  }
  for name, call in calls.items():
    with_numpy = call(params_np, syn_np, data_np, np.asarray)
    on_device = jax.device_put((params_np, syn_np, data_np))
    with_jax = call(*on_device, lambda a: jax.device_put(a))
    chex.assert_trees_all_equal(with_numpy, with_jax, custom_message=name)
