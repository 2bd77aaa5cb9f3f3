"""Optimisers as optax values: each role's default, derived from the config's numbers.

Every optimiser of the library is an ``optax.GradientTransformation`` passed in by the caller
(``None``: the role's default below). The numeric config fields *are* the SGD spec of the
defaults; nothing else names them:

* FedLAP's synthetic images, and FedDM's, DSC's and PSG's: :func:`image_sgd` of
  ``image_lr`` and ``image_momentum`` (``optax.sgd(tau, momentum)``).
* FedLAP's client model (the synthetic epochs, the ``noisy_real`` steps) and the FedAvg
  family's client: plain SGD at ``eta_m`` (:func:`sgd`).
* The servers that train on synthetic sets (FedLAP, FedDM, DSC, PSG): :func:`server_direction`
  of ``server.momentum`` and ``server.weight_decay`` at the server's rate.
* The FedAvg family's server: plain SGD at ``server_lr`` on the negated weighted mean delta
  (``x + server_lr * d``).

**Directions and rates.** The images' rate ``tau`` is a constant, so their optimiser is a
whole transformation, rate included (``optax.sgd(tau, ...)``, ``optax.adam(1e-2)``). The model
and server roles step at a rate the round computes (the cosine schedule ``eta_m``, traced, or
``server_lr``), so for them the caller passes a *direction*: the transformation before the
rate (:func:`sgd`, ``optax.scale_by_adam()``, ``optax.chain(optax.clip_by_global_norm(1.0),
optax.scale_by_adam())``), and the library applies :func:`with_rate` (``chain(direction,
scale_by_learning_rate(rate))``) each round. A direction's state does not depend on the rate
(Adam's ``count, mu, nu``), so a server state carries across rounds whose rate changes.
``with_rate(optax.scale_by_adam(), lr)`` is ``optax.adam(lr)`` operation for operation.

**Jit statics.** Optimisers are static arguments of the jitted rounds. An optax
transformation is a NamedTuple of closures: it hashes and compares by the identity of its
functions, so two ``optax.scale_by_adam()`` calls are two compilations. Build one and reuse it
(the seeds of a sweep, a resumed run); :func:`sgd` is memoised, so equal arguments return the
same object.

**Bit-equality with the updates written out.** ``with_rate(sgd(m, wd), lr)`` applies the operations of
``chain(add_decayed_weights(wd), optax.sgd(lr, momentum=m))`` (``g + wd w``, ``g + m t``,
``-lr u``) in the same order. The hand-written plain-SGD updates (the FedAvg client
step ``w - eta g``, its server step ``x + eta_s d``, FedLAP's ``noisy_real`` step) stay the
defaults written out as they are (``optimizer=None``); an explicit :func:`sgd` runs through
optax and gives the same bits (``w + (-eta) g``; negation is exact), which
``tests/unit/test_optim.py`` checks for each role.
"""

from __future__ import annotations

import functools

import optax


@functools.lru_cache(maxsize=None)
def sgd(momentum: float = 0.0, weight_decay: float = 0.0) -> optax.GradientTransformation:
  """PyTorch's ``SGD(momentum, weight_decay)`` before the rate: ``g + weight_decay * w``, then
  heavy-ball ``t <- g + momentum * t`` (no dampening); ``optax.identity()`` with both 0.

  Memoised: equal arguments return the same object (one jit compilation).
  """
  direction = optax.trace(decay=momentum) if momentum else optax.identity()
  if weight_decay:
    return optax.chain(optax.add_decayed_weights(weight_decay), direction)
  return direction


def with_rate(
  direction: optax.GradientTransformation, learning_rate
) -> optax.GradientTransformation:
  """``chain(direction, scale_by_learning_rate(learning_rate))``: a descent step of
  ``learning_rate`` (a float or a traced scalar) along ``direction``."""
  return optax.chain(direction, optax.scale_by_learning_rate(learning_rate))


def image_sgd(image_lr: float, image_momentum: float) -> optax.GradientTransformation:
  """The paper's optimiser of synthetic images: SGD at ``tau`` (``image_lr``) with momentum
  ``image_momentum`` (0.5): ``optax.sgd(image_lr, momentum=image_momentum or None)``."""
  return with_rate(sgd(image_momentum), image_lr)


def server_direction(momentum: float, weight_decay: float) -> optax.GradientTransformation:
  """The default direction of a server that trains on synthetic sets
  (:func:`fedlap_jax.server.global_update`): :func:`sgd` of ``ServerConfig.momentum`` and
  ``weight_decay`` (0 and 0 for FedLAP: plain SGD)."""
  return sgd(momentum, weight_decay)
