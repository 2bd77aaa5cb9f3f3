"""Every noisy access to a client's records is one the accountant charges, at its q and sigma.

One round of every DP method of the registry (FedLAP-DP with the paper's loops, the hybrid
recipe, DP-FedAvg, DP-FedProx, DP-SCAFFOLD, PSG) on the digits clients, with a linear model
and a few steps. The test wraps :func:`fedlap_jax.privacy.poisson_gradient` (every method's
one access to records) and :func:`fedlap_jax.privacy.add_gaussian_noise` (the noise draw)
with a host callback that fires each time the compiled round *executes* them (not when it
traces them: loops trace their body once), and compares what ran with the mechanism the
method declares (``T`` per round, ``q = B / N_k``, ``sigma``), the one value every ledger and
every front end charges. The clients run one after another (``client_backend='map'``), so a
step skipped by a ``lax.cond`` or ended by a ``while_loop`` does not run (under ``vmap`` both
branches would run and the extra calls be discarded).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train
from fedlap_jax import baselines, participation, privacy, rounds
from fedlap_jax.dp_config import DPConfig
from fedlap_jax.method import ModelFns
from fedlap_jax.methods import REGISTRY
from fedlap_jax.methods.condensation import one_shot
from fedlap_jax.methods.dp_scaffold import DPScaffoldConfig
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig, ServerConfig
from fedlap_jax.methods.fedlap.config import fixed_epochs_server

from conftest import linear_init

DP = DPConfig(noise_multiplier=1.3, l2_clip_norm=0.5, delta=1e-5)
B = 32

_FEDLAP_CLIENT = dict(
  ipc=2,
  iterations=2,
  max_outer=2,
  batch_loop=2,
  boost_loop=1,
  batch_size=B,
  radius=1e6,  # no trajectory stops early: every client runs its T accesses
  calibrate_radius=False,
  dsa_strategy="",
  dp=DP,
)
_FEDLAP_SERVER = dict(radius_strategy="constant", max_epochs=1, dsa_strategy="")


def _fedlap(**client):
  server = dict(_FEDLAP_SERVER)
  if client.get("model_steps") == "noisy_real":
    server["start"] = "fedavg_delta"
  return FedLAPConfig(
    client=ClientConfig(**{**_FEDLAP_CLIENT, **client}),
    server=ServerConfig(**server),
    rounds=1,
    learning_rate=0.1,
    synthetic_init="noise",
  )


def _baseline(method, n_max):
  return baselines.baseline_config(
    method, rounds=1, learning_rate=0.1, batch_size=B, local_epochs=1, dp=DP, max_client_size=n_max
  )


def _psg():
  return one_shot.OneShotConfig(
    method="psg",
    condensation=one_shot.CondensationConfig(
      ipc=2,
      networks=2,
      outer_loop=2,
      inner_loop=1,
      batch_loop=2,
      classwise=False,
      batch_size=B,
      dp=DP,
    ),
    server=fixed_epochs_server(1),
  )


# name -> (registry method, config builder of N_max)
CASES = {
  "fedlap_dp": ("fedlap", lambda n: _fedlap()),
  "fedlap_dp_hybrid": (
    "fedlap",
    lambda n: _fedlap(average_targets=True, model_steps="noisy_real", inner_loop=0),
  ),
  "dp_fedavg": ("dp_fedavg", lambda n: _baseline("dp_fedavg", n)),
  "dp_fedprox": ("dp_fedprox", lambda n: _baseline("dp_fedprox", n)),
  "dp_scaffold": ("dp_scaffold", lambda n: DPScaffoldConfig(_baseline("dp_fedavg", n))),
  "psg": ("psg", lambda n: _psg()),
}


def test_every_dp_method_of_the_registry_has_a_case():
  dp_methods = {n for n, m in REGISTRY.items() if m.privacy != "never"}
  assert dp_methods == {method for method, _ in CASES.values()}


@pytest.fixture
def executed(monkeypatch):
  """Wraps the DP gradient and the noise draw; returns the lists the running program fills."""
  accesses, noises = [], []
  gradient, noise = privacy.poisson_gradient, privacy.add_gaussian_noise

  def counted_gradient(query, key, apply_fn, params, data, **kwargs):
    out = gradient(query, key, apply_fn, params, data, **kwargs)
    record = (query.noise_multiplier, query.l2_clip_norm, query.batch_size)
    jax.debug.callback(
      lambda who, n_k, drawn: accesses.append((*record, int(who), int(n_k), int(drawn))),
      jnp.min(jnp.where(data.mask, data.y, jnp.iinfo(jnp.int32).max)),  # the client's 1st class
      jnp.sum(data.mask),
      out.batch_size,
    )
    return out

  def counted_noise(key, tree, stddev):
    jax.debug.callback(lambda s: noises.append(float(s)), stddev)
    return noise(key, tree, stddev)

  monkeypatch.setattr(privacy, "poisson_gradient", counted_gradient)
  monkeypatch.setattr(privacy, "add_gaussian_noise", counted_noise)
  return accesses, noises


def _run_round(case, linear_apply_fn, linear_params, clients, clients_per_round=None):
  """One round of ``case`` (clients one after another); ``(alg, metrics, participants)``."""
  name, build = CASES[case]
  sizes = np.asarray(clients.mask).sum(1)
  model = ModelFns(lambda p, x: linear_apply_fn(p, x), init_fn=linear_init)  # traced afresh
  facts = rounds.run_facts(linear_params, clients, clients_per_round=clients_per_round)
  alg = rounds.algorithm(
    REGISTRY.method(name), build(int(sizes.max())), model, facts, client_backend="map"
  )
  state = alg.init(jax.random.PRNGKey(1), linear_params, clients)
  if clients_per_round is None:
    who = np.arange(len(sizes))
    _, metrics = alg.round(state, clients)
  else:
    who = participation.sample_clients(0, 1, len(sizes), clients_per_round)
    block = participation.device_block(participation.host_clients(clients), who)
    _, metrics = participation.sampled_round(alg, state, block, who)
  jax.block_until_ready(metrics)
  jax.effects_barrier()  # every callback has run
  return alg, metrics, who


def _first_classes(clients):
  """Each client's smallest class: the digits clients hold two classes each, none shared."""
  y, mask = np.asarray(clients.y), np.asarray(clients.mask)
  return [int(y[k][mask[k]].min()) for k in range(len(mask))]


