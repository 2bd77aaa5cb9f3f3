"""The check vocabulary of every configuration: :class:`ConfigError` and small predicates.

A bad value is refused with a :class:`ConfigError` (a ``ValueError``) that
carries the field's name, the value and what is allowed, as attributes and in
its message ``"{field}={value!r} is invalid; allowed: {allowed}"``. Callers
that know the field under another name (the experiment driver's
``client.ipc`` for the core's ``ipc``) read :attr:`ConfigError.field` instead
of parsing the message. Nothing is clamped silently.

Two kinds of helpers: predicates (:func:`is_int`, :func:`is_real`) and checks
that raise (:func:`require`, :func:`positive_int`, ...); the checks named for a
kind of number (:func:`integer`, :func:`finite`, :func:`probability`) also
return the value as a Python ``int`` / ``float``. This module imports neither
JAX nor NumPy, nor any module of the library (a DSA strategy is checked by
:func:`fedlap_jax.dsa.check_strategy`), so host-only modules such as
:mod:`fedlap_jax.accounting` share the vocabulary.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class ConfigError(ValueError):
  """A configuration value outside what is allowed.

  Attributes:
    field: the field's name as the raiser knows it (dotted for nested
      configs, e.g. ``"dp.l2_clip_norm"``).
    value: the value refused.
    allowed: what would be accepted, in words.
  """

  def __init__(self, field: str, value: Any, allowed: str, *, message: str | None = None):
    """``message`` replaces the standard text where a check needs to say more."""
    if message is None:
      message = f"{field}={value!r} is invalid; allowed: {allowed}"
    super().__init__(message)
    self.field = field
    self.value = value
    self.allowed = allowed

  def __reduce__(self):
    return _rebuild, (type(self), self.field, self.value, self.allowed, str(self))


def _rebuild(cls, field, value, allowed, message):
  return cls(field, value, allowed, message=message)


def require(cond: bool, field: str, value: Any, allowed: str) -> None:
  """Raises :class:`ConfigError` ``(field, value, allowed)`` unless ``cond``."""
  if not cond:
    raise ConfigError(field, value, allowed)


def is_int(value: Any) -> bool:
  """A Python or NumPy integer, not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  """A finite Python or NumPy real number, not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(field: str, value: Any) -> None:
  require(is_int(value) and value >= 1, field, value, "an integer >= 1")


def nonneg_int(field: str, value: Any) -> None:
  require(is_int(value) and value >= 0, field, value, "an integer >= 0")


def positive_float(field: str, value: Any) -> None:
  require(is_real(value) and value > 0, field, value, "a finite number > 0")


def nonneg_float(field: str, value: Any) -> None:
  require(is_real(value) and value >= 0, field, value, "a finite number >= 0")


def one_of(field: str, value: Any, options: tuple) -> None:
  require(value in options, field, value, f"one of {options}")


def integer(field: str, value: Any, *, minimum: int) -> int:
  """``value`` as an ``int``; refused unless it is an integer (not a bool) >= ``minimum``."""
  require(is_int(value) and value >= minimum, field, value, f"an integer >= {minimum}")
  return int(value)


def finite(field: str, value: Any, *, above: float | None = None) -> float:
  """``value`` as a ``float``; refused unless finite (and ``> above`` when given)."""
  allowed = "a finite number" + ("" if above is None else f" > {above:g}")
  require(is_real(value) and (above is None or value > above), field, value, allowed)
  return float(value)


def probability(field: str, value: Any, *, one_allowed: bool = False) -> float:
  """``value`` as a ``float`` in ``(0, 1)``, or ``(0, 1]`` with ``one_allowed``."""
  ok = is_real(value) and 0 < value and (value <= 1 if one_allowed else value < 1)
  require(
    ok,
    field,
    value,
    "a probability in (0, 1]" if one_allowed else "a probability in the open interval (0, 1)",
  )
  return float(value)
