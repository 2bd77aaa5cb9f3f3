"""Clients side by side (the ``vmap`` backend) and the shared DSA family draw.

Side by side, :func:`fedlap_jax.methods.fedlap.client.local_approx` runs its radius-bounded
while loop with a counter shared by the clients and each client's termination
as a mask (``client_axis``), and the clients share one DSA family per step
(``ClientConfig.dsa_family_draw="shared"``), so that under ``vmap`` neither
the family ``lax.switch`` nor the ``lax.cond`` of the local update turns into
a select that computes every branch. These tests check the numbers (side by
side equals one after another), the family frequencies, and the branch
structure of the compiled program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax import dispatch, dsa
from fedlap_jax.methods.fedlap.client import local_approx
from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.methods.fedlap.config import ClientConfig
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.models import ConvNet
from fedlap_jax.synthetic import noise_images, synthetic_labels
from conftest import raises_field


K = 3
# DP, every DSA family, a local update per iteration and a radius that some clients'
# trajectories leave after one iteration and others after two or never (checked below).
CONFIG = ClientConfig(
  ipc=2,
  iterations=2,
  max_outer=3,
  batch_loop=2,
  boost_loop=2,
  inner_loop=1,
  batch_size=32,
  radius=0.35,
  mse_weight=0.0,
  image_lr=1.0,
  calibrate_radius=False,
  dsa_strategy="color_crop_flip",
  dp=DPConfig(noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5),
)


@pytest.fixture(scope="module")
def model_fns():
  """``(apply_fn, params)`` of a ConvNet without instance norm.

  FedLAP-DP amplifies float rounding (tests/integration/test_sharding.py); without instance
  norm the side-by-side and one-by-one programs agree to 1e-5.
  """
  model = ConvNet(num_classes=10, width=8, depth=1, norm="none")
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
  return (lambda p, x: model.apply({"params": p}, x)), params


@pytest.fixture(scope="module")
def inputs(clients):
  three = jax.tree.map(lambda a: a[:K], clients)
  ys = [np.asarray(y)[np.asarray(m)] for y, m in zip(three.y, three.mask)]
  labels, mask = synthetic_labels(ys, 2)
  x = noise_images(jax.random.PRNGKey(5), jnp.asarray(mask), (8, 8, 1))
  synthetic = SyntheticSet(x, jnp.asarray(labels), jnp.asarray(mask))
  keys = jax.random.split(jax.random.PRNGKey(1), K)
  return keys, synthetic, three, jax.random.PRNGKey(7)


def _clients_fn(apply_fn, config, backend):
  def one(args, params, family_key):
    key, syn, data = args
    return local_approx(
      key,
      apply_fn,
      params,
      syn,
      data,
      config,
      learning_rate=0.1,
      family_key=family_key,
      client_axis=dispatch.VMAP_AXIS if backend == "vmap" else None,
    )

  return jax.jit(
    lambda args, params, fk: dispatch.run_clients(
      one, args, replicated=(params, fk), client_backend=backend
    )
  )


@pytest.fixture(scope="module")
def one_by_one(model_fns, inputs):
  apply_fn, params = model_fns
  keys, syn, data, fk = inputs
  return _clients_fn(apply_fn, CONFIG, "map")((keys, syn, data), params, fk)


def _assert_close(a, b):
  syn_a, r_a, m_a = a
  syn_b, r_b, m_b = b
  np.testing.assert_array_equal(m_a.outer_iterations, m_b.outer_iterations)
  np.testing.assert_array_equal(m_a.real_accesses, m_b.real_accesses)
  np.testing.assert_allclose(syn_a.x, syn_b.x, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(m_a.matching_loss, m_b.matching_loss, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(m_a.trajectory_distance, m_b.trajectory_distance, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(r_a, r_b)


def test_side_by_side_equals_one_by_one(model_fns, inputs, one_by_one):
  """K clients stopping at different iterations: masks give each client its own loop."""
  apply_fn, params = model_fns
  keys, syn, data, fk = inputs
  outer = np.asarray(one_by_one[2].outer_iterations)
  assert len(set(outer.ravel().tolist())) > 1, outer  # the masks are exercised
  side = _clients_fn(apply_fn, CONFIG, "vmap")((keys, syn, data), params, fk)
  _assert_close(side, one_by_one)


def test_masked_update_equals_the_cond_version_for_one_client(model_fns, inputs, one_by_one):
  """One client alone: the masked loop (client_axis set) gives the lax.cond loop's numbers."""
  apply_fn, params = model_fns
  keys, syn, data, fk = inputs
  first = jax.tree.map(lambda a: a[:1], (keys, syn, data))
  side = _clients_fn(apply_fn, CONFIG, "vmap")(first, params, fk)
  _assert_close(side, jax.tree.map(lambda a: a[:1], one_by_one))