def _reported_accesses(metrics):
  """The round's own count of each client's real batches (FedLAP, PSG) or local steps."""
  client = metrics.client
  return np.asarray(client.real_accesses if hasattr(client, "real_accesses") else client.steps)


@pytest.mark.parametrize("case", list(CASES))
def test_each_noisy_access_is_one_the_mechanism_charges_at_its_q_and_sigma(
  case, executed, linear_apply_fn, linear_params, clients
):
  """Each client's executed accesses are at most the ``T`` charged (FedLAP-DP and PSG: exactly
  ``T``, no trajectory stopping early here; the gradient baselines ``T_k = round(N_k / B)``
  local steps, the largest client's being ``T``), each a Poisson draw of ``B`` expected records
  of the client's ``N_k`` (``q = B / N_k``) noised once with std ``sigma * C``: the mechanism's
  fields. What the round reports of them is what ran."""
  accesses, noises = executed
  alg, metrics, _ = _run_round(case, linear_apply_fn, linear_params, clients)
  mech = alg.mechanism
  assert (mech.noise_multiplier, mech.batch_size, mech.delta) == (DP.noise_multiplier, B, DP.delta)
  t = mech.steps_per_round
  assert {a[:3] for a in accesses} == {(mech.noise_multiplier, DP.l2_clip_norm, mech.batch_size)}
  assert len(noises) == len(accesses)  # one noise draw per access, no other
  np.testing.assert_allclose(noises, mech.noise_multiplier * DP.l2_clip_norm, rtol=1e-6)
  sizes = np.asarray(clients.mask).sum(1)
  firsts = _first_classes(clients)
  ran = collections.Counter(a[3] for a in accesses)
  counts = np.array([ran[f] for f in firsts])
  assert {a[3]: a[4] for a in accesses} == dict(zip(firsts, sizes.tolist()))  # q = B / N_k
  if CASES[case][0] in ("fedlap", "psg"):
    np.testing.assert_array_equal(counts, t)
  else:
    np.testing.assert_array_equal(counts, [baselines.steps_per_epoch(int(n), B) for n in sizes])
    assert counts.max() == t
  np.testing.assert_array_equal(_reported_accesses(metrics), counts)
  drawn = np.array([a[5] for a in accesses])
  assert abs(drawn.mean() - B) < 5 * np.sqrt(B / len(drawn))  # B expected per draw


