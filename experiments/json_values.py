"""Numbers as JSON holds them: JSON has no NaN or Inf, so a non-finite value is ``None``.

The run's records (:mod:`experiments.outputs`) write them.
"""

from __future__ import annotations

import math

import numpy as np


def finite_list(a) -> list:
  """``a``'s values as a flat list of floats, ``None`` for NaN / Inf."""
  return [None if not math.isfinite(v) else v for v in np.asarray(a, np.float64).ravel().tolist()]
