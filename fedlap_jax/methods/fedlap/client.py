"""Client side of FedLAP / FedLAP-DP: local approximation (Algorithms 1 and 3).

A client receives the global model ``w_g`` and the trust-region radius ``r``
and optimises its synthetic set ``S_k`` so that gradients on ``S_k`` match the
gradients on its real data along local training trajectories that stay within
``r`` of ``w_g``. Under DP the real gradients are clipped per example and
noised (:func:`fedlap_jax.privacy.poisson_gradient`); everything done with them
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

The pieces, each a module-level pure function: :func:`noisy_real_target`
(one Poisson batch's clipped, noised, averaged gradient: the only access to
real records), :func:`match_images` (``R_b`` updates of the images against a
target with an ``optax`` transformation, by default :func:`default_image_optimizer`),
the targets of one iteration (:func:`per_batch_targets`, :func:`averaged_target`),
the model's step (:func:`synthetic_model_step`, :func:`noisy_real_step`),
:func:`trajectory` (the radius-bounded while loop). :func:`recipe` names the
pieces a :class:`ClientConfig` chooses, once; :func:`client_step` adds the
round's start (real images) and packs the :class:`ClientUpdate` a client sends.

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

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlap_jax import accounting, optim, privacy
from fedlap_jax.client_data import (
  ClientData,
  SyntheticSet,
  check_batch_size,
  check_finite,
  check_labels,
  check_pair,
  num_classes_of,
  on_device,
  poison_unless,
)
from fedlap_jax.methods.fedlap.config import ClientConfig, FedLAPConfig

from fedlap_jax.matching import matching_step
from fedlap_jax.methods.fedlap.radius import calibrate_radius
from fedlap_jax.synthetic import image_optimizer as default_image_optimizer, real_images
from fedlap_jax.training import sgd_epoch, train_epoch, tree_distance
from fedlap_jax.types import ApplyFn, PyTree


class LocalApproxMetrics(NamedTuple):
  """Diagnostics of one :func:`local_approx` call.

  Attributes:
    matching_loss: ``(R_i, max_outer, targets, R_b)`` ``L_dis`` before each
      synthetic update, ``targets`` the matching targets of one while-loop iteration
      (:attr:`ClientConfig.targets_per_iteration`: ``batch_loop``, or 1 with
      ``average_targets``); entries of while-loop iterations that did not run are 0
      (see ``outer_iterations``): the first ``outer_iterations[i]`` of trajectory ``i``
      are exactly the rows written.
    outer_iterations: ``(R_i,)`` while-loop iterations run per trajectory.
    real_accesses: scalar, real batches actually drawn (``<= T``).
    poisson_extra_chunks: scalar, extra buffer-sized chunks processed because a
      Poisson draw exceeded the buffer (usually 0; no record is ever dropped).
    mean_batch_size: scalar, mean realised Poisson batch size.
    trajectory_distance: ``(R_i,)`` ``||w - w_g||`` at the end of each trajectory.
    clip_fraction: scalar, fraction of per-example gradients that were clipped
      (DP only; 0 otherwise).
    model_delta: with ``model_steps='noisy_real'``, the mean over the ``R_i``
      trajectories of ``w_end - w_g`` (a pytree like the model; what
      :func:`client_step` sends as :attr:`ClientUpdate.model_delta` to a
      ``server.start='fedavg_delta'`` server); ``None`` otherwise.

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
  FedLAP's round plan (:mod:`fedlap_jax.methods.fedlap`) from the round's client key
  ``k_clients``, so every client of the round draws the same families.
  """
  return jax.random.fold_in(key, 0x5DA)


# ----------------------------------------------------------------------------
# The pieces of local approximation. Each reads the client's fixed inputs from a
# LocalProblem and is a pure function of its own arguments.
# ----------------------------------------------------------------------------


class LocalProblem(NamedTuple):
  """The fixed inputs of one client's local approximation, read by every piece.

  Attributes:
    apply_fn: ``apply_fn(params, x) -> logits``.
    params: the global model ``w_g`` (trajectories start from it).
    synthetic: the client's :class:`SyntheticSet` (its labels and mask; the
      images move and are passed to the pieces separately).
    client_data: the client's real records, padded with a mask.
    config: :class:`ClientConfig` (static).
    learning_rate: the model's step size ``eta_m`` (may be traced).
    optimizer: the images' ``optax.GradientTransformation``.
    model_optimizer: the model's direction (an ``optax.GradientTransformation`` before the
      rate, :mod:`fedlap_jax.optim`), stepped at ``learning_rate``; ``None``: plain SGD,
      the update written out (``w - eta_m g``).
  """

  apply_fn: ApplyFn
  params: PyTree
  synthetic: SyntheticSet
  client_data: ClientData
  config: ClientConfig
  learning_rate: jax.Array
  optimizer: optax.GradientTransformation
  model_optimizer: optax.GradientTransformation | None = None


class AccessStats(NamedTuple):
  """Running counts over a client's real batches.

  Attributes:
    accesses: int32, real batches drawn (each a noisy access under DP).
    extra_chunks: int32, buffer-sized chunks beyond the first (overflowing draws).
    sampled: int32, records drawn over all batches.
    clipped: float32, per-example gradients clipped over all batches (DP).
  """

  accesses: jax.Array
  extra_chunks: jax.Array
  sampled: jax.Array
  clipped: jax.Array

  @classmethod
  def zeros(cls) -> "AccessStats":
    return cls(jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.float32(0.0))

  def add(self, target: "RealTarget") -> "AccessStats":
    """The counts after one more real batch."""
    return AccessStats(
      self.accesses + 1,
      self.extra_chunks + target.extra_chunks,
      self.sampled + target.batch_size,
      self.clipped + target.clipped,
    )


# A matching target from one real batch: :func:`fedlap_jax.privacy.poisson_gradient`'s result
# (its gradient, the batch's DSA draw, the counts :class:`AccessStats` adds up).
RealTarget = privacy.BatchGradient


def real_gradient_query(config: ClientConfig) -> privacy.PoissonGradient:
  """The client's real-gradient query (:class:`fedlap_jax.privacy.PoissonGradient`): ``B``, the
  buffer, ``config.dp``'s clip, noise, microbatch and per-example method, the real batches'
  DSA (``real_dsa_strategy``, default ``dsa_strategy``); the non-private mean is over the
  records drawn. Under DP, :meth:`~fedlap_jax.privacy.PoissonGradient.mechanism` of
  ``T = R_i * max_outer * batch_loop`` is FedLAP-DP's mechanism."""
  return privacy.PoissonGradient.of(
    config.dp,
    batch_size=config.batch_size,
    capacity=config.capacity,
    dsa_strategy=config.dsa_strategy
    if config.real_dsa_strategy is None
    else config.real_dsa_strategy,
  )


