"""Optimisers as optax values: each role's default, derived from the config's numbers.

Every optimiser of the library is an ``optax.GradientTransformation`` passed in by the caller
(``None``: the role's default below). The numeric config fields *are* the SGD spec of the
defaults; nothing else names them:

* FedLAP's synthetic images, and FedDM's, DSC's and PSG's: :func:`image_sgd` of
  ``image_lr`` and ``image_momentum`` (``optax.sgd(tau, momentum)``); another as a config
  value is the ``image_optimizer`` spec of ``ClientConfig``, ``FedDMConfig`` or
  ``CondensationConfig``, stepped at ``image_lr`` (:func:`fedlap_jax.synthetic.image_optimizer`).
* FedLAP's client model (the synthetic epochs, the ``noisy_real`` steps) and the FedAvg
  family's client: plain SGD at ``eta_m`` (:func:`sgd`); as config values
  ``ClientConfig.model_optimizer`` and ``BaselineConfig.client_optimizer``.
* The servers that train on synthetic sets (FedLAP, FedDM, DSC, PSG): :func:`server_direction`
  of ``server.momentum`` and ``server.weight_decay`` at the server's rate; another optimiser
  as a config value is ``ServerConfig.optimizer``
  (:meth:`fedlap_jax.methods.fedlap.config.ServerConfig.direction`).
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

import dataclasses
import functools

import optax

from fedlap_jax.checks import is_real, one_of, require


def check_other_than_sgd(spec, field: str, sgd_fields, why: str) -> None:
  """Refuses an optimiser ``spec`` for ``field`` beside the numeric SGD fields it replaces.

  ``None`` (the SGD of ``sgd_fields``) passes. A spec must be a
  :class:`fedlap_jax.optim.Optimizer` other than heavy-ball SGD (that SGD is ``sgd_fields``:
  one source of each number), and every one of ``sgd_fields`` (``(name, value)``) must be 0
  beside it (the spec is the whole direction).

  Raises:
    ConfigError: naming ``field`` or the SGD field, the value and what is allowed.
  """
  if spec is None:
    return
  require(isinstance(spec, Optimizer), field, spec, "None or a fedlap_jax.optim.Optimizer")
  require(
    spec.name != "sgd" or spec.nesterov,
    field,
    spec,
    f"None for heavy-ball SGD ({why}), or another optimiser (name='adam', 'yogi', 'adagrad', "
    "or 'sgd' with nesterov=True)",
  )
  for name, value in sgd_fields:
    require(
      value == 0,
      name,
      value,
      f"0.0 when {field} is set (name={spec.name!r}: the spec is the whole direction; its own "
      "weight_decay, or momentum for Nesterov SGD)",
    )


def sgd(momentum: float = 0.0, weight_decay: float = 0.0) -> optax.GradientTransformation:
  """PyTorch's ``SGD(momentum, weight_decay)`` before the rate: ``g + weight_decay * w``, then
  heavy-ball ``t <- g + momentum * t`` (no dampening); ``optax.identity()`` with both 0.

  Memoised: equal values return the same object (one jit compilation), however passed
  (``sgd()``, ``sgd(0.0)``, ``sgd(momentum=0, weight_decay=0.0)``).
  """
  return _sgd(momentum, weight_decay)


@functools.lru_cache(maxsize=None)
def _sgd(momentum: float, weight_decay: float) -> optax.GradientTransformation:
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
  (:func:`fedlap_jax.methods.fedlap.server.global_update`): :func:`sgd` of ``ServerConfig.momentum``
  and ``weight_decay`` (0 and 0 for FedLAP: plain SGD)."""
  return sgd(momentum, weight_decay)


# -- optimisers as config values -----------------------------------------------------------

OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")
"""The names an :class:`Optimizer` spec may have."""

