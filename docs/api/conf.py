"""Sphinx configuration of the API reference, generated from the docstrings.

pip install -e ".[docs]" && python -m sphinx -W -b html docs/api docs/_build/api
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

project = "fedlap_jax"
author = "fedlap_jax authors"
copyright = "fedlap_jax authors, Apache License 2.0"  # noqa: A001 (Sphinx reads this name)
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []

# Google-style docstrings (Args:, Returns:, Raises:, Attributes:), as the code writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields of the class, not as objects of their own
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
# The reference documents the library as installed; nothing here needs a device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _skip_tuple_fields(app, what, name, obj, skip, options):
  """NamedTuple fields (documented in their class's Attributes:) are not members of their own."""
  del app, what, name, options
  doc = getattr(obj, "__doc__", None) or ""
  if isinstance(obj, property) and doc.startswith("Alias for field number"):
    return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_tuple_fields)
