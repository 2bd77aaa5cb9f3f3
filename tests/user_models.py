"""Models a user brings with ``--config.model.name=user_models:ATTR`` (the tests' own module)."""

import flax.linen as nn


class MLP(nn.Module):
  """A one-hidden-layer perceptron."""

  num_classes: int
  hidden: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes)(x)


class BatchNormMLP(nn.Module):
  """An MLP with BatchNorm: statistics outside its parameters (running averages here, the
  batch's own in :class:`BatchStatsMLP`, which mix the examples of a batch)."""

  num_classes: int
  use_running_average: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x.reshape((x.shape[0], -1)))
    x = nn.BatchNorm(use_running_average=self.use_running_average)(x)
    return nn.Dense(self.num_classes)(nn.relu(x))


def batch_stats_mlp(num_classes: int) -> nn.Module:
  return BatchNormMLP(num_classes, use_running_average=False)


def mlp(num_classes: int) -> nn.Module:
  return MLP(num_classes)


def not_a_module(num_classes: int):
  return num_classes
