"""The one-off set-up programs: compiled at LLVM's level 1 unless ``XLA_FLAGS`` names a level,
and traced into an enclosing ``jit`` like any jitted function.

That level 1 gives XLA's default level's numbers bit for bit is checked under XLA's own
settings, in a child process: ``tests/integration/test_compilation.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedlap_jax import setup_jit as setup
from fedlap_jax.models import _init_params
from fedlap_jax.synthetic import _client_images, _first_images, noise_images


def test_a_level_in_xla_flags_wins(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
  assert setup.compiler_options() == {"xla_backend_optimization_level": 1}
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
  assert setup.compiler_options() is None
  monkeypatch.delenv("XLA_FLAGS")
  assert setup.compiler_options() == {"xla_backend_optimization_level": 1}


def test_inside_jit_a_set_up_function_is_part_of_the_enclosing_program(tiny_model):
  key = jax.random.PRNGKey(3)
  mask = np.ones((2, 4), bool)

  @jax.jit
  def both(k):
    params = _init_params(tiny_model, k, (8, 8, 1))
    images, _ = _first_images(k, mask, (8, 8, 1))
    return params, images, _client_images(k, mask[0], (8, 8, 1), 2)

  params, images, client = both(key)
  assert "_init_params" in str(jax.make_jaxpr(both)(key))  # nested in the enclosing program
  # The enclosing program (the tests' setting) computes what the calls on their own compute.
  jax.tree.map(np.testing.assert_array_equal, params, _init_params(tiny_model, key, (8, 8, 1)))
  np.testing.assert_array_equal(images, _first_images(key, mask, (8, 8, 1))[0])
  np.testing.assert_array_equal(client[:4], images[0])
  np.testing.assert_array_equal(client[4:], np.zeros((2, 8, 8, 1), np.float32))
  k_init, _ = jax.random.split(key)
  np.testing.assert_array_equal(images, noise_images(k_init, jnp.asarray(mask), (8, 8, 1)))
