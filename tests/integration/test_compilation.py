"""No waste in the loops: one compilation per run, no host transfers inside a round.

Counts XLA backend compilations through ``jax.monitoring`` while three rounds
run; rounds two and three run under ``jax.transfer_guard("disallow")``, so a
host round-trip inside the round (or a recompilation that needs new
constants) fails loudly. The DP case runs with the donated-state option.

The one-off set-up programs (a model's initialisation, the first synthetic images) compile at
LLVM's level 1 (:mod:`fedlap_jax.setup_jit`) and give the numbers of XLA's default level bit
for bit: checked in a child process under XLA's own settings, as a run compiles them (the
tests compile with cheaper ones, conftest's note), on a digits-sized and a CIFAR-sized ConvNet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import pytest

from experiments.train import CompileCounter
from fedlap_jax import rounds
from fedlap_jax.methods.fedlap import state as federated
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY


# The DP config microbatches its 44-slot Poisson buffers by 8, so the round also
# runs the data-dependent microbatch loop (vmapped over the clients). The non-DP config
# keeps every DSA family on the client and the server, so their draws are checked too; the
# DP config leaves them out (they would double its compile time and add nothing new).
CONFIGS = {
  "dp": FedLAPConfig(
    client=ClientConfig(
      ipc=2,
      iterations=1,
      max_outer=2,
      batch_loop=2,
      boost_loop=2,
      inner_loop=1,
      batch_size=16,
      radius=5.0,
      mse_weight=0.0,
      calibrate_radius=False,
      dsa_strategy="",
      dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5, microbatch_size=8),
    ),
    server=ServerConfig(
      radius_strategy="constant", weighting="uniform", max_epochs=2, dsa_strategy=""
    ),
    rounds=5,
    learning_rate=0.05,
    synthetic_init="noise",
  ),
  "nondp": FedLAPConfig(
    client=ClientConfig(
      ipc=2,
      iterations=1,
      max_outer=2,
      batch_loop=2,
      boost_loop=2,
      inner_loop=0,
      batch_size=16,
      radius=5.0,
      calibration_epochs=2,
    ),
    server=ServerConfig(radius_strategy="min", max_epochs=2),
    rounds=5,
    learning_rate=0.05,
    synthetic_init="real",
  ),
}


@pytest.mark.parametrize("name, donate", [("dp", True), ("nondp", False)])
def test_three_rounds_compile_once(name, donate, tiny_apply_fn, tiny_params, clients):
  config = CONFIGS[name]
  state = federated.init_state(jax.random.PRNGKey(0), tiny_params, clients, config)
  # Donation deletes the buffers passed in: never donate arrays shared with others
  # (here the session's parameters), so the round gets its own copy.
  state = jax.tree.map(lambda a: a.copy(), state)
  round_fn = rounds.make_round_fn(
    REGISTRY["fedlap"], config, ModelFns(tiny_apply_fn), donate_state=donate
  )
  # The round is the module's shared jit (every method and run): count its new entries.
  shared = rounds._donating_round_jit if donate else rounds._round_jit
  entries = shared._cache_size()
  first_state = state
  with CompileCounter() as first:
    state, _ = round_fn(state, clients)
    jax.block_until_ready(state)
  # A donated state is consumed by the round; a kept one is untouched.
  assert all(leaf.is_deleted() == donate for leaf in jax.tree.leaves(first_state.synthetic))
  with CompileCounter() as later, jax.transfer_guard("disallow"):
    for _ in range(2):
      state, metrics = round_fn(state, clients)
    jax.block_until_ready(state)
  assert first.count == 1, f"round 1 compiled {first.count} programs"
  assert later.count == 0, f"rounds 2-3 compiled {later.count} programs"
  assert shared._cache_size() == entries + 1
  assert int(state.round) == 3
  chex.assert_tree_all_finite(metrics.client.matching_loss)
  chex.assert_tree_all_finite(state.params)


# Each set-up program through setup_jit (level 1) and through its plain jax.jit (XLA's default).
SET_UP_CHECK = """
import hashlib, json
import jax, jax.numpy as jnp, numpy as np
from fedlap_jax import setup_jit
from fedlap_jax.models import ConvNet, _init_params
from fedlap_jax.synthetic import _first_images, _slot_images

def digest(tree):
  leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for x in jax.tree.leaves(tree)]
  return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()

key = jax.random.PRNGKey(11)
mask = jnp.asarray(np.random.default_rng(0).random((5, 20)) < 0.8)
calls = {
  "init 8x8x1": (_init_params, (ConvNet(num_classes=10, width=32, depth=2), key, (8, 8, 1))),
  "init 32x32x3": (_init_params, (ConvNet(num_classes=10, width=64, depth=3), key, (32, 32, 3))),
  "first images": (_first_images, (key, mask, (32, 32, 3))),
  "slot images": (_slot_images, (key, mask[1], (8, 8, 1), 1, 5)),
}
out = {"options": setup_jit.compiler_options()}
for name, (f, args) in calls.items():
  out[name] = [digest(f(*args)), digest(f.jitted(*args))]
print(json.dumps(out))
"""


def test_the_set_up_programs_give_the_default_levels_numbers_bit_for_bit():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # XLA's own settings
  proc = subprocess.run(
    [sys.executable, "-c", SET_UP_CHECK], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out.pop("options") == {"xla_backend_optimization_level": 1}
  assert len(out) == 4
  for name, (level_1, default) in out.items():
    assert level_1 == default, name
