"""Named experiment configs: ``--config=NAME`` resolves to ``configs/NAME.py``.

Each module defines ``get_config()`` (some take one string argument, passed as
``--config=NAME:ARG``) starting from :mod:`experiments.configs.default`.
"""