def test_a_sampled_round_touches_only_the_clients_the_ledger_charges(
  executed, linear_apply_fn, linear_params, clients
):
  """With 2 of 5 clients per round, only the participants' records are accessed (each ``T_k``
  times): the ones ``experiments.run``'s driver charges for the round (its per-client
  :class:`~fedlap_jax.accounting.ClientLedgers`, ``T`` each)."""
  accesses, _ = executed
  alg, _, who = _run_round("dp_fedavg", linear_apply_fn, linear_params, clients, 2)
  firsts = _first_classes(clients)
  sizes = np.asarray(clients.mask).sum(1)
  ran = collections.Counter(a[3] for a in accesses)
  assert ran == {firsts[k]: baselines.steps_per_epoch(int(sizes[k]), B) for k in who}
  ledgers = alg.mechanism.client_ledgers(sizes.tolist())
  train.charge_round(ledgers, alg.mechanism, who)
  assert [k for k in range(5) if ledgers.ledgers[k].steps == [alg.mechanism.steps_per_round]] == (
    who.tolist()
  )
  assert len(who) == 2


@pytest.mark.parametrize("case", list(CASES))
def test_a_draw_beyond_the_buffer_loses_no_record(
  case, monkeypatch, linear_apply_fn, linear_params, clients
):
  """Every access of the round with its buffer cut to ``B / 4`` (the config refuses so small a
  one): each draw overflows it, is read in ``ceil(size / capacity)`` chunks, and its noised
  gradient is the one of a buffer holding the whole client (the same draw and noise), so
  every record sampled counts. With the default buffer (``B + 6 sqrt(B) + 4``) an overflow
  has probability below ``1e-8`` and costs one more chunk, never a record."""
  gradient, seen, small = privacy.poisson_gradient, [], B // 4

  def overflowing(query, key, apply_fn, params, data, **kwargs):
    cut, whole = (
      gradient(dataclasses.replace(query, capacity=c), key, apply_fn, params, data, **kwargs)
      for c in (small, data.mask.shape[0])
    )
    leaves = jax.tree.leaves(
      jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), cut.gradient, whole.gradient)
    )
    scale = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(whole.gradient)]))
    jax.debug.callback(
      lambda *a: seen.append(tuple(float(v) for v in a)),
      cut.batch_size,
      cut.extra_chunks,
      whole.extra_chunks,
      jnp.max(jnp.stack(leaves)),
      scale,
    )
    return cut

  monkeypatch.setattr(privacy, "poisson_gradient", overflowing)
  _run_round(case, linear_apply_fn, linear_params, clients)
  size, extra, whole_extra, diff, scale = np.array(seen).T
  assert len(seen) > 0 and np.all(whole_extra == 0)
  np.testing.assert_array_equal(extra, np.ceil(size / small) - 1)
  assert np.all(extra >= 1)  # B / 4 = 8 slots against draws of ~32: every draw overflowed
  assert np.all(diff <= 1e-5 * scale + 1e-7), (diff.max(), scale.min())
