"""DSC and PSG (fedlap_jax.methods.condensation.one_shot) and FedDM
(fedlap_jax.methods.feddm.distribution_matching): the core functions.

Loop-structure checks use the tiny ConvNet (width 8, depth 1), PSG's private path the
linear classifier, on the digits clients of ``conftest.py`` with a handful of steps. Learning on the
digits is checked end to end in ``test_experiments_synthetic.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlap_jax import optim, privacy
from fedlap_jax.methods.condensation import one_shot as condensation
from fedlap_jax.methods.feddm import distribution_matching as feddm
from fedlap_jax.checks import ConfigError
from fedlap_jax.client_data import SyntheticSet
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.methods.fedlap.config import ServerConfig, fixed_epochs_server
from fedlap_jax.models import init_fn
from fedlap_jax.methods.fedlap.server import global_update
from fedlap_jax.synthetic import class_batch, class_blocks, noise_images, synthetic_labels
from fedlap_jax.training import tree_distance

from conftest import dp_below_floor, linear_apply, linear_init


IMAGE_SHAPE = (8, 8, 1)
IPC = 2
B = 16
TINY = condensation.CondensationConfig(
  ipc=IPC, networks=1, outer_loop=2, inner_loop=1, batch_loop=2, classwise=False, batch_size=B
)


def _client(clients, k=0):
  """Client ``k``, sliced on the host (no program compiled) and placed on the device."""
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)[k]), clients)


def host(tree):
  """``tree`` read back as NumPy arrays: the checks that follow compile nothing."""
  return jax.tree.map(np.asarray, tree)


def _synthetic(client, ipc=IPC, key=0):
  y = np.asarray(client.y)[np.asarray(client.mask)]
  labels, mask = synthetic_labels([y], ipc)
  x = noise_images(jax.random.PRNGKey(key), jnp.asarray(mask[0]), IMAGE_SHAPE)
  return SyntheticSet(x, jnp.asarray(labels[0]), jnp.asarray(mask[0]))


@functools.partial(jax.jit, static_argnames=("apply_fn", "init", "config"))
def _condense(key, synthetic, data, *, apply_fn, init, config):
  return condensation.condense(key, apply_fn, init, synthetic, data, config)


@pytest.fixture(scope="module")
def tiny_init(tiny_model):
  return init_fn(tiny_model, IMAGE_SHAPE)


# ------------------------------------------------------------------ configuration


def test_published_loops():
  assert condensation.dc_loops(10) == (10, 50) and condensation.dc_loops(50) == (50, 10)
  assert condensation.dc_loops(1) == (1, 1)
  with pytest.raises(ConfigError) as err:
    condensation.dc_loops(7)
  assert err.value.field == "ipc" and err.value.value == 7
  assert TINY.real_accesses_per_round == 1 * 2 * 2


DP = DPConfig(noise_multiplier=1.0, l2_clip_norm=0.1, delta=1e-5)


@pytest.mark.parametrize(
  "build, field, value",
  [
    (lambda: condensation.CondensationConfig(classwise=True, dp=DP), "classwise", True),
    (
      lambda: condensation.CondensationConfig(classwise=False, synthetic_init="real", dp=DP),
      "synthetic_init",
      "real",
    ),
    (lambda: condensation.CondensationConfig(networks=0), "networks", 0),
    (lambda: condensation.CondensationConfig(net_lr=-0.1), "net_lr", -0.1),
    (lambda: condensation.OneShotConfig(method="psg"), "dp", None),
    (lambda: condensation.OneShotConfig(method="dsc", condensation=TINY), "classwise", False),
    (
      lambda: condensation.OneShotConfig(method="dsc", server=ServerConfig()),
      "radius_strategy",
      "min",
    ),
    (lambda: condensation.OneShotConfig(method="dsc", lr_decay=0.0), "lr_decay", 0.0),
    (lambda: condensation.OneShotConfig(method="dc"), "method", "dc"),
    (lambda: feddm.FedDMConfig(rho=-1.0), "rho", -1.0),
    (lambda: feddm.FedDMConfig(server=ServerConfig()), "radius_strategy", "min"),
  ],
)
def test_bad_settings_are_refused_with_field_value_and_allowed(build, field, value):
  with pytest.raises(ConfigError) as err:
    build()
  assert (err.value.field, err.value.value) == (field, value) and err.value.allowed
  assert str(err.value).startswith(f"{field}={value!r} is invalid")


# ------------------------------------------------------------------ class-wise pieces


def test_class_blocks_and_class_batches(clients):
  client = _client(clients)
  syn = _synthetic(client, ipc=3)
  xs, labels, valid = jax.jit(class_blocks, static_argnums=1)(syn, 3)
  chex.assert_shape(xs, (2, 3, *IMAGE_SHAPE))
  own = np.unique(np.asarray(client.y)[np.asarray(client.mask)])
  np.testing.assert_array_equal(labels, own)
  np.testing.assert_array_equal(valid, True)
  y = np.asarray(client.y)
  draw = jax.jit(class_batch, static_argnums=(4, 5))  # the label and its validity traced
  for c in own:
    n_c = int(np.sum((y == c) & np.asarray(client.mask)))
    batch = draw(jax.random.PRNGKey(0), client, np.int32(c), np.bool_(True), B, 64)
    got = np.asarray(batch.indices)[: int(batch.size)]
    assert set(y[got]) == {c} and 0 < len(got) < n_c  # B / N_c of the class
    whole = draw(jax.random.PRNGKey(0), client, np.int32(c), np.bool_(True), 1000, 1000)
    assert int(whole.size) == n_c  # fewer than B: all of them
  empty = draw(jax.random.PRNGKey(0), client, np.int32(own[0]), np.bool_(False), B, 64)
  assert int(empty.size) == 0
  with pytest.raises(ValueError, match="blocks of ipc=4"):
    class_blocks(syn, 4)


def test_pool_clients(clients):
  pooled = host(jax.jit(condensation.pool_clients)(clients))
  chex.assert_shape(pooled.x, (1, clients.x.shape[0] * clients.x.shape[1], *IMAGE_SHAPE))
  assert int(pooled.mask.sum()) == int(np.asarray(clients.mask).sum())
  np.testing.assert_array_equal(
    np.sort(np.asarray(pooled.y)[0][np.asarray(pooled.mask)[0]]),
    np.sort(np.asarray(clients.y)[np.asarray(clients.mask)]),
  )


# ------------------------------------------------------------------ PSG's private path


@pytest.fixture(scope="module")
def psg_runs(linear_apply_fn, clients):
  """Non-DP class-agnostic condensation, and DP with a negligible and with a large noise, of
  the linear classifier (the DP path is the same for any ``apply_fn``)."""
  client = _client(clients)
  syn = _synthetic(client)
  run = functools.partial(
    _condense, jax.random.PRNGKey(3), syn, client, apply_fn=linear_apply_fn, init=linear_init
  )
  negligible = dp_below_floor(1e-9, l2_clip_norm=1e3, delta=1e-5)
  loud = DPConfig(noise_multiplier=5.0, l2_clip_norm=1e-3, delta=1e-5)
  return syn, {
    "plain": run(config=TINY),
    "negligible": run(config=dataclasses.replace(TINY, dp=negligible)),
    "loud": run(config=dataclasses.replace(TINY, dp=loud)),
  }


def test_psg_private_path_reduces_to_the_plain_one_without_clipping_or_noise(psg_runs):
  """A clip nothing reaches and noise of std 1e-6: the matching only sees gradient directions,
  so the DP path (clipped sum + noise, / B) gives the plain path's images."""
  syn, runs = psg_runs
  (plain, m_plain), (dp, m_dp) = runs["plain"], runs["negligible"]
  moved = float(np.max(np.abs(np.asarray(plain.x) - np.asarray(syn.x))))
  assert moved > 1e-2  # the images did move
  chex.assert_trees_all_close(dp.x, plain.x, atol=1e-3 * moved)
  assert float(m_dp.clip_fraction) == 0.0
  chex.assert_trees_all_close(m_dp.matching_loss, m_plain.matching_loss, rtol=1e-3)
  assert int(m_dp.real_accesses) == TINY.real_accesses_per_round


