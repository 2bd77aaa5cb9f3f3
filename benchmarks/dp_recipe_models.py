"""Models of the DP-recipe research runs, named on the command line as ``MODULE:ATTR``.

``--config.model.name=benchmarks.dp_recipe_models:convnet32_tanh`` (from a checkout's root)
runs the research ConvNet (width 32, depth 3, instance norm) with tanh in place of ReLU, for
either arm; the library's DP refusals apply as to any model.
"""

import jax.numpy as jnp

from fedlap_jax.models import ConvNet


def convnet32_tanh(num_classes: int) -> ConvNet:
  """ConvNet-32, depth 3, with tanh activations (the ReLU research model otherwise)."""
  return ConvNet(num_classes=num_classes, width=32, depth=3, activation=jnp.tanh)
