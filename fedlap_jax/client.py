"""Client side of FedLAP / FedLAP-DP: local approximation (Algorithms 1 and 3).

A client receives the global model ``w_g`` and the trust-region radius ``r``
and optimises its synthetic set ``S_k`` so that gradients on ``S_k`` match the
gradients on its real data along local training trajectories that stay within
``r`` of ``w_g``. Under DP the real gradients are clipped per example and
noised (:func:`fedlap_jax.privacy.private_gradient`); everything done with them
afterwards is post-processing.

:func:`local_approx` is the whole algorithm as one pure function. Loop
structure (names as in the authors' implementation)::

  for i in 1..R_i:                          # lax.scan: resample trajectories
    w <- w_g
    for o in 1..max_outer:                  # lax.while_loop, radius-bounded
      if ||w - w_g|| >= r: break
      for b in 1..batch_loop:               # lax.fori_loop
        Poisson batch, one DSA draw shared by real and synthetic batch
        (real_dsa_strategy: the real batch's own families, e.g. none)
        g_real = grad on the batch          # DP: clip, noise, / B
        repeat R_b: S <- S - tau * momentum-SGD grad_S L_dis(g_real, grad_w L(w, S))
      (average_targets: g = mean of the batch_loop g_real, all at this w;
       repeat R_b: S <- ... L_dis(g, grad_w L(w, S)))
      if o == max_outer: break
      R_l epochs of SGD of w on S (batch 512, DSA)
      (model_steps='noisy_real': w <- w - eta_m g instead, also after the last
       iteration; the client's model delta w - w_g is returned as well)

Clients side by side (``vmap`` over clients, ``client_axis`` set): the while
loop's counter is shared by the clients and runs while any of them is inside
its radius; a client that has left it keeps its state through ``jnp.where``
masks, so the model update's ``lax.cond`` (on the shared counter) stays a real
branch. With ``dsa_family_draw="shared"`` the DSA family of every step is drawn
from a key common to the clients, so the family ``lax.switch`` computes one
family, not all six. Each client's numbers equal those of the client run alone.

Reference: Wang et al., "FedLAP-DP: Federated Learning by Sharing
Differentially Private Loss Approximations", PoPETs 2024.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import dsa, privacy
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.config import ClientConfig, FedLAPConfig
from fedlap_jax.matching import matching_step
from fedlap_jax.radius import calibrate_radius
from fedlap_jax.synthetic import real_images
from fedlap_jax.training import sgd_epoch, tree_distance
from fedlap_jax.types import ApplyFn, PyTree


class LocalApproxMetrics(NamedTuple):
  """Diagnostics of one :func:`local_approx` call.

  Attributes:
    matching_loss: ``(R_i, max_outer, batch_loop, R_b)`` ``L_dis`` before each
      synthetic update; entries of while-loop iterations that did not run are 0
      (see ``outer_iterations``). With ``average_targets`` only ``[:, :, 0]``
      is written (one target per while-loop iteration); the rest are 0.
    outer_iterations: ``(R_i,)`` while-loop iterations run per trajectory.
    real_accesses: scalar, real batches actually drawn (``<= T``).
    poisson_extra_chunks: scalar, extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is ever dropped).
    mean_batch_size: scalar, mean realised Poisson batch size.
    trajectory_distance: ``(R_i,)`` ``||w - w_g||`` at the end of each trajectory.
    clip_fraction: scalar, fraction of per-example gradients that were clipped
      (DP only; 0 otherwise).
    model_delta: with ``model_steps='noisy_real'``, the mean over the ``R_i``
      trajectories of ``w_end - w_g`` (a pytree like the model; the upload
      :func:`fedlap_jax.federated.fedlap_round` uses for ``server.start``);
      ``None`` otherwise.

  Under DP, ``matching_loss``, ``outer_iterations``, ``real_accesses`` and
  ``trajectory_distance`` are computed from the noised gradients and the
  synthetic set only (post-processing); the fields named in
  :attr:`NONPRIVATE` are raw statistics of the real records, outside the DP
  mechanism: diagnostics, not to be released.
  """

  NONPRIVATE = ("poisson_extra_chunks", "mean_batch_size", "clip_fraction")

  matching_loss: jax.Array
  outer_iterations: jax.Array
  real_accesses: jax.Array
  poisson_extra_chunks: jax.Array
  mean_batch_size: jax.Array
  trajectory_distance: jax.Array
  clip_fraction: jax.Array
  model_delta: PyTree | None = None


def image_optimizer(config: ClientConfig) -> optax.GradientTransformation:
  """SGD with momentum on the synthetic images (``tau``, momentum 0.5)."""
  return optax.sgd(config.image_lr, momentum=config.image_momentum or None)


# A client's keys travel as a pair ``(client key, family key or None)``: the same
# fold_in / split path derives both, so each step's DSA family key is the same for
# every client (the family key is not mapped over clients) and its own key is not.


def _fold(keys: tuple, data) -> tuple:
  """``fold_in`` on the client key and, alongside, on the shared family key."""
  k, f = keys
  return jax.random.fold_in(k, data), None if f is None else jax.random.fold_in(f, data)


def _split(keys: tuple, num: int) -> tuple[jax.Array, jax.Array | None]:
  """``split`` of both keys: ``(client_keys (num, ...), family_keys or None)``."""
  k, f = keys
  return jax.random.split(k, num), None if f is None else jax.random.split(f, num)


def shared_family_key(key: jax.Array) -> jax.Array:
  """The DSA family key derived from ``key`` (``client.dsa_family_draw='shared'``).

  :func:`local_approx` derives it from the client's own key when none is given;
  :func:`fedlap_jax.federated.fedlap_round` from the round's client key
  ``k_clients``, so every client of the round draws the same families.
  """
  return jax.random.fold_in(key, 0x5DA)


def local_approx(
    key: jax.Array,
    apply_fn: ApplyFn,
    params: PyTree,
    synthetic: SyntheticSet,
    client_data: ClientData,
    config: ClientConfig,
    *,
    learning_rate,
    family_key: jax.Array | None = None,
    client_axis: str | None = None,
) -> tuple[SyntheticSet, jax.Array, LocalApproxMetrics]:
  """Local approximation on one client: Algorithm 1 (``config.dp is None``) or 3.

  Pure and jit-compatible (``config`` static). Vmap it over a stacked client
  axis of ``key``, ``synthetic`` and ``client_data`` to run many clients side
  by side, with ``axis_name=client_axis`` and ``family_key`` not mapped
  (:func:`fedlap_jax.dispatch.run_clients` does this for ``vmap``).

  Args:
    key: PRNG key of this client and round.
    apply_fn: ``apply_fn(params, x) -> logits``, the only model assumption.
    params: the global model ``w_g`` (a pytree).
    synthetic: the synthetic set to start from (``S`` images).
    client_data: the client's real data, padded with a mask.
    config: a :class:`ClientConfig` (loop sizes, ``tau``, ``r``, DP, ...).
    learning_rate: model step size ``eta_m`` for local steps (may be traced).
    family_key: with ``config.dsa_family_draw == "shared"``, the key that
      draws the DSA families, the same for every client of the round (derived
      along the same path as the client's keys, so each step's family is
      common to the clients and each family has probability
      ``1 / len(families)``); default: derived from ``key`` (one client alone).
      Ignored with ``"per_client"``.
    client_axis: ``None``: the radius-bounded while loop stops when this
      client leaves the radius and the last iteration's model update is
      skipped by a ``lax.cond`` (one client at a time). A ``vmap`` axis name:
      the clients mapped over that axis run side by side; the loop counter is
      shared, the loop runs while any of them is inside its radius (``psum``
      over the axis), and a client's termination is a mask (its synthetic
      set, optimiser state, model and statistics are kept by ``jnp.where``
      once it has stopped). The counter being shared, the condition of the
      model update stays a real branch under ``vmap``, not a select of both.
      Same numbers as ``None`` for every client, up to float rounding.

  Returns:
    ``(synthetic, r_k, metrics)``: the optimised synthetic set (labels and mask
    unchanged), the client's radius (calibrated on real data if
    ``config.calibrate_radius``, else ``config.radius``) and
    :class:`LocalApproxMetrics`.
  """
  c = config
  capacity = c.capacity
  num_records = jnp.sum(client_data.mask)
  rate = c.batch_size / jnp.maximum(num_records, 1).astype(jnp.float32)
  augment_real = dsa.make_augment_fn(
      c.dsa_strategy if c.real_dsa_strategy is None else c.real_dsa_strategy)
  opt = image_optimizer(c)
  syn_weights = synthetic.mask.astype(jnp.float32)
  if c.dsa_family_draw == "per_client":
    family_key = None
  elif family_key is None:
    family_key = shared_family_key(key)

  def real_batch_gradient(keys, w):
    k_sample, k_aug, k_noise = jax.random.split(keys[0], 3)
    f_aug = None if keys[1] is None else jax.random.split(keys[1], 3)[1]
    batch = privacy.poisson_sample(k_sample, client_data.mask, rate, capacity)

    def chunk_sums(indices, is_padding):
      # One DSA draw per batch (every chunk gets the same transform).
      xb = augment_real(k_aug, client_data.images(indices), family_key=f_aug)
      yb = client_data.y[indices]
      if c.dp is None:
        return privacy.real_gradient_sum(apply_fn, w, xb, yb, is_padding,
                                         microbatch_size="auto")[0], jnp.float32(0.0)
      clipped_sum, norms = privacy.clipped_gradient_sum(
          apply_fn, w, xb, yb, is_padding, l2_clip_norm=c.dp.l2_clip_norm,
          microbatch_size=c.dp.microbatch_size, method=c.dp.per_example_method)
      was_clipped = jnp.logical_and(norms > c.dp.l2_clip_norm, ~is_padding)
      return clipped_sum, jnp.sum(was_clipped).astype(jnp.float32)

    # Every sampled record counts, also when the draw overflows the buffer.
    total, clipped = privacy.sum_over_chunks(chunk_sums, batch)
    if c.dp is None:
      count = jnp.maximum(batch.size, 1).astype(jnp.float32)
      g = jax.tree.map(lambda t: t / count, total)
    else:
      g = privacy.privatise(k_noise, total, l2_clip_norm=c.dp.l2_clip_norm,
                            noise_multiplier=c.dp.noise_multiplier,
                            expected_batch_size=c.batch_size)
    return g, (k_aug, f_aug), batch, clipped

  def count_access(stats, batch, clipped):
    """``stats`` ``(accesses, extra chunks, sampled, clipped)`` after one real batch."""
    accesses, extra, sampled, n_clipped = stats
    return (accesses + 1, extra + batch.extra_chunks, sampled + batch.size, n_clipped + clipped)

  def real_batches(keys_o, w, x_syn, opt_state, stats):
    """The ``batch_loop`` real batches of one while-loop iteration, each ``R_b`` updates."""
    def batch_step(b, carry):
      x_syn, opt_state, losses, stats = carry
      g_real, aug_keys, batch, clipped = real_batch_gradient(_fold(keys_o, b), w)

      def boost(j, inner):
        x_syn, opt_state, losses = inner
        loss, grad_x = matching_step(apply_fn, w, synthetic._replace(x=x_syn), g_real,
                                     aug_keys[0], dsa_strategy=c.dsa_strategy,
                                     mse_weight=c.mse_weight, family_key=aug_keys[1])
        updates, opt_state = opt.update(grad_x, opt_state, x_syn)
        return optax.apply_updates(x_syn, updates), opt_state, losses.at[b, j].set(loss)

      x_syn, opt_state, losses = jax.lax.fori_loop(0, c.boost_loop, boost,
                                                   (x_syn, opt_state, losses))
      return x_syn, opt_state, losses, count_access(stats, batch, clipped)

    losses = jnp.zeros((c.batch_loop, c.boost_loop), jnp.float32)
    return jax.lax.fori_loop(0, c.batch_loop, batch_step, (x_syn, opt_state, losses, stats))

  def averaged_batches(keys_o, w, x_syn, opt_state, stats):
    """``average_targets``: mean of the ``batch_loop`` noisy gradients at ``w``, then R_b updates.

    Every gradient is taken at the same ``w`` (the model moves only after the
    batch loop), so their mean is an unbiased estimate of the same clipped
    gradient with ``1 / batch_loop`` of the noise variance. It is a function of
    released noisy gradients only (post-processing): the accountant's ``T``
    still counts each of the ``batch_loop`` accesses. The synthetic batch gets
    its own DSA draw per update (the real batches each had theirs).

    Returns ``(x_syn, opt_state, losses, stats, g_mean)``; ``losses`` holds the
    ``R_b`` matching losses in its row 0.
    """
    def accumulate(b, acc):
      g_sum, stats = acc
      g, _, batch, clipped = real_batch_gradient(_fold(keys_o, b), w)
      return jax.tree.map(jnp.add, g_sum, g), count_access(stats, batch, clipped)

    zeros = jax.tree.map(jnp.zeros_like, w)
    g_sum, stats = jax.lax.fori_loop(0, c.batch_loop, accumulate, (zeros, stats))
    g_mean = jax.tree.map(lambda g: g / c.batch_loop, g_sum)
    keys_match = _fold(keys_o, c.batch_loop + 1)

    def boost(j, inner):
      x_syn, opt_state, losses = inner
      k, f = _fold(keys_match, j)
      loss, grad_x = matching_step(apply_fn, w, synthetic._replace(x=x_syn), g_mean, k,
                                   dsa_strategy=c.dsa_strategy, mse_weight=c.mse_weight,
                                   family_key=f)
      updates, opt_state = opt.update(grad_x, opt_state, x_syn)
      return optax.apply_updates(x_syn, updates), opt_state, losses.at[0, j].set(loss)

    losses = jnp.zeros((c.batch_loop, c.boost_loop), jnp.float32)
    x_syn, opt_state, losses = jax.lax.fori_loop(0, c.boost_loop, boost,
                                                 (x_syn, opt_state, losses))
    return x_syn, opt_state, losses, stats, g_mean

  def iteration(keys_o, o, w, x_syn, opt_state, stats):
    """One while-loop iteration: the real batches, then the model's step(s).

    Returns ``(w, moved, x_syn, opt_state, losses, stats)``; ``moved`` (a
    Python bool) says whether ``w`` may have changed.
    """
    if c.average_targets:
      x_syn, opt_state, losses, stats, g_mean = averaged_batches(keys_o, w, x_syn, opt_state,
                                                                 stats)
    else:
      x_syn, opt_state, losses, stats = real_batches(keys_o, w, x_syn, opt_state, stats)
    if c.model_steps == "noisy_real":  # a DP-SGD step along the same released mean
      w = jax.tree.map(lambda p, g: p - learning_rate * g, w, g_mean)
      return w, True, x_syn, opt_state, losses, stats
    if c.inner_loop > 0:
      # The last permitted iteration ends without a model update (`o` is shared
      # by clients side by side: a real branch under vmap, not a select).
      w = jax.lax.cond(o < c.max_outer - 1, functools.partial(local_update, keys_o, x_syn),
                       lambda w: w, w)
      return w, True, x_syn, opt_state, losses, stats
    return w, False, x_syn, opt_state, losses, stats

  def model_delta(w):
    return jax.tree.map(jnp.subtract, w, params) if c.model_steps == "noisy_real" else None

  def local_update(keys_o, x_syn, w):
    """``R_l`` epochs of SGD of the model on the synthetic set."""
    def epoch(e, w):
      k, f = _fold(_fold(keys_o, c.batch_loop), e)
      return sgd_epoch(k, apply_fn, w, x_syn, synthetic.y, syn_weights, learning_rate,
                       batch_size=c.model_batch_size, dsa_strategy=c.dsa_strategy,
                       family_key=f)[0]
    return jax.lax.fori_loop(0, c.inner_loop, epoch, w)

  def trajectory_one(carry, keys_i):
    """One trajectory of one client: the while loop stops when it leaves the radius."""
    x_syn, opt_state, stats = carry
    loss_log = jnp.zeros((c.max_outer, c.batch_loop, c.boost_loop), jnp.float32)

    def cond(s):
      o, _, dist, *_ = s
      return jnp.logical_and(o < c.max_outer, dist < c.radius)

    def body(s):
      o, w, dist, x_syn, opt_state, loss_log, stats = s
      w, moved, x_syn, opt_state, losses, stats = iteration(_fold(keys_i, o), o, w, x_syn,
                                                            opt_state, stats)
      loss_log = loss_log.at[o].set(losses)
      if moved:
        dist = tree_distance(w, params)
      return o + 1, w, dist, x_syn, opt_state, loss_log, stats

    init = (jnp.int32(0), params, jnp.float32(0.0), x_syn, opt_state, loss_log, stats)
    o, w, dist, x_syn, opt_state, loss_log, stats = jax.lax.while_loop(cond, body, init)
    return (x_syn, opt_state, stats), (loss_log, o, dist, model_delta(w))

  def trajectory_masked(carry, keys_i):
    """One trajectory, clients side by side: shared counter, per-client termination as a mask."""
    x_syn, opt_state, stats = carry
    loss_log = jnp.zeros((c.max_outer, c.batch_loop, c.boost_loop), jnp.float32)

    def any_client(flag):
      return jax.lax.psum(flag.astype(jnp.int32), client_axis) > 0

    def cond(s):
      return jnp.logical_and(s[0] < c.max_outer, s[-1])

    def body(s):
      o, runs, active, w, dist, x_syn, opt_state, loss_log, stats, _ = s
      keys_o = _fold(keys_i, o)

      def keep(new, old):  # a client that has stopped keeps what it had
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)

      new_w, moved, new_x, new_opt, losses, new_stats = iteration(keys_o, o, w, x_syn,
                                                                  opt_state, stats)
      w, x_syn, opt_state, stats = keep((new_w, new_x, new_opt, new_stats),
                                        (w, x_syn, opt_state, stats))
      loss_log = loss_log.at[o].set(jnp.where(active, losses, 0.0))
      if moved:
        dist = jnp.where(active, tree_distance(w, params), dist)
      runs = runs + active.astype(jnp.int32)
      active = jnp.logical_and(active, dist < c.radius)
      return o + 1, runs, active, w, dist, x_syn, opt_state, loss_log, stats, any_client(active)

    init = (jnp.int32(0), jnp.int32(0), jnp.bool_(True), params, jnp.float32(0.0), x_syn,
            opt_state, loss_log, stats, jnp.bool_(True))
    _, runs, _, w, dist, x_syn, opt_state, loss_log, stats, _ = jax.lax.while_loop(
        cond, body, init)
    return (x_syn, opt_state, stats), (loss_log, runs, dist, model_delta(w))

  stats0 = (jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.float32(0.0))
  k_traj, k_cal = jax.random.split(key)
  f_traj, f_cal = (None, None) if family_key is None else jax.random.split(family_key)
  trajectory = trajectory_one if client_axis is None else trajectory_masked
  (x_syn, _, stats), (loss_log, outer, dists, deltas) = jax.lax.scan(
      trajectory, (synthetic.x, opt.init(synthetic.x), stats0),
      _split((k_traj, f_traj), c.iterations))
  accesses, extra_chunks, sampled, n_clipped = stats
  synthetic = synthetic._replace(x=x_syn)

  if c.calibrate_radius:
    r_k, _ = calibrate_radius(
        k_cal, apply_fn, params, synthetic, client_data,
        learning_rate=learning_rate, max_radius=c.radius, epochs=c.calibration_epochs,
        batch_size=c.model_batch_size, dsa_strategy=c.dsa_strategy,
        eval_size=c.calibration_eval_size, family_key=f_cal)
  else:
    r_k = jnp.asarray(c.radius, jnp.float32)

  metrics = LocalApproxMetrics(
      matching_loss=loss_log,
      outer_iterations=outer,
      real_accesses=accesses,
      poisson_extra_chunks=extra_chunks,
      mean_batch_size=sampled / jnp.maximum(accesses, 1),
      trajectory_distance=dists,
      clip_fraction=n_clipped / jnp.maximum(sampled, 1),
      model_delta=(None if deltas is None
                   else jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)),
  )
  return synthetic, r_k, metrics


class ClientUpdate(NamedTuple):
  """What one FedLAP client sends the server after a round (:func:`client_step`).

  Stacked over clients (every leaf with a leading ``(K,)`` axis) it is what
  :func:`fedlap_jax.server.server_step` takes.

  Attributes:
    synthetic: the client's :class:`SyntheticSet` after local approximation,
      ``(S, ...)`` (labels and mask as the run fixed them).
    radius: ``r_k``, float32 (the constant ``r`` under DP or without
      calibration).
    model_delta: with ``server.start='fedavg_delta'``, ``w_end - w_g`` averaged
      over the ``R_i`` trajectories (:attr:`LocalApproxMetrics.model_delta`, a
      pytree like the model); ``None`` otherwise. Under DP it is
      post-processing of the round's released noisy gradients.
  """

  synthetic: SyntheticSet
  radius: jax.Array
  model_delta: PyTree | None = None


def client_step(
    key: jax.Array,
    apply_fn: ApplyFn,
    params: PyTree,
    synthetic: SyntheticSet,
    client_data: ClientData,
    config: FedLAPConfig,
    *,
    learning_rate,
    family_key: jax.Array | None = None,
    init_key: jax.Array | None = None,
    client_axis: str | None = None,
) -> tuple[ClientUpdate, LocalApproxMetrics]:
  """One FedLAP client's round: its synthetic set's start, :func:`local_approx`, the upload.

  Pure and jit-compatible (``config`` static); every front end runs a client
  through it (:func:`fedlap_jax.federated.fedlap_round` for all clients at
  once, the Flower ``ClientApp`` for one).

  Args:
    key: PRNG key of this client and round.
    apply_fn, params: the model and the received global model ``w_g``.
    synthetic: the client's synthetic set from the previous round (or the
      initial one); under ``synthetic_init='real'`` only its labels and mask
      are used: the images are drawn again from real records with ``init_key``.
    client_data: the client's real records, padded with a mask.
    config: :class:`~fedlap_jax.config.FedLAPConfig`.
    learning_rate: the clients' ``eta_m`` of the round (may be traced).
    family_key: the round's shared DSA family key (:func:`shared_family_key`
      of the round's client key); ``None``: derived from ``key``.
    init_key: the key of the real images under ``synthetic_init='real'``
      (required then); ignored under ``'noise'``.
    client_axis: see :func:`local_approx`.

  Returns:
    ``(ClientUpdate, LocalApproxMetrics)``; the metrics' ``model_delta`` is
    ``None`` (the delta travels in the update, when the server uses it).

  Raises:
    ValueError: ``synthetic_init='real'`` without ``init_key``.
  """
  if config.synthetic_init == "real":
    if init_key is None:
      raise ValueError("client_step: synthetic_init='real' needs init_key (the round's key "
                       "of the real images); allowed: a PRNG key")
    synthetic = synthetic._replace(x=real_images(init_key, client_data, synthetic.y,
                                                 synthetic.mask, config.client.ipc))
  synthetic, radius, metrics = local_approx(
      key, apply_fn, params, synthetic, client_data, config.client, learning_rate=learning_rate,
      family_key=family_key, client_axis=client_axis)
  delta = metrics.model_delta if config.server.start == "fedavg_delta" else None
  return ClientUpdate(synthetic, radius, delta), metrics._replace(model_delta=None)
