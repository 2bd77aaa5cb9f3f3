"""Sphinx configuration of the API reference, generated from the docstrings.

pip install -e ".[docs]" && python -m sphinx -W -b html docs/api docs/_build/api

FEDLAP_JAX_DOCS_PATH=DIR documents the package installed in DIR (CI installs the wheel there)
instead of this checkout.
"""

import os
import sys

_SOURCE = os.environ.get("FEDLAP_JAX_DOCS_PATH") or os.path.join(
  os.path.dirname(__file__), "..", ".."
)
sys.path.insert(0, os.path.abspath(_SOURCE))

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
  """NamedTuple fields (documented in their class's Attributes:) are not members of their own.

  A field is a ``property`` up to Python 3.10 and a ``collections._tuplegetter`` from 3.11 on;
  both carry the docstring "Alias for field number N".
  """
  del app, what, name, options
  doc = getattr(obj, "__doc__", None) or ""
  if not callable(obj) and doc.startswith("Alias for field number"):
    return True
  return skip


# Types as a user writes them: jax.Array's qualified name is jaxlib's private module.
PUBLIC_NAMES = {"jax.jaxlib._jax.Array": "jax.Array", "jaxlib._jax.Array": "jax.Array"}


def public_names(text):
  for private, public in PUBLIC_NAMES.items():
    text = text.replace(private, public)
  return text


def _public_signature(app, what, name, obj, options, signature, return_annotation):
  del app, what, name, obj, options
  return (
    signature and public_names(signature),
    return_annotation and public_names(return_annotation),
  )


def _public_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  lines[:] = [public_names(line) for line in lines]


def _check_source(app, config):
  """The package documented is the one in _SOURCE (the installed wheel in CI), not another."""
  del app, config
  import fedlap_jax

  where = os.path.realpath(fedlap_jax.__file__)
  if not where.startswith(os.path.realpath(_SOURCE) + os.sep):
    raise RuntimeError(f"documenting fedlap_jax from {where}, not from {_SOURCE}")


def setup(app):
  app.connect("autodoc-skip-member", _skip_tuple_fields)
  # After napoleon's own handlers (priority 500), which write the Attributes: types.
  app.connect("autodoc-process-signature", _public_signature, priority=900)
  app.connect("autodoc-process-docstring", _public_docstring, priority=900)
  app.connect("config-inited", _check_source)