def noisy_real_target(problem: LocalProblem, keys: tuple, params: PyTree) -> RealTarget:
  """The gradient of one Poisson batch of real records at ``params``: the only data access.

  :func:`fedlap_jax.privacy.poisson_gradient` with the client's :func:`real_gradient_query`:
  each record drawn with ``q = B / N_k`` (every record counted also when the draw overflows
  the buffer), one DSA draw of ``real_dsa_strategy`` (default ``dsa_strategy``); under DP
  each example's gradient is clipped to ``C``, the sum noised and divided by ``B``
  (Algorithm 3), else averaged over the realised batch. Keys:
  ``(k_sample, k_aug, k_noise) = split(keys[0], 3)``, the family key ``split(keys[1], 3)[1]``.

  Args:
    problem: the client's :class:`LocalProblem`.
    keys: ``(client key, family key or None)`` of this batch.
    params: the model ``w`` the gradient is taken at.
  """
  return privacy.poisson_gradient(
    real_gradient_query(problem.config),
    keys[0],
    problem.apply_fn,
    params,
    problem.client_data,
    family_key=keys[1],
  )


def match_images(
  problem: LocalProblem,
  params: PyTree,
  images: jax.Array,
  opt_state,
  target: PyTree,
  aug_keys: tuple,
  *,
  fresh_augmentation: bool,
) -> tuple[jax.Array, optax.OptState, jax.Array]:
  """``R_b`` updates of the synthetic images against one target, at the model ``params``.

  Update ``j``: ``L_dis(target, grad_w L(w, S))`` and its image gradient
  (:func:`fedlap_jax.matching.matching_step`), then a step of
  ``problem.optimizer``. The synthetic batch's DSA draw is ``aug_keys``
  itself (the paper: the real batch's draw) or, with ``fresh_augmentation``,
  ``fold_in(aug_keys, j)`` for update ``j``.

  Returns:
    ``(images, opt_state, losses)``; ``losses`` ``(R_b,)``, ``L_dis`` before each update.
  """
  c = problem.config

  def update(j, carry):
    x, opt_state, losses = carry
    k, f = _fold(aug_keys, j) if fresh_augmentation else aug_keys
    loss, grad_x = matching_step(
      problem.apply_fn,
      params,
      problem.synthetic._replace(x=x),
      target,
      k,
      dsa_strategy=c.dsa_strategy,
      mse_weight=c.mse_weight,
      family_key=f,
    )
    updates, opt_state = problem.optimizer.update(grad_x, opt_state, x)
    return optax.apply_updates(x, updates), opt_state, losses.at[j].set(loss)

  losses = jnp.zeros((c.boost_loop,), jnp.float32)
  return jax.lax.fori_loop(0, c.boost_loop, update, (images, opt_state, losses))


