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
        g_real = grad on the batch          # DP: clip, noise, / B
        repeat R_b: S <- S - tau * momentum-SGD grad_S L_dis(g_real, grad_w L(w, S))
      if o == max_outer: break
      R_l epochs of SGD of w on S (batch 512, DSA)

Reference: Wang et al., "FedLAP-DP: Federated Learning by Sharing
Differentially Private Loss Approximations", PoPETs 2024.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedlap_jax import dsa, privacy
from fedlap_jax.client_data import ClientData, SyntheticSet
from fedlap_jax.config import ClientConfig
from fedlap_jax.matching import matching_distance
from fedlap_jax.radius import calibrate_radius
from fedlap_jax.training import sgd_epoch, tree_distance
from fedlap_jax.types import ApplyFn, PyTree


class LocalApproxMetrics(NamedTuple):
  """Diagnostics of one :func:`local_approx` call.

  Attributes:
    matching_loss: ``(R_i, max_outer, batch_loop, R_b)`` ``L_dis`` before each
      synthetic update; entries of while-loop iterations that did not run are 0
      (see ``outer_iterations``).
    outer_iterations: ``(R_i,)`` while-loop iterations run per trajectory.
    real_accesses: scalar, real batches actually drawn (``<= T``).
    poisson_extra_chunks: scalar, extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is ever dropped).
    mean_batch_size: scalar, mean realised Poisson batch size.
    trajectory_distance: ``(R_i,)`` ``||w - w_g||`` at the end of each trajectory.
    clip_fraction: scalar, fraction of per-example gradients that were clipped
      (DP only; 0 otherwise).

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


def synthetic_gradient(apply_fn: ApplyFn, params: PyTree, synthetic: SyntheticSet,
                       x: jax.Array | None = None) -> PyTree:
  """Gradient of the mean loss on the synthetic set (images ``x`` if given)."""
  x = synthetic.x if x is None else x
  return privacy.real_gradient(apply_fn, params, x, synthetic.y,
                               jnp.logical_not(synthetic.mask))


def matching_step(
    apply_fn: ApplyFn,
    params: PyTree,
    synthetic: SyntheticSet,
    g_real: PyTree,
    aug_key: jax.Array,
    *,
    dsa_strategy: str,
    mse_weight,
    row_reduction: str = "mean",
    include_vectors: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """``L_dis`` and its gradient with respect to the synthetic images (grad of grad).

  ``row_reduction`` and ``include_vectors`` select the distance's variant
  (:func:`fedlap_jax.matching.matching_distance`; FedLAP's by default, DSC /
  PSG pass ``"sum"`` and ``False``).

  Returns:
    ``(loss, grad_x)`` with ``grad_x`` shaped like ``synthetic.x``.
  """
  augment = dsa.make_augment_fn(dsa_strategy)

  def loss_fn(x):
    g_syn = synthetic_gradient(apply_fn, params, synthetic, augment(aug_key, x))
    return matching_distance(g_real, g_syn, mse_weight=mse_weight, row_reduction=row_reduction,
                             include_vectors=include_vectors)

  return jax.value_and_grad(loss_fn)(synthetic.x)


def class_blocks(synthetic: SyntheticSet, ipc: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A synthetic set laid out by :func:`fedlap_jax.federated.synthetic_labels`, per class.

  Slots come in blocks of ``ipc`` with one label each (then padding blocks), so
  ``S = C * ipc``. Returns ``(x, labels, valid)``: images ``(C, ipc, H, W, C_img)``,
  each block's label ``(C,)`` and whether the block holds a class ``(C,)``.
  The class-wise methods (DSC's gradient matching, FedDM's distribution
  matching) match each block against real records of its class.
  """
  s = synthetic.x.shape[0]
  if s % ipc:
    raise ValueError(f"synthetic set of {s} slots is not in blocks of ipc={ipc}; allowed: "
                     "the layout of fedlap_jax.federated.synthetic_labels")
  blocks = s // ipc
  return (synthetic.x.reshape(blocks, ipc, *synthetic.x.shape[1:]),
          synthetic.y.reshape(blocks, ipc)[:, 0], synthetic.mask.reshape(blocks, ipc)[:, 0])


def class_batch(key: jax.Array, client_data: ClientData, label: jax.Array, valid: jax.Array,
                batch_size: int, capacity: int) -> privacy.PoissonBatch:
  """A Poisson batch of the client's records of class ``label`` (non-private).

  Each record of the class is drawn with probability ``min(1, B / N_c)`` (``N_c``
  its records of the class): ``B`` expected, the whole class when it holds
  fewer than ``B`` records (as the condensation code's ``get_images(c, B)``).
  The rate depends on ``N_c``, so this sampling is for the non-DP class-wise
  methods only. ``valid=False`` gives an empty batch.
  """
  members = jnp.logical_and(jnp.logical_and(client_data.mask, client_data.y == label), valid)
  n_c = jnp.sum(members)
  rate = jnp.minimum(1.0, batch_size / jnp.maximum(n_c, 1).astype(jnp.float32))
  return privacy.poisson_sample(key, members, rate, capacity)


def image_optimizer(config: ClientConfig) -> optax.GradientTransformation:
  """SGD with momentum on the synthetic images (``tau``, momentum 0.5)."""
  return optax.sgd(config.image_lr, momentum=config.image_momentum or None)


