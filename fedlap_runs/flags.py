"""The command line of ``experiments.run``: ``--config=NAME[:ARG]`` and its overrides.

:func:`parse_argv` reads a command line (``ml_collections.config_flags``: a named config of
``fedlap_runs/configs/``, or a path to a config file, each ``--config.FIELD=VALUE`` parsed by
the field's type); :func:`load_config` does the same for a name and a list of overrides (the
Flower app, with ``named_only``: never a path, which would be executed). Every bad input is a
:class:`~fedlap_jax.checks.ConfigError` whose text is the command line's one-line message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from fedlap_runs import configs

CONFIG_DIR = configs.CONFIG_DIR


class ConfigArgError(ValueError):
  """``--config`` names no config file."""


def resolve_config_arg(value: str, *, named_only: bool = False) -> tuple[str, str]:
  """``'NAME[:ARG]'`` -> ``(path[:ARG], run name)``; paths are kept as they are.

  ``NAME`` is a module of ``fedlap_runs/configs/`` or an alias of
  :data:`fedlap_runs.configs.ALIASES` (its module and argument are substituted).
  With ``named_only`` a path (``NAME`` ending in ``.py`` or holding a path
  separator) is refused before anything on the disk is looked at, so the
  message is the same whether such a file exists or not.
  """
  name, sep, arg = value.partition(":")
  is_path = name.endswith(".py") or os.sep in name or bool(os.altsep and os.altsep in name)
  if named_only and is_path:
    raise ConfigArgError(
      f"--config={value!r} is invalid: a path; allowed: NAME[:ARG] with NAME one of "
      f"{list(configs.names())} (the configs of fedlap_runs/configs/)"
    )
  if is_path:
    path = name
    label = Path(name).stem
    target = path + sep + arg
  else:
    try:
      module, module_arg = configs.resolve(value)
    except KeyError:
      raise ConfigArgError(
        f"--config={value!r} is invalid: no fedlap_runs/configs/{name}.py; "
        f"allowed: one of {list(configs.names())} (optionally NAME:ARG), or "
        "a path to a config .py file"
      ) from None
    path = str(CONFIG_DIR / f"{module}.py")
    label = name
    target = path + ("" if module_arg is None else f":{module_arg}")
  safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", arg)  # npz:/a/b.npz must not nest the work dir
  return target, label + (f"_{safe}" if sep and arg else "")


def rewrite_argv(argv: list[str], *, named_only: bool = False) -> tuple[list[str], str | None]:
  """Replaces the value of ``--config`` by its file path; returns the run name too.

  ``named_only``: refuse a path (:func:`resolve_config_arg`).
  """
  out, name, i = [], None, 0
  while i < len(argv):
    a = argv[i]
    if a.startswith("--config="):
      path, name = resolve_config_arg(a[len("--config=") :], named_only=named_only)
      out.append(f"--config={path}")
    elif a == "--config" and i + 1 < len(argv):
      path, name = resolve_config_arg(argv[i + 1], named_only=named_only)
      out += ["--config", path]
      i += 1
    else:
      out.append(a)
    i += 1
  return out, name


# What a --config.FIELD override may name (the ``allowed`` of an unknown field's ConfigError).
CONFIG_FIELDS = "the fields of fedlap_runs/configs/default.py"
# An override value that sets a None-able field (a ``config_dict.placeholder``) to None.
NONE_TEXTS = ("None", "none")


def _none_able(config, field: str) -> bool:
  """Whether ``field`` (dotted) of ``config`` is a placeholder, i.e. may be None."""
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top

  *parents, leaf = field.split(".")
  node = config
  for part in parents:
    node = node._fields.get(part) if isinstance(node, config_dict.ConfigDict) else None  # pylint: disable=protected-access
  return isinstance(node, config_dict.ConfigDict) and isinstance(
    node._fields.get(leaf), config_dict.FieldReference
  )  # pylint: disable=protected-access


# How ml_collections' config_flags begins the error of a config file whose get_config raised.
_CONFIG_FILE_ERROR = "Error whilst parsing config file"


def _config_error(e: Exception, name_arg: str, overrides: list[tuple[str, str]]):
  """The :class:`ConfigError` of a failed flag parse; its text is the command line's message.

  ``field`` is the override's field for an unknown field (``allowed``: :data:`CONFIG_FIELDS`)
  or a value its type does not parse, else ``"config"`` (the file did not load).
  """
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top  (JAX)

  inner = e.args[0] if e.args and isinstance(e.args[0], KeyError) else e
  if isinstance(inner, KeyError):  # an override of a field the config does not have
    detail = (inner.args[0] if inner.args else str(inner)).replace("\n", "; ")
    key = re.match(r"'([^']*)'", detail)  # the unknown key first, then any suggestions
    field, text = next(
      ((f, t) for f, t in overrides if key and key.group(1) in f.split(".")),
      overrides[0] if overrides else ("", ""),
    )
    return ConfigError(
      field,
      text,
      CONFIG_FIELDS,
      message=f"unknown config field in --config.{field}={text}: {detail} "
      f"(allowed: {CONFIG_FIELDS})",
    )
  message = str(e)
  for field, text in reversed(overrides):  # absl: "flag --config.FIELD=VALUE: why"
    prefix = f"flag --config.{field}={text}: "
    if message.startswith(prefix):
      return ConfigError(
        field, text, f"a value of the field's type ({message[len(prefix) :]})", message=message
      )
  # The config's own get_config refused: ml_collections re-raises its error with the traceback
  # as text (the original is the context of that re-raise); the original's message is the reason.
  wrapped = e.__context__
  if wrapped is not None and str(wrapped).startswith(_CONFIG_FILE_ERROR) and wrapped.__context__:
    message = f"--config={name_arg!r} is invalid: {wrapped.__context__}"
  return ConfigError("config", name_arg, "a config file that loads", message=message)


def _suite_error(error, name_arg: str, suite):
  """``error`` (an unknown field) restated for a suite: a run's field is ``suite.RUN.FIELD``.

  A field no run has either gets a single config's message (its "did you mean" included).
  """
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top  (JAX)

  field, text = error.field, error.value
  runs, holders, unknown = list(suite.keys()), [], None
  for run in runs:
    node = suite[run]
    try:
      for part in field.split("."):
        node = node[part]
      holders.append(run)
    except KeyError as e:
      unknown = unknown or e
    except TypeError:  # a part below a leaf: the run's own parse names it
      holders.append(run)
  if not holders:
    return _config_error(unknown, name_arg, [(field, text)])
  return ConfigError(
    field,
    text,
    f"a field of a run, --config.suite.RUN.{field} with RUN one of {runs}",
    message=f"--config.{field}={text}: {name_arg} is a suite of the runs {runs}; a "
    f"run's field is set as --config.suite.RUN.FIELD=VALUE "
    f"(e.g. --config.suite.{holders[0]}.{field}={text})",
  )


def parse_argv(argv: list[str], *, named_only: bool = False):
  """Parses ``experiments.run``'s command line (``argv[0]`` is the program).

  ``named_only``: ``--config`` must name a config of ``fedlap_runs/configs/``
  (:func:`resolve_config_arg`; a path is refused).

  ``--config=NAME[:ARG]`` is resolved (:func:`rewrite_argv`) and loaded by
  ``ml_collections.config_flags`` (locked); each ``--config.FIELD=VALUE`` is parsed by the
  field's type (``true``/``false`` for bools, ``'(0.5,)'`` for tuples), and ``None`` (or
  ``none``) sets a None-able field (one ``default.py`` declares a placeholder) to None.

  Returns:
    ``(flags, name)``: the parsed ``absl.flags.FlagValues`` (``.config``, ``.workdir``) and the
    run's name; ``(None, None)`` without ``--config``.

  Raises:
    ConfigError: naming ``"config"`` (an unknown name, a file that does not load), an
      override's field (unknown, or a value its type does not parse; ``value`` is the text),
      or ``"overrides"`` (an override without a value); ``str(e)`` is the command line's
      message.
  """
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top  (JAX)

  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  argv = list(argv)
  name_arg = next((a[len("--config=") :] for a in argv if a.startswith("--config=")), None)
  try:
    argv, name = rewrite_argv(argv, named_only=named_only)
  except ConfigArgError as e:
    raise ConfigError(
      "config",
      name_arg,
      "NAME[:ARG] of fedlap_runs/configs/"
      + ("" if named_only else ", or a path to a config .py file"),
      message=str(e),
    ) from None
  if name is None:
    return None, None
  overrides = [
    tuple(a[len("--config.") :].partition("=")[::2])
    for a in argv
    if a.startswith("--config.") and "=" in a
  ]
  last = dict(overrides)  # absl: the last value of a flag wins
  none_fields = [f for f, t in last.items() if t in NONE_TEXTS]

  def parse(argv):
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
      "config",
      None,
      "Experiment config file.",
      lock_config=True,
      flag_values=flag_values,
      sys_argv=argv,
    )
    flags.DEFINE_string(
      "workdir", None, "Output directory (default runs/<config name>).", flag_values=flag_values
    )
    try:
      flag_values(argv)
      getattr(flag_values.config, "keys")  # a file that did not load raises on first use
    except (flags.Error, ValueError, TypeError, AttributeError, KeyError, OSError) as e:
      error = _config_error(e, name_arg, overrides)
      if error.allowed == CONFIG_FIELDS and not error.field.startswith("suite."):
        base = parse([a for a in argv if not a.startswith("--config.")]).config
        if "suite" in base:
          raise _suite_error(error, name_arg, base.suite) from None
      raise error from None
    return flag_values

  if none_fields:  # None is no value of the field's type: set it after
    base = parse([a for a in argv if not a.startswith("--config.")]).config
    none_fields = [f for f in none_fields if _none_able(base, f)]
    argv = [a for a in argv if a[len("--config.") :].partition("=")[0] not in none_fields]
  flag_values = parse(argv)
  for field in none_fields:
    *parents, leaf = field.split(".")
    node = flag_values.config
    for part in parents:
      node = node[part]
    node[leaf] = None
  return flag_values, name


def load_config(name_arg: str, overrides: Sequence[str] = (), *, named_only: bool = False):
  """The config of ``--config=NAME_ARG --config.FIELD=VALUE ...``, as :func:`main` builds it.

  ``overrides`` are ``"FIELD=VALUE"`` items, each parsed as the command line's
  ``--config.FIELD=VALUE`` (:func:`parse_argv`). The config is locked, not validated.
  ``named_only``: ``NAME_ARG`` must name a config of ``fedlap_runs/configs/`` (a path,
  which would be executed, is refused).

  A ``seed`` the config and the overrides leave None becomes 0 here: this serves a caller with
  no work dir to keep a drawn seed in (the Flower app, whose DP clients draw their round keys
  from the operating system's entropy, and tests). :func:`main` leaves it None, so that a DP
  run's seed is drawn for its work dir (:mod:`fedlap_runs.seeds`).

  Returns:
    ``(config, name)``: the ml_collections config and the run's name (``cifar_ablation_ipc:20``
    -> ``cifar_ablation_ipc_20``).

  Raises:
    ConfigError: as :func:`parse_argv`; ``"overrides"`` for an item that is not
      ``FIELD=VALUE``.
  """
  from fedlap_jax.checks import ConfigError  # pylint: disable=g-import-not-at-top  (JAX)

  for item in overrides:
    if not isinstance(item, str) or not item.partition("=")[0] or "=" not in item:
      raise ConfigError("overrides", item, "FIELD=VALUE, e.g. seed=1 or client.batch_loop=2")
  flag_values, name = parse_argv(
    ["prog", f"--config={name_arg}", *(f"--config.{item}" for item in overrides)],
    named_only=named_only,
  )
  config = flag_values.config
  for cfg in config.suite.values() if "suite" in config else [config]:
    if cfg.get("seed", 0) is None:
      cfg.seed = 0
  return config, name


# Arguments that ask for the usage text instead of a run (absl's and argparse's spellings).
HELP_ARGS = ("-h", "--help", "-help", "--helpshort", "--helpfull")


def usage(guide: str) -> str:
  """The command's usage text: its ``guide`` (``experiments.run``'s docstring) and every
  ``NAME`` ``--config`` takes."""
  import textwrap  # pylint: disable=g-import-not-at-top

  names = textwrap.fill(
    ", ".join(configs.names()), width=88, initial_indent="  ", subsequent_indent="  "
  )
  return f"{guide.strip()}\n\nNAME is one of (fedlap_runs/configs/ and its aliases):\n{names}\n"