def per_batch_targets(
  problem: LocalProblem,
  keys: tuple,
  params: PyTree,
  images: jax.Array,
  opt_state,
  stats: AccessStats,
):
  """The paper's targets: each of the ``batch_loop`` real batches in turn, ``R_b`` updates each.

  Batch ``b`` uses the keys ``fold_in(keys, b)``; the synthetic batch shares
  the real batch's DSA draw.

  Returns:
    ``(images, opt_state, losses (batch_loop, R_b), stats, None)`` (no
    gradient for the model's step).
  """
  c = problem.config

  def batch_step(b, carry):
    x, opt_state, losses, stats = carry
    target = noisy_real_target(problem, _fold(keys, b), params)
    x, opt_state, row = match_images(
      problem,
      params,
      x,
      opt_state,
      target.gradient,
      (target.aug_key, target.family_key),
      fresh_augmentation=False,
    )
    return x, opt_state, losses.at[b].set(row), stats.add(target)

  losses = jnp.zeros((c.batch_loop, c.boost_loop), jnp.float32)
  x, opt_state, losses, stats = jax.lax.fori_loop(
    0, c.batch_loop, batch_step, (images, opt_state, losses, stats)
  )
  return x, opt_state, losses, stats, None


def averaged_target(
  problem: LocalProblem,
  keys: tuple,
  params: PyTree,
  images: jax.Array,
  opt_state,
  stats: AccessStats,
):
  """``average_targets``: the mean of the ``batch_loop`` real gradients, then ``R_b`` updates.

  Every gradient is taken at the same ``params`` (the model moves only after
  the batches), so their mean estimates the same clipped gradient with
  ``1 / batch_loop`` of the noise variance. It is a function of released noisy
  gradients only (post-processing): ``T`` still counts each access. The
  synthetic batch gets its own DSA draw per update (keys
  ``fold_in(keys, batch_loop + 1)``; the real batches each had theirs).

  Returns:
    ``(images, opt_state, losses (1, R_b), stats, g_mean)``: one target, ``R_b`` matching
    losses.
  """
  c = problem.config

  def accumulate(b, acc):
    g_sum, stats = acc
    target = noisy_real_target(problem, _fold(keys, b), params)
    return jax.tree.map(jnp.add, g_sum, target.gradient), stats.add(target)

  zeros = jax.tree.map(jnp.zeros_like, params)
  g_sum, stats = jax.lax.fori_loop(0, c.batch_loop, accumulate, (zeros, stats))
  g_mean = jax.tree.map(lambda g: g / c.batch_loop, g_sum)
  x, opt_state, row = match_images(
    problem,
    params,
    images,
    opt_state,
    g_mean,
    _fold(keys, c.batch_loop + 1),
    fresh_augmentation=True,
  )
  return x, opt_state, row[None], stats, g_mean