def test_psg_private_path_clips_and_noises(psg_runs):
  syn, runs = psg_runs
  (plain, _), (loud, m_loud) = runs["plain"], runs["loud"]
  assert float(m_loud.clip_fraction) == 1.0  # C = 1e-3 clips every example
  # sigma C = 5e-3 against clipped sums of at most |batch| * 1e-3: the noise dominates, and
  # the images go elsewhere.
  assert float(tree_distance(loud.x, plain.x)) > 0.5 * float(tree_distance(plain.x, syn.x))
  chex.assert_tree_all_finite(loud)


def test_psg_uses_the_private_gradient_with_its_settings(
  tiny_apply_fn, tiny_init, clients, monkeypatch
):
  """The DP path's real gradient: clipped sums over every chunk of the Poisson draw
  (privacy.sum_over_chunks, exact sampling), noised by privacy.privatise with C, sigma and B."""
  calls = []

  def spy(name):
    original = getattr(privacy, name)

    def wrapped(*args, **kwargs):
      call = (
        name,
        {
          k: kwargs[k]
          for k in ("l2_clip_norm", "noise_multiplier", "expected_batch_size")
          if k in kwargs
        },
      )
      if call not in calls:  # sum_over_chunks traces its chunk sum twice
        calls.append(call)
      return original(*args, **kwargs)

    monkeypatch.setattr(privacy, name, wrapped)

  for name in ("privatise", "sum_over_chunks", "clipped_gradient_sum"):
    spy(name)
  client = _client(clients)
  config = dataclasses.replace(TINY, outer_loop=1, batch_loop=1, dp=DP)
  jax.eval_shape(
    lambda k: condensation.condense(
      k, tiny_apply_fn, tiny_init, _synthetic(client), client, config
    ),
    jax.random.PRNGKey(0),
  )
  assert calls == [
    ("sum_over_chunks", {}),
    ("clipped_gradient_sum", {"l2_clip_norm": 0.1}),
    ("privatise", {"l2_clip_norm": 0.1, "noise_multiplier": 1.0, "expected_batch_size": B}),
  ]
  calls.clear()
  jax.eval_shape(
    lambda k: condensation.condense(
      k, tiny_apply_fn, tiny_init, _synthetic(client), client, dataclasses.replace(config, dp=None)
    ),
    jax.random.PRNGKey(0),
  )
  assert calls == [("sum_over_chunks", {})]


