"""Type aliases shared by the library (annotations only; nothing here runs).

* ``PyTree``: a JAX pytree, e.g. a Flax parameter dict.
* ``ApplyFn``: the one model assumption of the core, ``apply_fn(params, x)
  -> logits`` with ``x`` ``(N, H, W, C)`` and logits ``(N, num_classes)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]