def synthetic_epochs(
  problem: LocalProblem, keys: tuple, params: PyTree, images: jax.Array
) -> PyTree:
  """``R_l`` epochs of SGD of the model on the synthetic set (batch ``model_batch_size``, DSA).

  Epoch ``e`` uses the keys ``fold_in(fold_in(keys, batch_loop), e)``. With
  ``problem.model_optimizer`` set, its steps at ``eta_m`` replace SGD's; its state starts
  afresh at each call (one while-loop iteration's model step) and carries over its ``R_l``
  epochs.
  """
  c = problem.config
  weights = problem.synthetic.mask.astype(jnp.float32)
  if problem.model_optimizer is not None:
    optimizer = optim.with_rate(problem.model_optimizer, problem.learning_rate)

    def optax_epoch(e, carry):
      k, f = _fold(_fold(keys, c.batch_loop), e)
      w, opt_state = carry
      w, opt_state, _ = train_epoch(
        k,
        problem.apply_fn,
        w,
        opt_state,
        images,
        problem.synthetic.y,
        weights,
        optimizer=optimizer,
        batch_size=c.model_batch_size,
        dsa_strategy=c.dsa_strategy,
        family_key=f,
      )
      return w, opt_state

    return jax.lax.fori_loop(0, c.inner_loop, optax_epoch, (params, optimizer.init(params)))[0]

  def epoch(e, w):
    k, f = _fold(_fold(keys, c.batch_loop), e)
    return sgd_epoch(
      k,
      problem.apply_fn,
      w,
      images,
      problem.synthetic.y,
      weights,
      problem.learning_rate,
      batch_size=c.model_batch_size,
      dsa_strategy=c.dsa_strategy,
      family_key=f,
    )[0]

  return jax.lax.fori_loop(0, c.inner_loop, epoch, params)


def synthetic_model_step(
  problem: LocalProblem, keys: tuple, iteration, params: PyTree, images: jax.Array, gradient
) -> PyTree:
  """The paper's model step: :func:`synthetic_epochs`, except after the last permitted
  while-loop iteration. ``iteration`` (shared by clients side by side) decides in a
  ``lax.cond``: a real conditional under ``vmap``, not a select of both."""
  del gradient
  return jax.lax.cond(
    iteration < problem.config.max_outer - 1,
    lambda w: synthetic_epochs(problem, keys, w, images),
    lambda w: w,
    params,
  )


def noisy_real_step(
  problem: LocalProblem, keys: tuple, iteration, params: PyTree, images: jax.Array, gradient: PyTree
) -> PyTree:
  """``model_steps='noisy_real'``: ``w <- w - eta_m g`` along the iteration's mean noisy real
  gradient (a DP-SGD step on released values), after every iteration, the last included.
  With ``problem.model_optimizer`` set, one step of it at ``eta_m`` instead, from a fresh
  state (a stateless direction such as weight decay changes the step; momentum has nothing
  to accumulate in one step)."""
  del keys, iteration, images
  if problem.model_optimizer is not None:
    optimizer = optim.with_rate(problem.model_optimizer, problem.learning_rate)
    updates, _ = optimizer.update(gradient, optimizer.init(params), params)
    return optax.apply_updates(params, updates)
  return jax.tree.map(lambda p, g: p - problem.learning_rate * g, params, gradient)


