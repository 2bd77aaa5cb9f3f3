"""Shared tiny fixtures for the core tests.

Real data offline: scikit-learn's bundled digits (1,797 images, 8x8x1),
standardised, split 80/20 (stratified, fixed seed) and partitioned into five
clients of two classes each in the paper's class order. Models are narrow
ConvNets so that every compile stays in seconds on two CPU cores.

``apply_fn`` and the parameters are session-scoped so that jitted functions
built on them are compiled once and shared across test modules.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlap_jax.client_data import stack_clients
from fedlap_jax.models import ConvNet

CLASS_ORDER = (5, 6, 1, 2, 0, 8, 9, 3, 4, 7)
NUM_CLIENTS = 5
IMAGE_SHAPE = (8, 8, 1)


class Digits(NamedTuple):
  """Standardised digits: ``x`` ``(N, 8, 8, 1)`` float32, ``y`` ``(N,)`` int32."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits() -> Digits:
  # scikit-learn is in the `test` extra; a missing install fails loudly, not as skips.
  from sklearn import datasets, model_selection
  data = datasets.load_digits()
  x = data.images.astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
      x, y, test_size=0.2, random_state=0, stratify=y)
  mean, std = x_tr.mean(), x_tr.std()
  return Digits((x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te)


def partition(x: np.ndarray, y: np.ndarray, order=CLASS_ORDER, num_clients=NUM_CLIENTS):
  """Client ``i`` owns all records of classes ``order[2i]`` and ``order[2i+1]``."""
  per = len(order) // num_clients
  parts = []
  for i in range(num_clients):
    keep = np.isin(y, order[per * i: per * (i + 1)])
    parts.append((x[keep], y[keep]))
  return parts


@pytest.fixture(scope="session")
def digits() -> Digits:
  return load_digits()


@pytest.fixture(scope="session")
def client_parts(digits):
  """Five ``(x, y)`` numpy pairs, two classes each."""
  return partition(digits.x_train, digits.y_train)


@pytest.fixture(scope="session")
def clients(client_parts):
  """Stacked :class:`ClientData`, leaves ``(5, N_max, ...)``."""
  return stack_clients([x for x, _ in client_parts], [y for _, y in client_parts])


@pytest.fixture(scope="session")
def model() -> ConvNet:
  return ConvNet(num_classes=10, width=32, depth=2)


@pytest.fixture(scope="session")
def apply_fn(model):
  def apply(params, x):
    return model.apply({"params": params}, x)
  return apply


@pytest.fixture(scope="session")
def params(model):
  return jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, *IMAGE_SHAPE)))["params"]


@pytest.fixture(scope="session")
def tiny_model() -> ConvNet:
  """An even smaller ConvNet (width 8, depth 1) for loop-structure tests."""
  return ConvNet(num_classes=10, width=8, depth=1)


@pytest.fixture(scope="session")
def tiny_apply_fn(tiny_model):
  def apply(params, x):
    return tiny_model.apply({"params": params}, x)
  return apply


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
  return jax.jit(tiny_model.init)(jax.random.PRNGKey(0), jnp.zeros((1, *IMAGE_SHAPE)))["params"]


def linear_apply(params, x):
  """A linear classifier in Flax's Dense layout: ``(N, H, W, C) -> (N, 10)`` logits.

  Model-agnostic functions are checked eagerly with this model (a handful of
  ops), the ConvNet is used under jit.
  """
  return x.reshape(x.shape[0], -1) @ params["kernel"] + params["bias"]


@pytest.fixture(scope="session")
def linear_apply_fn():
  return linear_apply


@pytest.fixture(scope="session")
def class_order():
  return CLASS_ORDER


@pytest.fixture(scope="session")
def linear_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  d = int(np.prod(IMAGE_SHAPE))
  return {"kernel": 0.1 * jax.random.normal(k1, (d, 10)),
          "bias": 0.1 * jax.random.normal(k2, (10,))}