def _cond_branch_counts(jaxpr) -> list[int]:
  """Branch counts of every ``cond`` / ``switch`` in ``jaxpr``, nested ones included."""
  counts = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      counts.append(len(eqn.params["branches"]))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          counts.extend(_cond_branch_counts(inner))
  return counts


def test_vmapped_round_keeps_its_branches(model_fns, inputs):
  """Side by side the family switch (3 families here) and the update cond (2) stay branches.

  With per-client families and a per-client loop under vmap (the old side-by-side
  program), both become selects that compute every branch.
  """
  apply_fn, params = model_fns
  keys, syn, data, fk = inputs
  args = ((keys, syn, data), params, fk)
  new = _cond_branch_counts(jax.make_jaxpr(_clients_fn(apply_fn, CONFIG, "vmap"))(*args))
  assert 3 in new and 2 in new, new

  old_config = dataclasses.replace(CONFIG, dsa_family_draw="per_client")

  def old(args, params, family_key):  # plain vmap of the one-client loop
    return jax.vmap(
      lambda a: local_approx(a[0], apply_fn, params, a[1], a[2], old_config, learning_rate=0.1)
    )(args)

  counts = _cond_branch_counts(jax.make_jaxpr(old)(*args))
  assert 3 not in counts and 2 not in counts, counts


@jax.jit
@jax.vmap
def _chosen_family(key, family_key):
  """Bool ``(6,)``: the families whose output equals augment's (vmapped over draws)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 1))
  out = dsa.augment(key, x, family_key=family_key)
  param_key = jax.random.split(key)[1]
  return jnp.stack(
    [jnp.allclose(out, dsa.apply_family(param_key, x, f), atol=1e-6) for f in dsa.FAMILIES]
  )


def _chosen_families(keys, family_keys):
  return np.asarray(_chosen_family(keys, family_keys))


def test_shared_family_draw_frequencies():
  """Shared family key: 3 clients (own keys) always get the same family, each w.p. 1/6."""
  draws = 1200
  family_keys = jax.random.split(jax.random.PRNGKey(1), draws)
  per_client = []
  for c in range(3):
    keys = jax.random.split(jax.random.PRNGKey(10 + c), draws)
    per_client.append(_chosen_families(keys, family_keys))
  common = per_client[0] & per_client[1] & per_client[2]
  assert common.any(axis=1).all()  # every draw: one family for all clients
  unique = common.sum(axis=1) == 1
  assert unique.mean() > 0.97
  freq = common[unique].mean(axis=0)
  sigma = np.sqrt((1 / 6) * (5 / 6) / unique.sum())
  np.testing.assert_array_less(np.abs(freq - 1 / 6), 4 * sigma)
  # Without the shared key (each client draws its own family) they mostly disagree.
  own = [
    _chosen_families(
      jax.random.split(jax.random.PRNGKey(10 + c), draws),
      jax.random.split(jax.random.PRNGKey(20 + c), draws),
    )
    for c in range(2)
  ]
  assert (own[0] & own[1]).any(axis=1).mean() < 0.4


def test_dsa_family_draw_is_validated():
  with raises_field("dsa_family_draw"):
    ClientConfig(dsa_family_draw="each")
  assert ClientConfig().dsa_family_draw == "shared"


def test_auto_backend_runs_fedlap_side_by_side_on_an_accelerator(monkeypatch):
  assert dispatch.resolve_client_backend("auto", side_by_side=True) == "map"  # this CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert dispatch.resolve_client_backend("auto", side_by_side=True) == "vmap"
  assert dispatch.resolve_client_backend("auto") == "map"  # the baselines
  assert dispatch.resolve_client_backend("map", side_by_side=True) == "map"
  monkeypatch.setattr(jax, "device_count", lambda: 4)
  assert dispatch.resolve_client_backend("auto", side_by_side=True) == "shard"
