"""The library's frozen dataclasses as the schema of the experiment configs' sections.

:func:`section` writes a dataclass's fields, with their defaults, as a
``ml_collections.ConfigDict`` (an optional field ``T | None`` whose default is
``None`` becomes ``config_dict.placeholder(T)``, so a command-line override
gets the type ``T``); :func:`build` turns such a section back into the
dataclass. So a field of :class:`fedlap_jax.methods.fedlap.config.ClientConfig` is written
once, in the dataclass, and ``config.client`` follows it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Any, Callable, Iterable

import ml_collections
from ml_collections import config_dict

from fedlap_jax import optim
from fedlap_jax.checks import ConfigError, is_int, is_real

# What a value of each field type may be, in words, and the test it must pass.
_KINDS = {
  int: ("an integer", is_int),
  float: ("a finite number", is_real),
  bool: ("True or False", lambda v: isinstance(v, bool)),
  str: ("a string", lambda v: isinstance(v, str)),
}


@functools.cache
def _types(cls) -> dict[str, tuple[type, bool]]:
  """``{field: (base type, optional)}`` of ``cls``'s fields (``T | None`` -> ``(T, True)``)."""
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    hint = hints[f.name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    base = [a for a in args if a is not type(None)]
    out[f.name] = (base[0], True) if args and len(base) == 1 else (hint, False)
  return out


def fields(cls, exclude: Iterable[str] = ()) -> tuple[str, ...]:
  """The names of ``cls``'s fields less ``exclude``, in declaration order."""
  skip = set(exclude)
  return tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip)


def section(cls, *, exclude: Iterable[str] = (), **values: Any) -> ml_collections.ConfigDict:
  """A ConfigDict with one entry per field of dataclass ``cls`` (less ``exclude``).

  Each entry is ``values[name]`` if given, else the field's default; a field
  without a default must be in ``values``. A ``None`` of an optional field
  ``T | None``, or a ``None`` given in ``values``, is ``config_dict.placeholder(T)``.

  Raises:
    TypeError: a name of ``values`` is not a field, or a field without a
      default has no value.
  """
  names = fields(cls, exclude)
  unknown = set(values) - set(names)
  if unknown:
    raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}; fields: {names}")
  kinds = _types(cls)
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(cls):
    if f.name not in names:
      continue
    if f.name in values:
      value = values[f.name]
    elif f.default is not dataclasses.MISSING:
      value = f.default
    elif f.default_factory is not dataclasses.MISSING:
      value = f.default_factory()
    else:
      raise TypeError(f"{cls.__name__}.{f.name} has no default: pass {f.name}=VALUE")
    base, optional = kinds[f.name]
    # None: a typed placeholder where the field may be None or the caller sets None (a
    # value the experiment fills in before building the dataclass, e.g. published loops).
    given_none = value is None and (optional or f.name in values)
    out[f.name] = config_dict.placeholder(base) if given_none else value
  return out


def arguments(fn: Callable[..., Any], *names: str) -> ml_collections.ConfigDict:
  """A ConfigDict of the keyword arguments ``names`` of ``fn`` with their defaults.

  For settings a library function takes as arguments rather than as a
  dataclass (e.g. the baselines' ``local_epochs`` and ``prox_mu`` of
  :func:`fedlap_jax.baselines.baseline_config`): the default is written once,
  in the function's signature.

  Raises:
    TypeError: a name is not a parameter of ``fn`` or has no default.
  """
  params = inspect.signature(fn).parameters
  out = ml_collections.ConfigDict()
  for name in names:
    p = params.get(name)
    if p is None or p.default is inspect.Parameter.empty:
      raise TypeError(f"{fn.__qualname__} has no argument {name!r} with a default")
    out[name] = p.default
  return out


def check_field(cls, name: str, value: Any, path: str) -> None:
  """Refuses ``value`` for field ``name`` of ``cls`` unless it has the field's type.

  Raises:
    ConfigError: ``path`` (the field as written on the command line), the
      value and the type allowed.
  """
  base, optional = _types(cls)[name]
  if value is None and optional:
    return
  if base in _KINDS:
    words, test = _KINDS[base]
    if not test(value):
      raise ConfigError(path, value, words + (" or None" if optional else ""))


def build(
  cls, cfg: ml_collections.ConfigDict, path: str, *, ignore: Iterable[str] = (), **given: Any
):
  """The dataclass ``cls`` from section ``cfg`` (written at ``path``) and the fields ``given``.

  Every entry of ``cfg`` must be a field of ``cls`` (or be named in
  ``ignore``: entries the experiment reads, not the library) with the field's
  type; a field missing from ``cfg`` keeps its default. ``cls`` validates the
  values itself (its errors are the caller's to rename).

  Raises:
    ConfigError: an entry that is not a field, or a value of the wrong type,
      naming ``path.entry``, the value and what is allowed.
  """
  names = set(fields(cls, exclude=given))
  skip = set(ignore)
  kwargs = {}
  for key in cfg.keys():
    if key in skip:
      continue
    if key not in names:
      raise ConfigError(
        f"{path}.{key}",
        cfg[key],
        f"a field of {cls.__name__}: one of {tuple(sorted(names | skip))}",
      )
    check_field(cls, key, cfg[key], f"{path}.{key}")
    kwargs[key] = cfg[key]
  return cls(**kwargs, **given)


def write_fedlap(config: ml_collections.ConfigDict, fedlap) -> ml_collections.ConfigDict:
  """Writes a :class:`fedlap_jax.methods.fedlap.config.FedLAPConfig` into experiment config
  ``config``.

  ``rounds``, ``learning_rate``, ``synthetic_init``, ``lr_schedule``, every
  field of ``config.client`` and ``config.server`` (their optimisers as the sections
  ``client.model_optimizer`` and ``server.optimizer``), and ``config.dp``
  (``enabled`` and, with DP, the :class:`~fedlap_jax.dp_config.DPConfig`'s
  fields) take ``fedlap``'s values; the rest of ``config`` is kept. Returns
  ``config`` (changed in place).
  """
  for name in ("rounds", "learning_rate", "synthetic_init", "lr_schedule"):
    config[name] = getattr(fedlap, name)
  for name in fields(type(fedlap.client), exclude=("dp", "model_optimizer", "image_optimizer")):
    config.client[name] = getattr(fedlap.client, name)
  for name in fields(type(fedlap.server), exclude=("optimizer",)):
    config.server[name] = getattr(fedlap.server, name)
  # The optimiser specs as their sections (None: plain SGD there, the SGD's numbers above).
  for section, spec in (
    (config.client.model_optimizer, fedlap.client.model_optimizer),
    (config.client.image_optimizer, fedlap.client.image_optimizer or optim.SGD),
    (config.server.optimizer, fedlap.server.optimizer or optim.SGD),
  ):
    section.update(dataclasses.asdict(spec))
  config.dp.enabled = fedlap.dp is not None
  if fedlap.dp is not None:
    for name in fields(type(fedlap.dp)):
      config.dp[name] = getattr(fedlap.dp, name)
  return config