def test_psg_metrics_declare_the_raw_statistics_nonprivate():
  """The driver leaves these out of a DP run's metrics (debug_nonprivate_stats)."""
  assert set(condensation.CondensationMetrics.NONPRIVATE) == {
    "poisson_extra_chunks",
    "mean_batch_size",
    "clip_fraction",
  }
  assert set(condensation.CondensationMetrics.NONPRIVATE) < set(
    condensation.CondensationMetrics._fields
  )


# ------------------------------------------------------------------ the server's training


def test_train_on_union_decays_the_learning_rate_for_the_second_half(
  linear_apply_fn, linear_params, clients
):
  syn = jax.tree.map(lambda a: np.asarray(a)[None], _synthetic(_client(clients), ipc=4))
  server = ServerConfig(
    radius_strategy="fixed",
    batch_size=4,
    max_epochs=5,
    weighting="uniform",
    dsa_strategy="",
    momentum=0.9,
    weight_decay=5e-4,
  )
  config = condensation.OneShotConfig(method="dsc", server=server, learning_rate=0.05, lr_decay=0.1)
  key, one = jax.random.PRNGKey(0), np.ones(1, np.float32)
  union = jax.jit(condensation.train_on_union, static_argnums=(1, 5))
  w, m = union(key, linear_apply_fn, linear_params, syn, one, config)
  k1, k2 = jax.random.split(key)
  update = jax.jit(global_update, static_argnums=1, static_argnames="config")
  want, _ = update(
    k1,
    linear_apply_fn,
    linear_params,
    syn,
    one,
    np.inf,
    learning_rate=0.05,
    config=dataclasses.replace(server, max_epochs=3),
  )
  want, _ = update(
    k2,
    linear_apply_fn,
    want,
    syn,
    one,
    np.inf,
    learning_rate=0.005,
    config=dataclasses.replace(server, max_epochs=2),
  )
  chex.assert_trees_all_close(w, want, atol=1e-6)
  assert (int(m.epochs), int(m.steps)) == (5, 10)


# ------------------------------------------------------------------ FedDM's client


def test_perturbation_has_norm_rho(tiny_params):
  perturb = jax.jit(feddm.perturb)  # rho traced: one program
  moved = perturb(jax.random.PRNGKey(0), tiny_params, 2.5)
  distance = float(jax.jit(tree_distance)(moved, tiny_params))
  assert distance == pytest.approx(2.5, rel=1e-5)
  chex.assert_trees_all_equal(perturb(jax.random.PRNGKey(0), tiny_params, 0.0), tiny_params)


def test_distribution_matching_lowers_its_loss(tiny_model, tiny_params, clients):
  from fedlap_jax.models import embed_fn

  client = _client(clients)
  syn = _synthetic(client, ipc=3)
  config = feddm.FedDMConfig(
    ipc=3, image_updates=30, rho=0.0, batch_size=B, image_lr=1.0, synthetic_init="noise"
  )
  run = jax.jit(
    functools.partial(feddm.distribution_match, embed_fn=embed_fn(tiny_model), config=config)
  )
  out, metrics = run(jax.random.PRNGKey(0), params=tiny_params, synthetic=syn, client_data=client)
  loss = np.asarray(metrics.matching_loss)
  chex.assert_shape(loss, (30,))
  assert loss[-5:].mean() < 0.5 * loss[:5].mean()
  assert float(metrics.mean_batch_size) > 0 and int(metrics.poisson_extra_chunks) == 0
  np.testing.assert_array_equal(out.y, syn.y)


