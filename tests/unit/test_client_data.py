"""The static checks of client data (``fedlap_jax.client_data``) that every method's client
update runs when it is traced: each refusal names the leaf, the value and what is allowed, and
every method's entry point runs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import baselines
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  check_batch_size,
  check_pair,
  check_records,
)
from conftest import raises_field

N, S = 12, 4


def _data(**leaves) -> ClientData:
  base = ClientData(np.zeros((N, 8, 8, 1), np.float32), np.zeros(N, np.int32), np.ones(N, bool))
  return base._replace(**leaves)


def _synthetic(**leaves) -> SyntheticSet:
  base = SyntheticSet(
    np.zeros((S, 8, 8, 1), np.float32), np.arange(S, dtype=np.int32), np.ones(S, bool)
  )
  return base._replace(**leaves)


@pytest.mark.parametrize(
  "records, field, value, allowed",
  [
    (
      _data(x=np.zeros(N, np.float32)),
      "data.x.shape",
      (N,),
      "(N, ...): one leading axis of records",
    ),
    (_data(y=np.zeros(N - 1, np.int32)), "data.y.shape", (N - 1,), f"({N},): one entry per"),
    (_data(mask=np.ones((N, 1), bool)), "data.mask.shape", (N, 1), f"({N},): one entry per"),
    (
      _data(y=np.zeros(N, np.float32)),
      "data.y.dtype",
      "float32",
      "an integer dtype (class labels)",
    ),
    (_data(x=np.zeros((N, 8, 8, 1), np.uint8)), "data.x.dtype", "uint8", "float model inputs"),
    (_synthetic(x=np.zeros((S, 8, 8, 1), np.int32)), "data.x.dtype", "int32", "a floating"),
  ],
)
def test_check_records_names_the_leaf_the_value_and_what_is_allowed(records, field, value, allowed):
  with pytest.raises(ConfigError) as err:
    check_records("data", records)
  assert (err.value.field, err.value.value) == (field, value)
  assert err.value.allowed.startswith(allowed), err.value.allowed


def test_valid_records_pass_and_return_their_shape():
  assert check_records("data", _data()) == (N, 8, 8, 1)
  assert check_records("synthetic", _synthetic(x=np.zeros((S, 8, 8, 1), jnp.bfloat16)))
  pixels = _data(
    x=np.zeros((N, 8, 8, 1), np.uint8),
    pixel_scale=np.ones(1, np.float32),
    pixel_offset=np.zeros(1, np.float32),
  )
  assert check_records("data", pixels) == (N, 8, 8, 1)  # stored pixels with a normalisation
  assert check_records("data", _data(y=np.zeros(N, np.uint8)))  # any integer labels
  check_pair(_synthetic(), _data())
  check_batch_size("batch_size", N, _data())  # q = 1 at most: every record


def test_check_pair_and_batch_size_refuse_what_no_client_update_can_use():
  with pytest.raises(ConfigError) as err:
    check_pair(_synthetic(x=np.zeros((S, 8, 8, 3), np.float32)), _data())
  assert err.value.field == "synthetic.x.shape" and err.value.value == (S, 8, 8, 3)
  assert err.value.allowed == "(S, 8, 8, 1): the image shape of client_data.x"
  with raises_field("client_data.y.dtype"):
    check_pair(_synthetic(), _data(y=np.zeros(N, np.float32)))
  with pytest.raises(ConfigError) as err:
    check_batch_size("local.batch_size", N + 1, _data())
  assert (err.value.field, err.value.value) == ("local.batch_size", N + 1)
  assert err.value.allowed.startswith(f"at most {N}, the client's record slots")


def _linear(params, x):
  return x.reshape(x.shape[0], -1) @ params


def test_every_method_checks_its_client_data_when_traced():
  """Float labels are refused by each method's client update before anything compiles."""
  key, params, bad = (
    jax.random.PRNGKey(0),
    np.zeros((64, 10), np.float32),
    _data(y=np.zeros(N, np.float32)),
  )
  local = baselines.LocalTraining(epochs=1, batch_size=4, fixed_steps=1)
  with raises_field("data.y.dtype"):
    jax.jit(baselines.client_update, static_argnames=("apply_fn", "local", "num_steps"))(
      key, _linear, params, bad, learning_rate=0.1, local=local, num_steps=1
    )
  with raises_field("client_data.y.dtype"):
    feddm.distribution_match(
      key,
      lambda p, x: x.reshape(x.shape[0], -1),
      params,
      _synthetic(),
      bad,
      feddm.FedDMConfig(ipc=2),
    )
  config = condensation.CondensationConfig(
    ipc=2, networks=1, outer_loop=1, inner_loop=1, batch_loop=1, classwise=False, batch_size=4
  )
  with raises_field("client_data.y.dtype"):
    condensation.condense(key, _linear, lambda k: params, _synthetic(), bad, config)
  # PSG's whole-set batch draws q = B / N_k from the client: B may not exceed its slots.
  big = condensation.CondensationConfig(
    ipc=2, networks=1, outer_loop=1, inner_loop=1, batch_loop=1, classwise=False, batch_size=N + 1
  )
  with raises_field("batch_size"):
    condensation.condense(key, _linear, lambda k: params, _synthetic(), _data(), big)
  with raises_field("local.batch_size"):
    baselines.client_update(
      key,
      _linear,
      params,
      _data(),
      learning_rate=0.1,
      local=baselines.LocalTraining(epochs=1, batch_size=N + 1, fixed_steps=1),
      num_steps=1,
    )