class Recipe(NamedTuple):
  """What one while-loop iteration is made of, chosen once from a :class:`ClientConfig`.

  Attributes:
    targets: the matching targets and image updates, :func:`per_batch_targets`
      (the paper) or :func:`averaged_target` (``average_targets``).
    model_step: how the model moves after them: :func:`synthetic_model_step`
      (the paper, ``R_l >= 1``), :func:`noisy_real_step`
      (``model_steps='noisy_real'``) or ``None`` (``R_l = 0``: it stays at ``w_g``).
    sends_delta: whether the client has a model delta ``w_end - w_g`` to send
      (``noisy_real``; the server uses it with ``server.start='fedavg_delta'``).

  The real batches' augmentation (``real_dsa_strategy``) is read by
  :func:`noisy_real_target`.
  """

  targets: Callable[..., tuple]
  model_step: Callable[..., PyTree] | None
  sends_delta: bool


def recipe(config: ClientConfig) -> Recipe:
  """The pieces ``config``'s switches choose (see :class:`Recipe`)."""
  if config.model_steps == "noisy_real":
    step = noisy_real_step
  elif config.inner_loop > 0:
    step = synthetic_model_step
  else:
    step = None
  return Recipe(
    averaged_target if config.average_targets else per_batch_targets,
    step,
    config.model_steps == "noisy_real",
  )


class TrajectoryLog(NamedTuple):
  """What one trajectory reports: ``matching_loss`` ``(max_outer, targets, R_b)`` (0 for
  iterations that did not run), ``iterations`` run, the final ``distance`` ``||w - w_g||``
  and the final model ``params``."""

  matching_loss: jax.Array
  iterations: jax.Array
  distance: jax.Array
  params: PyTree


class _Loop(NamedTuple):
  o: jax.Array  # the loop counter (shared by clients side by side)
  runs: jax.Array  # iterations this client ran
  active: jax.Array  # this client is still inside its radius
  w: PyTree
  dist: jax.Array
  images: jax.Array
  opt_state: optax.OptState
  loss_log: jax.Array
  stats: AccessStats
  any_active: jax.Array  # some client of the axis is still running


def trajectory(
  iteration,
  keys: tuple,
  params: PyTree,
  images: jax.Array,
  opt_state,
  stats: AccessStats,
  *,
  config: ClientConfig,
  moves_model: bool,
  client_axis: str | None = None,
):
  """One trajectory from ``params``: while-loop iterations until the model leaves the radius.

  ``iteration(keys_o, o, w, images, opt_state, stats) -> (w, images, opt_state,
  losses, stats)`` runs iteration ``o`` with the keys ``fold_in(keys, o)``;
  the loop runs at most ``max_outer`` iterations and stops after the first that
  leaves ``||w - params|| < r`` (the distance is measured only when
  ``moves_model``).

  One formulation for a client alone and for clients side by side: each client
  carries whether it is still ``active``; the loop runs while any client of
  ``client_axis`` is (``psum``), and a client that has stopped keeps its state
  through ``jnp.where`` masks. With ``client_axis=None`` the client is alone:
  the loop runs while it is active, so nothing is masked (the numbers of
  clients side by side equal those alone). The counter ``o`` is shared, so a
  ``lax.cond`` on it inside ``iteration`` stays a real conditional under ``vmap``.

  Returns:
    ``(images, opt_state, stats, TrajectoryLog)``.
  """
  c = config
  alone = client_axis is None

  def any_client(flag):
    return flag if alone else jax.lax.psum(flag.astype(jnp.int32), client_axis) > 0

  def keep(active, new, old):
    if alone:  # inside the loop a client alone is always active
      return new
    return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)

  def cond(s):
    return jnp.logical_and(s.o < c.max_outer, s.any_active)

  def body(s):
    new = iteration(_fold(keys, s.o), s.o, s.w, s.images, s.opt_state, s.stats)
    new_w, new_images, new_opt, losses, new_stats = new
    w, images, opt_state, stats = keep(
      s.active, (new_w, new_images, new_opt, new_stats), (s.w, s.images, s.opt_state, s.stats)
    )
    loss_log = s.loss_log.at[s.o].set(keep(s.active, losses, jnp.zeros_like(losses)))
    dist = s.dist
    if moves_model:
      dist = keep(s.active, tree_distance(w, params), s.dist)
    active = jnp.logical_and(s.active, dist < c.radius)
    return _Loop(
      s.o + 1,
      s.runs + s.active.astype(jnp.int32),
      active,
      w,
      dist,
      images,
      opt_state,
      loss_log,
      stats,
      any_client(active),
    )

  loss_log = jnp.zeros((c.max_outer, c.targets_per_iteration, c.boost_loop), jnp.float32)
  init = _Loop(
    jnp.int32(0),
    jnp.int32(0),
    jnp.bool_(True),
    params,
    jnp.float32(0.0),
    images,
    opt_state,
    loss_log,
    stats,
    jnp.bool_(True),
  )
  s = jax.lax.while_loop(cond, body, init)
  return s.images, s.opt_state, s.stats, TrajectoryLog(s.loss_log, s.runs, s.dist, s.w)


