"""``jax.jit`` for one-off set-up programs: compiled at LLVM's level 1, the same numbers.

A run's set-up compiles a few programs it runs once: a model's initialisation and the first
synthetic images of the clients. XLA:CPU compiles them as it compiles a round, with LLVM at
XLA's default optimisation level (3), which spends 1-3 s on each on two CPU cores, more than
they will ever run. At level 1 each compiles in 0.2-0.5 s and gives the same numbers, bit
for bit: they are the PRNG's integer hash and a few float operations per element, which the
higher level does not compute differently (``tests/integration/test_compilation.py`` checks
it on the machine the tests run on, under XLA's own settings). A round's programs, whose
numbers do change at level 1, keep XLA's default.

A level named in ``XLA_FLAGS`` (``--xla_backend_optimization_level``) is the user's choice
and wins: the set-up programs then compile as every other program does. Inside another
``jit`` the function is traced into the enclosing program, which decides its options.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax

LEVEL_OPTION = "xla_backend_optimization_level"
SETUP_OPTIONS = {LEVEL_OPTION: 1}


def compiler_options() -> dict[str, Any] | None:
  """The XLA options a set-up program compiles with now: :data:`SETUP_OPTIONS`, or ``None``
  (XLA's settings as they are) when ``XLA_FLAGS`` names an optimisation level."""
  if f"--{LEVEL_OPTION}" in os.environ.get("XLA_FLAGS", ""):
    return None
  return dict(SETUP_OPTIONS)


def setup_jit(fun: Callable | None = None, **jit_kwargs) -> Callable:
  """``jax.jit(fun, **jit_kwargs)`` whose programs, called outside ``jit``, compile with
  :func:`compiler_options`. Usable as a decorator with keyword arguments, like
  ``functools.partial(jax.jit, ...)``.

  Returns:
    A function with ``fun``'s signature and docstring; ``.jitted`` is the plain ``jax.jit``.
  """
  if fun is None:
    return functools.partial(setup_jit, **jit_kwargs)
  plain = jax.jit(fun, **jit_kwargs)
  cheap = jax.jit(fun, compiler_options=SETUP_OPTIONS, **jit_kwargs)

  @functools.wraps(fun)
  def call(*args, **kwargs):
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
    if traced or compiler_options() is None:
      return plain(*args, **kwargs)
    return cheap(*args, **kwargs)

  call.jitted = plain  # type: ignore[attr-defined]
  return call
