"""The registry: every method of the project as a :class:`fedlap_jax.method.Method`.

:data:`REGISTRY` maps a method's name (the experiment config's ``method``) to its value. A
method registers by one line in ``_FAMILIES`` (its module's ``METHODS``); the front ends look
methods up here. A method of one's own is a :class:`~fedlap_jax.method.Method` passed to
:func:`fedlap_jax.rounds.algorithm` directly, or added with :meth:`Registry.with_methods`.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

from fedlap_jax.checks import ConfigError
from fedlap_jax.method import Method
from fedlap_jax.methods import condensation, dp_scaffold, fedavg, feddm, fedlap

_FAMILIES = (fedlap, fedavg, feddm, condensation, dp_scaffold)  # the order of reports, then FedAdam


class Registry(Mapping[str, Method]):
  """Methods by name (read-only)."""

  def __init__(self, methods: Iterable[Method]):
    self._methods: dict[str, Method] = {}
    for m in methods:
      if m.name in self._methods:
        raise ValueError(f"method {m.name!r} is registered twice")
      self._methods[m.name] = m

  def __getitem__(self, name: str) -> Method:
    return self._methods[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._methods)

  def __len__(self) -> int:
    return len(self._methods)

  def method(self, name: str) -> Method:
    """The method ``name``.

    Raises:
      ConfigError: no method of that name.
    """
    if name not in self._methods:
      raise ConfigError("method", name, f"one of {tuple(self._methods)}")
    return self._methods[name]

  def with_methods(self, *methods: Method) -> "Registry":
    """This registry and ``methods`` (a name already registered is refused)."""
    return Registry((*self._methods.values(), *methods))


REGISTRY = Registry((*(m for family in _FAMILIES for m in family.METHODS), fedavg.FEDADAM))