def check_inputs(synthetic: SyntheticSet, client_data: ClientData, config: ClientConfig) -> None:
  """Refuses inputs whose static shapes or dtypes :func:`local_approx` cannot use.

  Each set's records (:func:`~fedlap_jax.client_data.check_records`), the synthetic images
  in the client's image shape, and a batch no larger than the client's record slots
  (:func:`~fedlap_jax.client_data.check_batch_size`: ``q = B / N_k`` is a probability).
  Shapes and dtypes only: it runs at trace time, under ``jit`` and ``vmap`` alike.

  Raises:
    ConfigError: naming the leaf (``synthetic.x.shape``, ``client_data.y.dtype``, ...) or
      ``batch_size``, with the value and what is allowed.
  """
  check_pair(synthetic, client_data)
  check_batch_size("batch_size", config.batch_size, client_data)


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
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
) -> tuple[SyntheticSet, jax.Array, LocalApproxMetrics]:
  """Local approximation on one client: Algorithm 1 (``config.dp is None``) or 3.

  Pure and jit-compatible (``config`` static); NumPy arguments are copied to
  the device first (:func:`~fedlap_jax.client_data.on_device`). Vmap it over a stacked client
  axis of ``key``, ``synthetic`` and ``client_data`` to run many clients side
  by side, with ``axis_name=client_axis`` and ``family_key`` not mapped
  (:func:`fedlap_jax.dispatch.run_clients` does this for ``vmap``).

  Composed of the module's pieces: :func:`recipe` names the targets and the
  model step ``config`` chooses; ``R_i`` :func:`trajectory` s (``lax.scan``)
  run them; then the radius (:func:`fedlap_jax.methods.fedlap.radius.calibrate_radius` or ``r``).

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
    client_axis: ``None``: one client at a time (the while loop stops when it leaves its
      radius). A ``vmap`` axis name: the clients mapped over it run side by side (module
      docstring: a shared loop counter, a client's stop a mask); the same numbers for every
      client, up to float rounding.
    image_optimizer: the ``optax.GradientTransformation`` of the synthetic
      images (its state lives across the ``R_i`` trajectories); ``None``: the
      paper's :func:`default_image_optimizer`. A jit static where the caller jits (it
      hashes by identity: build it once).
    model_optimizer: the direction of the model's steps along a trajectory (the ``R_l``
      synthetic epochs, or ``noisy_real``'s step), an ``optax.GradientTransformation``
      before the rate ``eta_m`` (:mod:`fedlap_jax.optim`); ``None``: ``config.model_optimizer``
      (plain SGD by default, written out). Its state
      starts afresh at each while-loop iteration's model step (carried over that step's
      ``R_l`` epochs; ``noisy_real``: one update from a fresh state, so momentum has
      nothing to accumulate). The radius calibration
      (:func:`fedlap_jax.methods.fedlap.radius.calibrate_radius`) keeps plain SGD.

  Returns:
    ``(synthetic, r_k, metrics)``: the optimised synthetic set (labels and mask
    unchanged), the client's radius (calibrated on real data if
    ``config.calibrate_radius``, else ``config.radius``) and
    :class:`LocalApproxMetrics`.

  Labels of both sets must lie in ``[0, K)``, ``K`` the model's logits: refused on concrete
  arrays, every float output of the client NaN inside ``jit`` or ``vmap``
  (:func:`~fedlap_jax.client_data.check_labels`); so are images holding NaN or infinite values
  (:func:`~fedlap_jax.client_data.check_finite`).

  Raises:
    ConfigError: inputs :func:`check_inputs` refuses (shapes, dtypes, a batch larger than
      the client's record slots), concrete labels outside ``[0, K)``, concrete images
      holding NaN or infinite values, or under DP a ``dp.delta`` of at least ``1 / N_k`` for
      the ``N_k`` valid records of a concrete ``client_data.mask``.
  """
  c = config
  key, params, synthetic, client_data, family_key = on_device(
    key, params, synthetic, client_data, family_key
  )
  check_inputs(synthetic, client_data, c)
  if c.dp is not None and not isinstance(client_data.mask, jax.core.Tracer):
    accounting.check_record_delta(c.dp.delta, int(np.sum(client_data.mask)), "dp.delta")
  real_gradient_query(c).check_model(apply_fn, params, synthetic.x)
  ok = check_labels(
    num_classes_of(apply_fn, params, jnp.shape(synthetic.x)[1:], jnp.result_type(synthetic.x)),
    ("client_data.y", client_data.y, client_data.mask),
    ("synthetic.y", synthetic.y, synthetic.mask),
  ) & check_finite(("client_data.x", client_data.x), ("synthetic.x", synthetic.x))
  optimizer = default_image_optimizer(c) if image_optimizer is None else image_optimizer
  if model_optimizer is None:  # the config's (plain SGD: the step written out, None)
    model_optimizer = optim.written_out_or(c.model_optimizer)
  if c.dsa_family_draw == "per_client":
    family_key = None
  elif family_key is None:
    family_key = shared_family_key(key)
  problem = LocalProblem(
    apply_fn, params, synthetic, client_data, c, learning_rate, optimizer, model_optimizer
  )
  pieces = recipe(c)

  def iteration(keys_o, o, w, images, opt_state, stats):
    images, opt_state, losses, stats, g = pieces.targets(
      problem, keys_o, w, images, opt_state, stats
    )
    if pieces.model_step is not None:
      w = pieces.model_step(problem, keys_o, o, w, images, g)
    return w, images, opt_state, losses, stats

  def one_trajectory(carry, keys_i):
    images, opt_state, stats, log = trajectory(
      iteration,
      keys_i,
      params,
      *carry,
      config=c,
      moves_model=pieces.model_step is not None,
      client_axis=client_axis,
    )
    delta = jax.tree.map(jnp.subtract, log.params, params) if pieces.sends_delta else None
    return (images, opt_state, stats), (log._replace(params=None), delta)

  k_traj, k_cal = jax.random.split(key)
  f_traj, f_cal = (None, None) if family_key is None else jax.random.split(family_key)
  (x_syn, _, stats), (log, deltas) = jax.lax.scan(
    one_trajectory,
    (synthetic.x, optimizer.init(synthetic.x), AccessStats.zeros()),
    _split((k_traj, f_traj), c.iterations),
  )
  synthetic = synthetic._replace(x=x_syn)

  if c.calibrate_radius:
    r_k, _ = calibrate_radius(
      k_cal,
      apply_fn,
      params,
      synthetic,
      client_data,
      learning_rate=learning_rate,
      max_radius=c.radius,
      epochs=c.calibration_epochs,
      batch_size=c.model_batch_size,
      dsa_strategy=c.dsa_strategy,
      eval_size=c.calibration_eval_size,
      family_key=f_cal,
    )
  else:
    r_k = jnp.asarray(c.radius, jnp.float32)

  metrics = LocalApproxMetrics(
    matching_loss=log.matching_loss,
    outer_iterations=log.iterations,
    real_accesses=stats.accesses,
    poisson_extra_chunks=stats.extra_chunks,
    mean_batch_size=stats.sampled / jnp.maximum(stats.accesses, 1),
    trajectory_distance=log.distance,
    clip_fraction=stats.clipped / jnp.maximum(stats.sampled, 1),
    model_delta=(None if deltas is None else jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)),
  )
  return poison_unless(ok, (synthetic, r_k, metrics))


