"""Named experiment configs: ``--config=NAME`` resolves to ``configs/NAME.py``.

Each module defines ``get_config()`` (some take one string argument, passed as
``--config=NAME:ARG``) starting from :mod:`experiments.configs.default`.
"""

import importlib


def load(name: str):
  """The config ``--config=NAME[:ARG]`` names (``NAME`` a module of this folder)."""
  module, sep, arg = name.partition(":")
  get_config = importlib.import_module(f"{__name__}.{module}").get_config
  return get_config(arg) if sep else get_config()
