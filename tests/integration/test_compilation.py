"""No waste in the loops: one compilation per run, no host transfers inside a round.

Counts XLA backend compilations through ``jax.monitoring`` while three rounds
run; rounds two and three run under ``jax.transfer_guard("disallow")``, so a
host round-trip inside the round (or a recompilation that needs new
constants) fails loudly. The DP case runs with the donated-state option.
"""

from __future__ import annotations

import chex
import jax
import pytest

from experiments.train import CompileCounter
from fedlap_jax import federated, rounds
from fedlap_jax.config import ClientConfig, DPConfig, FedLAPConfig, ServerConfig
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