class ClientUpdate(NamedTuple):
  """What one FedLAP client sends the server after a round (:func:`client_step`).

  Stacked over clients (every leaf with a leading ``(K,)`` axis) it is what
  :func:`fedlap_jax.methods.fedlap.server.server_step_with_state` takes.

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
  image_optimizer: optax.GradientTransformation | None = None,
  model_optimizer: optax.GradientTransformation | None = None,
) -> tuple[ClientUpdate, LocalApproxMetrics]:
  """One FedLAP client's round: its synthetic set's start, :func:`local_approx`, the upload.

  Pure and jit-compatible (``config`` static; NumPy arguments are copied to the
  device first); every front end runs a client through it (FedLAP's method,
  :mod:`fedlap_jax.methods.fedlap`, in the round for all clients at once, the Flower
  ``ClientApp`` for one).

  Args:
    key: PRNG key of this client and round.
    apply_fn, params: the model and the received global model ``w_g``.
    synthetic: the client's synthetic set from the previous round (or the
      initial one); under ``synthetic_init='real'`` only its labels and mask
      are used: the images are drawn again from real records with ``init_key``.
    client_data: the client's real records, padded with a mask.
    config: :class:`~fedlap_jax.methods.fedlap.config.FedLAPConfig`.
    learning_rate: the clients' ``eta_m`` of the round (may be traced).
    family_key: the round's shared DSA family key (:func:`shared_family_key`
      of the round's client key); ``None``: derived from ``key``.
    init_key: the key of the real images under ``synthetic_init='real'``
      (required then); ignored under ``'noise'``.
    client_axis, image_optimizer, model_optimizer: see :func:`local_approx` (``None``:
      the defaults of :mod:`fedlap_jax.optim`).

  Returns:
    ``(ClientUpdate, LocalApproxMetrics)``; the metrics' ``model_delta`` is
    ``None`` (the delta travels in the update, when the server uses it).

  Raises:
    ValueError: ``synthetic_init='real'`` without ``init_key``.
  """
  key, params, synthetic, client_data, family_key, init_key = on_device(
    key, params, synthetic, client_data, family_key, init_key
  )
  if config.synthetic_init == "real":
    if init_key is None:
      raise ValueError(
        "client_step: synthetic_init='real' needs init_key (the round's key "
        "of the real images); allowed: a PRNG key"
      )
    synthetic = synthetic._replace(
      x=real_images(init_key, client_data, synthetic.y, synthetic.mask, config.client.ipc)
    )
  synthetic, radius, metrics = local_approx(
    key,
    apply_fn,
    params,
    synthetic,
    client_data,
    config.client,
    learning_rate=learning_rate,
    family_key=family_key,
    client_axis=client_axis,
    image_optimizer=image_optimizer,
    model_optimizer=model_optimizer,
  )
  delta = metrics.model_delta if config.server.start == "fedavg_delta" else None
  return ClientUpdate(synthetic, radius, delta), metrics._replace(model_delta=None)