def local_approx(
    key: jax.Array,
    apply_fn: ApplyFn,
    params: PyTree,
    synthetic: SyntheticSet,
    client_data: ClientData,
    config: ClientConfig,
    *,
    learning_rate,
) -> tuple[SyntheticSet, jax.Array, LocalApproxMetrics]:
  """Local approximation on one client: Algorithm 1 (``config.dp is None``) or 3.

  Pure and jit-compatible (``config`` static). Vmap it over a stacked client
  axis of ``key``, ``synthetic`` and ``client_data`` to run many clients.

  Args:
    key: PRNG key of this client and round.
    apply_fn: ``apply_fn(params, x) -> logits``, the only model assumption.
    params: the global model ``w_g`` (a pytree).
    synthetic: the synthetic set to start from (``S`` images).
    client_data: the client's real data, padded with a mask.
    config: a :class:`ClientConfig` (loop sizes, ``tau``, ``r``, DP, ...).
    learning_rate: model step size ``eta_m`` for local steps (may be traced).

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
  augment = dsa.make_augment_fn(c.dsa_strategy)
  opt = image_optimizer(c)
  syn_weights = synthetic.mask.astype(jnp.float32)

  def real_batch_gradient(k, w):
    k_sample, k_aug, k_noise = jax.random.split(k, 3)
    batch = privacy.poisson_sample(k_sample, client_data.mask, rate, capacity)

    def chunk_sums(indices, is_padding):
      # One DSA draw per batch (every chunk gets the same transform).
      xb = augment(k_aug, client_data.images(indices))
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
    return g, k_aug, batch, clipped

  def batch_step(b, carry):
    w, key_o, x_syn, opt_state, losses, stats = carry
    g_real, k_aug, batch, clipped = real_batch_gradient(jax.random.fold_in(key_o, b), w)

    def boost(j, inner):
      x_syn, opt_state, losses = inner
      loss, grad_x = matching_step(apply_fn, w, synthetic._replace(x=x_syn), g_real, k_aug,
                                   dsa_strategy=c.dsa_strategy, mse_weight=c.mse_weight)
      updates, opt_state = opt.update(grad_x, opt_state, x_syn)
      return optax.apply_updates(x_syn, updates), opt_state, losses.at[b, j].set(loss)

    x_syn, opt_state, losses = jax.lax.fori_loop(0, c.boost_loop, boost,
                                                 (x_syn, opt_state, losses))
    accesses, extra, sampled, n_clipped = stats
    stats = (accesses + 1, extra + batch.extra_chunks, sampled + batch.size,
             n_clipped + clipped)
    return w, key_o, x_syn, opt_state, losses, stats

  def trajectory(carry, key_i):
    x_syn, opt_state, stats = carry
    loss_log = jnp.zeros((c.max_outer, c.batch_loop, c.boost_loop), jnp.float32)

    def cond(s):
      o, _, dist, *_ = s
      return jnp.logical_and(o < c.max_outer, dist < c.radius)

    def body(s):
      o, w, dist, x_syn, opt_state, loss_log, stats = s
      key_o = jax.random.fold_in(key_i, o)
      losses = jnp.zeros((c.batch_loop, c.boost_loop), jnp.float32)
      w, _, x_syn, opt_state, losses, stats = jax.lax.fori_loop(
          0, c.batch_loop, batch_step, (w, key_o, x_syn, opt_state, losses, stats))
      loss_log = loss_log.at[o].set(losses)

      if c.inner_loop > 0:
        def train(w):
          def epoch(e, w):
            k = jax.random.fold_in(jax.random.fold_in(key_o, c.batch_loop), e)
            return sgd_epoch(k, apply_fn, w, x_syn, synthetic.y, syn_weights, learning_rate,
                             batch_size=c.model_batch_size, dsa_strategy=c.dsa_strategy)[0]
          return jax.lax.fori_loop(0, c.inner_loop, epoch, w)
        # The last permitted iteration ends without a model update.
        w = jax.lax.cond(o < c.max_outer - 1, train, lambda w: w, w)
        dist = tree_distance(w, params)
      return o + 1, w, dist, x_syn, opt_state, loss_log, stats

    init = (jnp.int32(0), params, jnp.float32(0.0), x_syn, opt_state, loss_log, stats)
    o, _, dist, x_syn, opt_state, loss_log, stats = jax.lax.while_loop(cond, body, init)
    return (x_syn, opt_state, stats), (loss_log, o, dist)

  stats0 = (jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.float32(0.0))
  k_traj, k_cal = jax.random.split(key)
  (x_syn, _, stats), (loss_log, outer, dists) = jax.lax.scan(
      trajectory, (synthetic.x, opt.init(synthetic.x), stats0),
      jax.random.split(k_traj, c.iterations))
  accesses, extra_chunks, sampled, n_clipped = stats
  synthetic = synthetic._replace(x=x_syn)

  if c.calibrate_radius:
    r_k, _ = calibrate_radius(
        k_cal, apply_fn, params, synthetic, client_data,
        learning_rate=learning_rate, max_radius=c.radius, epochs=c.calibration_epochs,
        batch_size=c.model_batch_size, dsa_strategy=c.dsa_strategy,
        eval_size=c.calibration_eval_size)
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
  )
  return synthetic, r_k, metrics
