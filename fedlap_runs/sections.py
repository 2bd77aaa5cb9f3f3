"""One builder from an experiment config to a method's frozen library config.

A method's library config (:class:`fedlap_jax.methods.fedlap.config.FedLAPConfig`, a baseline's
``BaselineConfig``, ``FedDMConfig``, ``OneShotConfig``) is built from the experiment config as
its :class:`Spec` declares: the fields it reads from sections shared by every method (``B`` is
``client.batch_size`` for every method, the server's weighting is ``server.weighting``, ...),
the values the experiment computes (the DP section, the server's, the data's largest client),
and the library dataclasses written as sections of their own (``client``, ``server``, the
method's own ``feddm`` or ``condense``). :func:`build` reads the declared fields, calls the
method's constructor and renames a core error to the field as written on the command line,
through the same declaration: ``ipc`` -> ``client.ipc`` where the method reads it there, a field
of the method's own section -> ``SECTION.field``. The specs themselves are in
:mod:`fedlap_runs.method_entries`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

from fedlap_jax.checks import ConfigError

from fedlap_runs.configs import schema

# Fields named by the core with their section already (``server.batch_size``): kept as they are.
SECTION_PREFIXES = ("dp.", "server.", "client.")


class Spec(NamedTuple):
  """How one method's library config is built from an experiment config.

  Attributes:
    make: ``make(cfg, **values) -> library config``: the method's constructor, given the
      experiment config (for the method's own section) and the values below.
    reads: constructor argument (or field of the method's own section) -> the config path it
      is read from (``{"batch_size": "client.batch_size"}``).
    derive: ``derive(cfg, max_client_size) -> {argument: value}``: the values the experiment
      computes (sections built by :func:`build_section`, which name their own errors).
    derived: argument of ``derive`` -> the config path a core error about it names.
    section: the method's own section (``"feddm"``), whose fields are ``cls``'s; ``""``: none.
    cls: the dataclass of ``section``.
    nested: ``(dataclass, section)`` of the library dataclasses the config writes as sections
      of their own (``client``, ``server``), for naming their fields in the core's errors.
    strip: prefixes of nested names the core gives (``"local."``), read without them.
  """

  make: Callable[..., Any]
  reads: Mapping[str, str]
  derive: Callable[[Any, int | None], dict] | None = None
  derived: Mapping[str, str] = {}
  section: str = ""
  cls: type | None = None
  nested: tuple[tuple[type, str], ...] = ()
  strip: tuple[str, ...] = ()

  def shared(self) -> tuple[str, ...]:
    """The fields of the method's own dataclass that the config writes elsewhere (what its
    section leaves out: :func:`fedlap_runs.configs.schema.section`'s ``exclude``)."""
    return tuple(self.reads) + tuple(self.derived)

  def prefixes(self) -> tuple[str, ...]:
    """Prefixes of fields the core names with their config path already."""
    return SECTION_PREFIXES + ((f"{self.section}.",) if self.section else ())

  def path(self, field: str, within: tuple[type, str] | None = None) -> str:
    """The config path of ``field`` named in a core error (``within``: raised while building
    that nested ``(dataclass, section)``)."""
    if field.startswith(self.prefixes()):
      return field
    name = next((field[len(p) :] for p in self.strip if field.startswith(p)), field)
    if name in self.reads:
      return self.reads[name]
    if name in self.derived:
      return self.derived[name]
    own = ((self.cls, self.section),) if self.cls is not None else ()
    for cls, section in (within,) * (within is not None) + own + self.nested:
      if name in schema.fields(cls):
        return f"{section}.{name}"
    section = within[1] if within is not None else self.section
    return f"{section}.{field}" if section else field


def renamed(err: ConfigError, path: str) -> ConfigError:
  """``err`` of the core with its field renamed to ``path``, the config path."""
  msg = str(err)
  msg = path + msg[len(err.field) :] if msg.startswith(f"{err.field}=") else f"{path}: {msg}"
  return ConfigError(path, err.value, err.allowed, message=msg)


def _get(cfg, path: str):
  node = cfg
  for part in path.split("."):
    node = node[part]
  return node


def build(spec: Spec, cfg, *, max_client_size: int | None = None):
  """The library config ``spec`` describes, from experiment config ``cfg``.

  ``max_client_size``: records of the data's largest client, for the methods whose static
  step count needs it (``None`` before the data is loaded).

  Raises:
    ConfigError: naming the experiment config's field (:meth:`Spec.path`), the value and what
      is allowed.
  """
  values = {name: _get(cfg, path) for name, path in spec.reads.items()}
  if spec.derive is not None:
    values.update(spec.derive(cfg, max_client_size))
  try:
    return spec.make(cfg, **values)
  except ConfigError as e:
    if e.field.startswith(spec.prefixes()):
      raise
    raise renamed(e, spec.path(e.field)) from None


def build_section(cls, cfg, section: str, *, spec: Spec | None = None, ignore=(), **given):
  """Dataclass ``cls`` from the config's section ``section`` and the fields ``given``
  (:func:`fedlap_runs.configs.schema.build`); a core error names ``section.field`` (or, with
  ``spec``, the path the method reads the field from)."""
  try:
    return schema.build(cls, cfg[section], section, ignore=ignore, **given)
  except ConfigError as e:
    if spec is not None:
      path = spec.path(e.field, within=(cls, section))
    elif e.field.startswith(SECTION_PREFIXES + (f"{section}.",)):
      path = e.field
    else:
      path = f"{section}.{e.field}"
    raise renamed(e, path) from None