# Each name's hyper-parameters beyond ``weight_decay`` (which every name takes) and their
# defaults: optax's (``scale_by_adam``, ``scale_by_yogi``, ``scale_by_rss``).
_DEFAULTS = {
  "sgd": {"momentum": 0.0, "nesterov": False},
  "adam": {"b1": 0.9, "b2": 0.999, "eps": 1e-8},
  "yogi": {"b1": 0.9, "b2": 0.999, "eps": 1e-3, "initial_accumulator": 1e-6},
  "adagrad": {"initial_accumulator": 0.1, "eps": 1e-7},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Optimizer:
  """An optimiser's direction as a config value: hashable (a jit static), JSON-describable
  (:func:`dataclasses.asdict`: the fields are numbers, a bool and a name) and validated.

  :meth:`direction` is the optax transformation before the rate (the roles apply their own
  rate, :func:`with_rate`); equal specs return the same object, so they share one compilation.

  Attributes:
    name: ``sgd`` (PyTorch's SGD: heavy-ball ``momentum`` without dampening, ``nesterov``),
      ``adam`` (``b1``, ``b2``, ``eps``; bias-corrected, ``optax.scale_by_adam``), ``yogi``
      (``b1``, ``b2``, ``eps``, ``initial_accumulator``; ``optax.scale_by_yogi``; FedOpt's
      ``tau`` is ``eps``) or ``adagrad`` (``initial_accumulator``, ``eps``;
      ``optax.scale_by_rss``).
    weight_decay: ``g + weight_decay * w`` before the direction (PyTorch's coupled L2), any
      name; ``>= 0``.
    momentum: ``sgd``'s, ``>= 0``; nesterov: ``sgd``'s, needs ``momentum > 0``.
    b1, b2: the moments' decay rates, in ``[0, 1)``; eps: added to the denominator, ``> 0``;
    initial_accumulator: the second moment's start, ``>= 0``. ``None`` (their default): optax's
      default of ``name`` (adam: 0.9, 0.999, 1e-8; yogi: 0.9, 0.999, 1e-3, 1e-6; adagrad: 0.1,
      1e-7), filled in on construction, so equal settings are equal specs.

  A hyper-parameter ``name`` does not use must stay at its default (``ConfigError`` naming it).

  Raises:
    ConfigError: naming the field, the value and what is allowed.
  """

  name: str = "sgd"
  weight_decay: float = 0.0
  momentum: float = 0.0
  nesterov: bool = False
  b1: float | None = None
  b2: float | None = None
  eps: float | None = None
  initial_accumulator: float | None = None

  def __post_init__(self):
    one_of("name", self.name, OPTIMIZERS)
    uses = _DEFAULTS[self.name]
    for f in ("momentum", "nesterov", "b1", "b2", "eps", "initial_accumulator"):
      default = {"momentum": 0.0, "nesterov": False}.get(f)
      value = getattr(self, f)
      if f not in uses:
        require(
          value is default if default is None or isinstance(default, bool) else value == default,
          f,
          value,
          f"{default!r}: name={self.name!r} does not use it (it uses {('weight_decay', *uses)})",
        )
      elif value is None:
        object.__setattr__(self, f, uses[f])
    require(isinstance(self.nesterov, bool), "nesterov", self.nesterov, "True or False")
    for f, low in (("weight_decay", 0.0), ("momentum", 0.0), ("initial_accumulator", 0.0)):
      v = getattr(self, f)
      if v is not None:
        require(is_real(v) and v >= low, f, v, f"a finite number >= {low:g}")
    for f in ("b1", "b2"):
      v = getattr(self, f)
      if v is not None:
        require(is_real(v) and 0 <= v < 1, f, v, "a number in [0, 1)")
    if self.eps is not None:
      require(is_real(self.eps) and self.eps > 0, "eps", self.eps, "a finite number > 0")
    require(
      not self.nesterov or self.momentum > 0,
      "nesterov",
      self.nesterov,
      "False with momentum=0 (Nesterov needs momentum > 0)",
    )

  def direction(self) -> optax.GradientTransformation:
    """The transformation before the rate; memoised by value (equal specs: one object).

    ``sgd``: :func:`sgd` (``optax.identity()`` for the default spec; with ``nesterov``
    ``optax.trace(momentum, nesterov=True)``); ``adam``: ``scale_by_adam(b1, b2, eps)``;
    ``yogi``: ``scale_by_yogi(b1, b2, eps, initial_accumulator_value=initial_accumulator)``;
    ``adagrad``: ``scale_by_rss(initial_accumulator, eps)``; each after
    ``add_decayed_weights(weight_decay)`` when ``weight_decay > 0``.
    """
    return _direction(self)

  def with_rate(self, learning_rate) -> optax.GradientTransformation:
    """:meth:`direction` at ``learning_rate`` (a float or a traced scalar): with
    ``name='adam'`` and its defaults, ``optax.adam(learning_rate)`` operation for operation."""
    return with_rate(self.direction(), learning_rate)


@functools.lru_cache(maxsize=None)
def _direction(spec: Optimizer) -> optax.GradientTransformation:
  if spec.name == "sgd" and not spec.nesterov:
    return sgd(spec.momentum, spec.weight_decay)
  if spec.name == "sgd":
    core = optax.trace(decay=spec.momentum, nesterov=True)
  elif spec.name == "adam":
    core = optax.scale_by_adam(b1=spec.b1, b2=spec.b2, eps=spec.eps)
  elif spec.name == "yogi":
    core = optax.scale_by_yogi(
      b1=spec.b1, b2=spec.b2, eps=spec.eps, initial_accumulator_value=spec.initial_accumulator
    )
  else:
    core = optax.scale_by_rss(initial_accumulator_value=spec.initial_accumulator, eps=spec.eps)
  if spec.weight_decay:
    return optax.chain(optax.add_decayed_weights(spec.weight_decay), core)
  return core


SGD = Optimizer()
"""Plain SGD: the default of every role whose step is written out by hand."""


def written_out_or(spec: Optimizer) -> optax.GradientTransformation | None:
  """``None`` for plain SGD (:data:`SGD`: the role's update written out, as without a spec),
  else ``spec.direction()``: what a role given a config's spec passes as its ``optimizer``.

  Plain SGD through optax gives the same bits (this module's docstring), but it would carry
  an optimiser state (``EmptyState`` s) where the written-out step carries ``()``: ``None``
  keeps the default's program and its checkpoints' state tree as they are.
  """
  return None if spec == SGD else spec.direction()
