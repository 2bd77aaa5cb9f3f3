"""The data sets the experiments know, one row each (:data:`ROWS`), and the models
``config.model.name`` names (:func:`model_factory`).

A data set is named by ``data.name``, which is the TensorFlow Datasets name where tfds
serves it (``mnist``, ``fashion_mnist``, ``cifar10``, ``svhn_cropped``). Adding a data set
is adding one :class:`DataSet` row here; the loader (:mod:`fedlap_runs.data`), the config
checks, the named configs, the epsilon tables and the reports read it from this table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from fedlap_jax.checks import ConfigError
from fedlap_jax.models import SCATTER_HEADS, ScatterNet

# The paper's partition hands the classes to its clients two at a time in this order
# (:func:`fedlap_runs.data.partition`).
PAPER_CLASS_ORDER = (5, 6, 1, 2, 0, 8, 9, 3, 4, 7)
PAPER_CLIENTS = 5


@dataclasses.dataclass(frozen=True)
class DataSet:
  """One data set's public facts.

  Attributes:
    name: ``data.name`` (tfds's name where ``tfds`` is true).
    tfds: whether ``data.source='tfds'`` serves it (under ``name``).
    image_shape: ``(H, W, C)`` of its images; ``None``: whatever the data holds.
    num_classes: its classes; ``None``: one more than the largest label in the data.
    mean, std: published per-channel normalisation of pixels in [0, 1] (the authors'
      constants); ``None``: none published.
    download: ``(host, port)`` tfds downloads it from, probed before a download.
    train_class_counts: records per class of its training split (tfds's copy): public
      facts, so client sizes and epsilons need no download; ``None``: not recorded.
    short: the prefix of its named configs (``fmnist`` in ``fmnist_dp``); ``""``: none.
    psg_sigma: PSG's sigma of its named config (:mod:`fedlap_runs.configs.synthetic_baselines`).
  """

  name: str
  tfds: bool = False
  image_shape: tuple[int, int, int] | None = None
  num_classes: int | None = None
  mean: tuple[float, ...] | None = None
  std: tuple[float, ...] | None = None
  download: tuple[str, int] | None = None
  train_class_counts: tuple[int, ...] | None = None
  short: str = ""
  psg_sigma: float | None = None

  @property
  def paper_min_client_size(self) -> int | None:
    """Records of the smallest client of the paper partition (5 clients, classes in pairs)."""
    if self.train_class_counts is None:
      return None
    per = len(PAPER_CLASS_ORDER) // PAPER_CLIENTS
    owned = [PAPER_CLASS_ORDER[i * per : (i + 1) * per] for i in range(PAPER_CLIENTS)]
    return min(sum(self.train_class_counts[c] for c in classes) for classes in owned)


ROWS = {
  row.name: row
  for row in (
    # tfds mnist 3.0.1, fashion_mnist 3.0.1, cifar10 3.0.2; constants from the authors' code.
    DataSet(
      "mnist",
      tfds=True,
      image_shape=(28, 28, 1),
      num_classes=10,
      mean=(0.1307,),
      std=(0.3081,),
      download=("storage.googleapis.com", 443),
      train_class_counts=(5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
      short="mnist",
      psg_sigma=1.674,
    ),
    DataSet(
      "fashion_mnist",
      tfds=True,
      image_shape=(28, 28, 1),
      num_classes=10,
      mean=(0.2861,),
      std=(0.3530,),
      download=("fashion-mnist.s3-website.eu-central-1.amazonaws.com", 80),
      train_class_counts=(6000,) * 10,
      short="fmnist",
      psg_sigma=1.597,
    ),
    DataSet(
      "cifar10",
      tfds=True,
      image_shape=(32, 32, 3),
      num_classes=10,
      mean=(0.4914, 0.4822, 0.4465),
      std=(0.2023, 0.1994, 0.2010),
      download=("www.cs.toronto.edu", 443),
      train_class_counts=(5000,) * 10,
      short="cifar",
      psg_sigma=1.864,
    ),
    # Constants of the dataset-condensation authors' code (DC / DM), as for the others.
    DataSet(
      "svhn_cropped",
      tfds=True,
      image_shape=(32, 32, 3),
      num_classes=10,
      mean=(0.4377, 0.4438, 0.4728),
      std=(0.1980, 0.2010, 0.1970),
      download=("ufldl.stanford.edu", 80),
    ),
    # scikit-learn's bundled 8x8 digits (data.source='sklearn').
    DataSet("digits", image_shape=(8, 8, 1), num_classes=10),
    # Any data brought as npz:PATH.
    DataSet("custom"),
  )
}
NAMES = tuple(ROWS)
TFDS_NAMES = tuple(n for n, r in ROWS.items() if r.tfds)
PUBLISHED = tuple(n for n, r in ROWS.items() if r.mean is not None)
# The data sets of the paper's named configs: short prefix -> row.
PAPER = {r.short: r for r in ROWS.values() if r.short}


# Models by name; config.model.name is one of these or MODULE:ATTR. ``convnet`` is built from
# config.model's other fields (width, depth, norm, conv_bias), which only it reads; the
# ScatterNets (a fixed scattering front end, :class:`fedlap_jax.models.ScatterNet`) read none.
# A ``scattered_`` model is a ScatterNet's head alone, for data whose images are replaced by
# their scattering once, when loaded (``data.features='scattering'``).
SCATTERNETS = {f"scatternet_{head}": head for head in SCATTER_HEADS}
SCATTERED = {f"scattered_{head}": head for head in SCATTER_HEADS}
MODELS = ("convnet", *SCATTERNETS, *SCATTERED)
MODEL_ALLOWED = (
  f"one of {MODELS} or MODULE:ATTR, an importable callable taking num_classes and "
  "returning a flax.linen.Module"
)


def model_factory(name):
  """``config.model.name`` -> ``None`` for ``convnet``, else a callable taking ``num_classes``
  (a ScatterNet's, or the one ``MODULE:ATTR`` names).

  Raises:
    ConfigError: naming ``model.name`` when it is neither, or does not import.
  """
  if isinstance(name, str) and name in SCATTERNETS:
    return functools.partial(ScatterNet, head=SCATTERNETS[name])
  if isinstance(name, str) and name in SCATTERED:
    return functools.partial(ScatterNet, head=SCATTERED[name], front_end=False)
  if name in MODELS:
    return None
  module, sep, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
  if not (sep and module and attr):
    raise ConfigError("model.name", name, MODEL_ALLOWED)
  try:
    obj = importlib.import_module(module)
    for part in attr.split("."):
      obj = getattr(obj, part)
  except (ImportError, AttributeError) as e:
    raise ConfigError(
      "model.name",
      name,
      MODEL_ALLOWED,
      message=f"model.name={name!r} is invalid: {e}; allowed: {MODEL_ALLOWED}",
    ) from None
  if not callable(obj):
    raise ConfigError("model.name", name, MODEL_ALLOWED)
  return obj