def test_feddm_and_one_shot_servers_train_a_fresh_model_for_their_published_epochs():
  one_shot = condensation.OneShotConfig(
    method="dsc", condensation=condensation.CondensationConfig(classwise=True)
  )
  for server, epochs in ((feddm.FedDMConfig().server, 500), (one_shot.server, 300)):
    assert server == fixed_epochs_server(epochs)
    assert (server.radius_strategy, server.max_epochs, server.batch_size) == ("fixed", epochs, 256)
    assert (server.weighting, server.dsa_strategy) == ("uniform", "")
    assert (server.momentum, server.weight_decay) == (0.9, 5e-4)


# ------------------------------------------------------------------ the images' optimiser

SPEC_ADAM = optim.Optimizer(name="adam")


def _linear_embed(params, x):
  return x.reshape(x.shape[0], -1), linear_apply(params, x)


@functools.partial(jax.jit, static_argnames=("config", "image_optimizer"))
def _match(key, params, synthetic, data, *, config, image_optimizer=None):
  return feddm.distribution_match(
    key, _linear_embed, params, synthetic, data, config, image_optimizer=image_optimizer
  )


@functools.partial(jax.jit, static_argnames=("config", "image_optimizer"))
def _condense_linear(key, synthetic, data, *, config, image_optimizer=None):
  return condensation.condense(
    key, linear_apply, linear_init, synthetic, data, config, image_optimizer=image_optimizer
  )


# No ``bitwise`` mark (conftest's compiler note): the two programs of each pair compared here
# lower to the same StableHLO text (the adam spec of the config and optax.adam passed; the
# default SGD and optax.sgd passed), hence one executable under any compiler setting, and their
# bits agree under the tests' default setting too. The mark's setting cost this test twice the
# compile time and its worker two flushes of JAX's in-memory programs.
@pytest.mark.parametrize("method", ["feddm", "dsc"])
def test_the_configs_image_optimiser_is_the_library_keyword(method, linear_params, clients):
  """``FedDMConfig.image_optimizer`` / ``CondensationConfig.image_optimizer`` (a config value,
  stepped at ``image_lr``) is the ``image_optimizer`` keyword, bit for bit; without it, the
  paper's SGD of ``image_momentum``, today's ``optax.sgd`` passed by keyword."""
  client = _client(clients)
  syn = _synthetic(client)
  key = jax.random.PRNGKey(3)
  if method == "feddm":
    config = feddm.FedDMConfig(
      ipc=IPC, image_updates=3, batch_size=B, image_lr=0.5, synthetic_init="noise"
    )

    def run(config, **kw):
      return _match(key, linear_params, syn, client, config=config, **kw)[0].x

  else:
    config = dataclasses.replace(TINY, classwise=True, image_lr=0.5)

    def run(config, **kw):
      return _condense_linear(key, syn, client, config=config, **kw)[0].x

  spec = dataclasses.replace(config, image_optimizer=SPEC_ADAM, image_momentum=0.0)
  from_config = run(spec)
  passed = run(config, image_optimizer=optax.adam(config.image_lr))
  chex.assert_trees_all_equal(from_config, passed)
  default = run(config)
  today = run(config, image_optimizer=optax.sgd(config.image_lr, momentum=config.image_momentum))
  chex.assert_trees_all_equal(default, today)
  assert not np.array_equal(np.asarray(default), np.asarray(from_config))


@pytest.mark.parametrize(
  ("make", "field"),
  [
    # The images' SGD is image_momentum: one source.
    (lambda: feddm.FedDMConfig(image_optimizer=SPEC_ADAM), "image_momentum"),
    (
      lambda: feddm.FedDMConfig(image_momentum=0.0, image_optimizer=optim.Optimizer(momentum=0.5)),
      "image_optimizer",
    ),
    (lambda: feddm.FedDMConfig(image_momentum=0.0, image_optimizer="adam"), "image_optimizer"),
    (lambda: condensation.CondensationConfig(image_optimizer=SPEC_ADAM), "image_momentum"),
    (
      lambda: condensation.CondensationConfig(
        image_momentum=0.0, image_optimizer=optim.Optimizer(momentum=0.9)
      ),
      "image_optimizer",
    ),
  ],
)
def test_the_image_optimiser_fields_refuse_naming_the_field(make, field):
  with pytest.raises(ConfigError) as err:
    make()
  assert err.value.field == field
