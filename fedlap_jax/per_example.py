"""Fast, exact per-example gradient clipping, layer by layer.

DP-SGD needs ``sum_i clip_C(grad_i)`` over a batch, where ``grad_i`` is the
gradient of example ``i``'s loss over the *whole* parameter pytree. The generic
way, ``vmap(grad)`` (also what ``jax_privacy.clipping.clipped_grad`` does),
runs a forward and backward pass per example: for convolutions on XLA:CPU that
is several times slower than one batched pass.

:func:`clipped_gradient_sum` here does it the way Opacus does, exactly:

1. one batched forward pass, in which every parametrised Flax layer adds a
   zero "perturbation" to its output and records its input ``a``;
2. one batched backward pass to the perturbations, which gives every layer's
   output cotangent ``g`` *per example* (the loss is a sum of per-example
   losses and the layers treat examples independently);
3. per layer, per-example parameter gradients from ``(a_i, g_i)``:

   * ``nn.Dense`` on ``(N, d_in)`` inputs: ``dW_i = a_i g_i^T``, whose norm is
     ``|a_i| |g_i|`` ("ghost norm"), never materialised;
   * ``nn.Conv`` (2-D, one feature group): ``dW_i[u, v] = sum_pixels
     patch_{u,v}(a_i) g_i^T``, one batched matmul per kernel offset;
   * any other layer owning parameters (e.g. ``GroupNorm``): ``vmap`` over
     examples of the ``vjp`` of that layer alone (cheap: norms are
     elementwise);

4. norms ``|grad_i|`` over all layers, clip factors ``min(1, C / |grad_i|)``
   (zero for padding examples and non-finite norms), and the clipped sum
   ``sum_i c_i grad_i`` per layer (for a ghost ``Dense``: ``a^T (c * g)``).

The result equals ``vmap(grad)`` + clipping up to float rounding (tests
check 1e-5 relative).

Scope. ``apply_fn(params, x) -> logits`` may be any function; the layer-wise
path applies when, traced on the given shapes,

* every parameter leaf reaches the output only through calls of Flax modules
  that own it (found with :func:`flax.linen.intercept_methods` and checked
  on the jaxpr: the original parameters must be dead code once the layers
  read substituted copies);
* each such call takes one array with the batch on axis 0 and returns one;
* no layer mixes examples (no BatchNorm), the same assumption per-example DP
  makes anyway.

Otherwise :func:`discover` raises :class:`Unsupported` (a ``ConfigError``
saying which models the path serves, :data:`LAYERWISE_SCOPE`) and
:func:`fedlap_jax.privacy.clipped_gradient_sum` with ``method="auto"`` falls
back to the generic path (:func:`auto_plan`): Flax NNX, Equinox and plain-JAX
models always get ``vmap``. A model that mixes examples or holds state outside
its parameters (BatchNorm statistics, linen or NNX or Equinox) is refused
under DP for every method, ``auto`` included (:class:`NotDpSafe`,
:func:`check_dp_model`, which also says what it cannot detect). Non-finite per-example
gradients: the example is dropped (clip factor 0); ``jax_privacy`` instead
zeroes the non-finite entries. Both keep the sensitivity bound ``C``.

References:
  Goodfellow, "Efficient Per-Example Gradient Computations", 2015.
  Yousefpour et al., "Opacus: User-Friendly Differential Privacy Library in
  PyTorch", 2021 (per-layer grad samplers).
  Li et al., "Large Language Models Can Be Strong Differentially Private
  Learners", ICLR 2022 (ghost clipping).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from typing import Any, Callable, cast

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax

from fedlap_jax import models
from fedlap_jax.checks import ConfigError
from fedlap_jax.losses import cross_entropy
from fedlap_jax.types import ApplyFn, PyTree

LossFn = Callable[[jax.Array, jax.Array], jax.Array]

RULES = ("dense", "conv", "generic")


# What the layer-wise path serves, in the words of its refusal.
LAYERWISE_SCOPE = (
  "per_example_method='layerwise' serves flax.linen models whose parametrised layers are "
  "Flax modules, each called on one batched array, with every parameter used only by the "
  "layer that owns it; every other model (Flax NNX, Equinox, plain JAX, a linen model that "
  "transforms its parameters) gets per_example_method='vmap', which 'auto' picks for it"
)


class Unsupported(ConfigError):
  """The layer-wise path cannot serve the model (``auto`` falls back to ``vmap``).

  A :class:`~fedlap_jax.checks.ConfigError` on ``dp.per_example_method``
  whose message says why and which models the layer-wise path serves
  (:data:`LAYERWISE_SCOPE`).
  """

  def __init__(self, reason: str):
    self.reason = reason
    super().__init__(
      "dp.per_example_method",
      "layerwise",
      LAYERWISE_SCOPE,
      message=f"dp.per_example_method='layerwise' cannot serve this model: {reason}. "
      f"Allowed: {LAYERWISE_SCOPE}",
    )

  def __reduce__(self):
    return type(self), (self.reason,)


class NotDpSafe(ConfigError):
  """A model refused under DP for every per-example method: its computation mixes examples or
  carries state outside the parameters (BatchNorm statistics), so per-example clipping does
  not bound one record's influence (:func:`check_dp_model`)."""

  def __init__(self, findings: list[str]):
    self.findings = list(findings)
    allowed = (
      "a model whose output for one example depends on that example and the parameters only "
      "(per-example normalisation such as GroupNorm / LayerNorm / instance norm; no BatchNorm, "
      "no batch statistics or other state outside the parameters)"
    )
    super().__init__(
      "apply_fn",
      self.findings,
      allowed,
      message="apply_fn is refused under DP for every dp.per_example_method: "
      + "; ".join(self.findings)
      + f". Allowed: {allowed}",
    )

  def __reduce__(self):
    return type(self), (self.findings,)


@dataclasses.dataclass(frozen=True)
class LayerCall:
  """One call of a parametrised Flax module during ``apply_fn``.

  Attributes:
    module: an unbound clone of the module.
    method: the method name that was called (usually ``__call__``).
    kwargs: static keyword arguments of the call.
    leaves: indices, into ``jax.tree.leaves(params)``, of the module's
      parameters, in the order of ``jax.tree.leaves`` of the module's own
      parameter dict.
    treedef: structure of the module's own parameter dict.
    rule: ``dense``, ``conv`` or ``generic`` (see the module docstring).
    out_shape: shape of the call's output (batch on axis 0).
    out_dtype: its dtype.
    patches: for ``conv`` layers whose module computes by im2col
      (:func:`fedlap_jax.models.conv_im2col`): the layer is evaluated on
      its patches, which are recorded instead of the input (no second im2col).
  """

  module: nn.Module
  method: str
  kwargs: tuple
  leaves: tuple[int, ...]
  treedef: Any
  rule: str
  out_shape: tuple[int, ...]
  out_dtype: Any
  patches: bool = False

  def apply(self, params: PyTree, x: jax.Array) -> jax.Array:
    return cast(
      jax.Array, self.module.apply({"params": params}, x, method=self.method, **dict(self.kwargs))
    )


def _is_array(v) -> bool:
  return isinstance(v, (jax.Array, jax.core.Tracer)) or hasattr(v, "shape") and hasattr(v, "dtype")


def _own_params(module: nn.Module):
  """The module's ``params`` dict if it owns array leaves directly, else None."""
  if module.scope is None:
    return None
  try:
    own = module.variables.get("params", {})
  except Exception:  # pragma: no cover - unusual scopes
    return None
  if not own or not any(not isinstance(v, dict) and _is_array(v) for v in own.values()):
    return None
  other = [c for c in module.variables if c != "params"]
  if other:
    raise NotDpSafe([_linen_state(module, other)])
  return own


def _linen_state(module: nn.Module, collections: list) -> str:
  return (
    f"flax.linen module {type(module).__name__} at {'/'.join(map(str, module.path)) or '/'} "
    f"holds variables outside 'params' ({sorted(collections)}, e.g. BatchNorm statistics)"
  )


def _conv_rule_applies(module: nn.Module, x: jax.Array, params: dict) -> bool:
  if type(module) is not nn.Conv or set(params) - {"kernel", "bias"}:
    return False
  k = params["kernel"]
  if x.ndim != 4 or k.ndim != 4 or x.dtype != jnp.float32 or k.dtype != jnp.float32:
    return False
  ones = (None, 1, (1, 1), [1, 1])
  if (
    module.feature_group_count != 1
    or module.input_dilation not in ones
    or module.mask is not None
    or module.dtype not in (None, jnp.float32)
    or module.conv_general_dilated
    not in (None, lax.conv_general_dilated, models.conv_im2col, models.conv_hybrid)
    or getattr(module, "conv_general_dilated_cls", None) is not None
    or module.precision is not None
  ):
    return False
  padding = nn.linear.canonicalize_padding(module.padding, 2)
  return not (isinstance(padding, str) and padding not in ("SAME", "VALID", "SAME_LOWER"))


def _dense_rule_applies(module: nn.Module, x: jax.Array, params: dict) -> bool:
  if type(module) is not nn.Dense or set(params) - {"kernel", "bias"}:
    return False
  return (
    params["kernel"].ndim == 2
    and x.dtype == jnp.float32
    and params["kernel"].dtype == jnp.float32
    and module.dtype in (None, jnp.float32)
    and module.precision is None
    and module.dot_general is None
    and getattr(module, "dot_general_cls", None) is None
  )


class _Tracer:
  """Interceptor state for one trace of ``apply_fn``.

  In discovery mode (``calls is None``) it records :class:`LayerCall` s; in
  compute mode it adds ``perturbations[k]`` to the output of call ``k`` and
  records its input. In both modes the layers read their parameters from
  ``shadow`` (a flat list aligned with ``jax.tree.leaves(params)``), not from
  the parameters ``apply_fn`` passed them, so that any other use of the
  parameters is visible in the jaxpr.
  """

  def __init__(self, params_leaves, shadow, calls=None, perturbations=None):
    self.ids = {id(leaf): i for i, leaf in enumerate(params_leaves)}
    self.shadow = shadow
    self.calls = calls
    self.perturbations = perturbations
    self.found: list[LayerCall] = []
    self.inputs: list[jax.Array] = []
    self.inside = False

  def __call__(self, next_fun, args, kwargs, context):
    if self.inside or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    module = context.module
    own = _own_params(module)
    if own is None:
      return next_fun(*args, **kwargs)
    flat, treedef = jax.tree.flatten(own)
    leaves = tuple(self.ids.get(id(v), -1) for v in flat)
    if -1 in leaves:
      raise Unsupported(
        f"parameters of {module.path} are not leaves of the params "
        "given to apply_fn (apply_fn transforms them)"
      )
    if (
      len(args) != 1 or not _is_array(args[0]) or any(_is_array(v) for v in jax.tree.leaves(kwargs))
    ):
      raise Unsupported(f"{module.path}.{context.method_name} takes other than one array")
    x = args[0]
    index = len(self.found) if self.calls is None else len(self.inputs)
    unbound = module.unbind()[0]
    call = LayerCall(
      unbound,
      context.method_name,
      tuple(sorted(kwargs.items())),
      leaves,
      treedef,
      "generic",
      (),
      None,
    )
    own_shadow = jax.tree.unflatten(treedef, [self.shadow[i] for i in leaves])
    spec = None if self.calls is None else self.calls[index]
    if spec is not None and spec.patches:
      patches = _patches(module, x, own_shadow["kernel"])
      out = _conv_from_patches(patches, own_shadow)
    else:
      self.inside = True
      try:
        out = call.apply(own_shadow, x)
      finally:
        self.inside = False
    if not _is_array(out) or out.ndim == 0 or out.shape[0] != x.shape[0]:
      raise Unsupported(f"{module.path} does not map a batch to a batch")
    if self.calls is None:
      rule = "generic"
      if context.method_name == "__call__":
        if _dense_rule_applies(module, x, own):
          rule = "dense"
        elif _conv_rule_applies(module, x, own):
          rule = "conv"
      self.found.append(
        dataclasses.replace(
          call,
          rule=rule,
          out_shape=tuple(out.shape),
          out_dtype=out.dtype,
          patches=rule == "conv" and module.conv_general_dilated is models.conv_im2col,
        )
      )
    else:
      self.inputs.append(patches if spec.patches else x)
      out = out + self.perturbations[index]
    return out


def _dead_inputs(closed_jaxpr, num: int) -> bool:
  """True if none of the first ``num`` inputs of the jaxpr reaches an output."""
  jaxpr = closed_jaxpr.jaxpr
  needed = {v for v in jaxpr.outvars if isinstance(v, jex.core.Var)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars) or eqn.effects:
      needed.update(v for v in eqn.invars if isinstance(v, jex.core.Var))
  return not any(v in needed for v in jaxpr.invars[:num])


def discover(apply_fn: ApplyFn, params: PyTree, x: jax.Array) -> tuple[LayerCall, ...]:
  """The parametrised layer calls of ``apply_fn(params, x)``, in call order.

  Raises:
    Unsupported: if the layer-wise path cannot give exact per-example
      gradients for this model (see the module docstring).
  """
  leaves = jax.tree.leaves(params)
  found = []

  def fn(params, shadow, x):
    tracer = _Tracer(jax.tree.leaves(params), shadow)
    with nn.intercept_methods(tracer):
      out = apply_fn(params, x)
    found.append(tuple(tracer.found))
    return out

  try:
    closed = jax.make_jaxpr(fn)(params, leaves, x)
  except (Unsupported, NotDpSafe):
    raise
  except Exception as e:  # the model does not run under interception
    raise Unsupported(f"apply_fn failed under layer interception: {e!r}") from e
  if not _dead_inputs(closed, len(leaves)):
    raise Unsupported("apply_fn uses parameters outside the Flax layers that own them")
  calls = found[0]
  if not calls:
    raise Unsupported("no parametrised Flax layer was called")
  return calls


# ---------------------------------------------------------------------------
# Models refused under DP: state outside the parameters, examples mixed.
# ---------------------------------------------------------------------------


class _LinenState:
  """Interceptor that records linen modules holding non-parameter variables or BatchNorm."""

  def __init__(self):
    self.found: list[str] = []

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "setup" and module.scope is not None:
      try:  # the collections this module holds itself (not its children's)
        other = [
          c
          for c, d in module.variables.items()
          if c != "params" and any(not isinstance(v, dict) for v in d.values())
        ]
      except Exception:  # pragma: no cover - unusual scopes
        other = []
      text = None
      if other:
        text = _linen_state(module, other)
      elif isinstance(module, nn.BatchNorm):
        text = f"flax.linen BatchNorm at {'/'.join(map(str, module.path))} (statistics of a batch)"
      if text is not None and text not in self.found:
        self.found.append(text)
    return next_fun(*args, **kwargs)


# Objects of these packages are not looked into (arrays, tracers, JAX's and NumPy's internals,
# linen modules: the abstract trace finds what those hold).
_OPAQUE = ("jax", "jaxlib", "numpy", "flax", "equinox", "builtins", "optax", "chex")


def _reachable(root: Any, depth: int = 4) -> list[Any]:
  """Objects ``root`` holds: itself, what a function closes over (cells, defaults, the globals
  it names), a partial's or bound method's parts, the items of containers, the attributes of
  other objects; up to ``depth`` references away."""
  seen: set[int] = set()
  out: list[Any] = []

  def visit(obj, d):
    if id(obj) in seen or d < 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
      return
    seen.add(id(obj))
    out.append(obj)
    if isinstance(obj, functools.partial):
      for o in (obj.func, *obj.args, *obj.keywords.values()):
        visit(o, d - 1)
    elif isinstance(obj, types.MethodType):
      visit(obj.__self__, d - 1)
      visit(obj.__func__, d - 1)
    elif isinstance(obj, types.FunctionType):
      for cell in obj.__closure__ or ():
        try:
          visit(cell.cell_contents, d - 1)
        except ValueError:  # an empty cell
          pass
      for o in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
        visit(o, d - 1)
      names = set(obj.__code__.co_names)
      for const in obj.__code__.co_consts:  # nested lambdas and functions
        if isinstance(const, types.CodeType):
          names |= set(const.co_names)
      for name in names:
        if name in obj.__globals__ and not isinstance(obj.__globals__[name], types.ModuleType):
          visit(obj.__globals__[name], d - 1)
    elif isinstance(obj, (list, tuple)):
      for o in obj[:64]:
        visit(o, d - 1)
    elif isinstance(obj, dict):
      for o in list(obj.values())[:64]:
        visit(o, d - 1)
    elif not isinstance(obj, type) and type(obj).__module__.split(".")[0] not in _OPAQUE:
      attrs = getattr(obj, "__dict__", None)  # e.g. a trainer object holding the model
      if isinstance(attrs, dict):
        for o in list(attrs.values())[:64]:
          visit(o, d - 1)

  visit(root, depth)
  return out


def _is_batch_stat(nnx, v) -> bool:
  """An NNX BatchStat variable (or, in Flax < 0.11, a VariableState of that type)."""
  kind = getattr(v, "type", None)
  return isinstance(v, nnx.BatchStat) or (
    isinstance(kind, type) and issubclass(kind, nnx.BatchStat)
  )


def _graphdef_batchnorms(nnx, node, depth: int = 0) -> int:
  """BatchNorm nodes of an NNX GraphDef (a flat ``nodes`` list, or NodeDefs nested in
  ``subgraphs`` in Flax < 0.11; the class sits in ``type`` or ``metadata``)."""
  if depth > 64:
    return 0
  meta = getattr(node, "metadata", None)
  kinds = [getattr(node, "type", None), meta, meta[0] if isinstance(meta, tuple) and meta else None]
  count = int(any(isinstance(k, type) and issubclass(k, nnx.BatchNorm) for k in kinds))
  for child in list(getattr(node, "nodes", ()) or ()) + list(
    (getattr(node, "subgraphs", None) or {}).values()
  ):
    if child is not node:
      count += _graphdef_batchnorms(nnx, child, depth + 1)
  return count


def _nnx_state(obj: Any) -> list[str]:
  """NNX BatchNorm modules and BatchStat variables in ``obj`` (a module, a state, a graphdef)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return []
  found = []
  legacy = vars(nnx).get("VariableState")  # Flax < 0.11 (later: a deprecated alias, not looked up)
  variable_types = (nnx.Variable, *((legacy,) if isinstance(legacy, type) else ()))
  if isinstance(obj, nnx.Module):
    stats = jax.tree.leaves(nnx.state(obj, nnx.BatchStat))
    norms = [type(m).__name__ for _, m in nnx.iter_graph(obj) if isinstance(m, nnx.BatchNorm)]
    if stats or norms:
      found.append(
        f"NNX module {type(obj).__name__} holds {len(norms)} nnx.BatchNorm layer(s) and "
        f"{len(stats)} BatchStat variable(s)"
      )
  elif isinstance(obj, nnx.State):
    leaves = jax.tree.leaves(obj, is_leaf=lambda v: isinstance(v, variable_types))
    stats = [v for v in leaves if _is_batch_stat(nnx, v)]
    if stats:
      found.append(f"an NNX State holds {len(stats)} BatchStat variable(s) (BatchNorm statistics)")
  elif isinstance(obj, nnx.GraphDef) or type(obj).__module__.startswith("flax.nnx.graph"):
    count = _graphdef_batchnorms(nnx, obj)
    if count:
      found.append(f"an NNX GraphDef holds {count} nnx.BatchNorm layer(s)")
  elif isinstance(obj, variable_types) and _is_batch_stat(nnx, obj):
    found.append("an NNX BatchStat variable (BatchNorm statistics)")
  return found


def _equinox_state(obj: Any) -> list[str]:
  """Equinox BatchNorm layers and ``eqx.nn.State`` in ``obj``."""
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return []
  if isinstance(obj, eqx.nn.State):
    return ["an Equinox eqx.nn.State (state outside the parameters, e.g. BatchNorm statistics)"]
  if isinstance(obj, eqx.Module):
    norms = [
      n
      for n in jax.tree.leaves(obj, is_leaf=lambda n: isinstance(n, eqx.nn.BatchNorm))
      if isinstance(n, eqx.nn.BatchNorm)
    ]
    if norms:
      return [f"an Equinox {type(obj).__name__} holds {len(norms)} eqx.nn.BatchNorm layer(s)"]
  return []


def model_state_findings(apply_fn: ApplyFn, params: PyTree, x: jax.Array) -> list[str]:
  """What makes ``apply_fn(params, x)`` mix examples or carry state outside ``params``.

  Found (each as a sentence):

  * ``flax.linen`` modules called by ``apply_fn`` that hold variables outside
    ``params`` (``batch_stats`` of ``nn.BatchNorm``, any other collection) or
    are ``nn.BatchNorm``, however the variables reach them (one abstract
    trace under :func:`flax.linen.intercept_methods`);
  * Flax NNX ``nnx.BatchNorm`` layers and ``BatchStat`` variables, in
    ``params`` or in what ``apply_fn`` holds: its closure, defaults, the
    globals it names, a ``functools.partial``'s arguments, a bound method's
    object, the attributes of objects among them (an ``nnx.Module``, an
    ``nnx.State``, an ``nnx.GraphDef``);
  * Equinox ``eqx.nn.BatchNorm`` layers and ``eqx.nn.State`` there too.

  Not found: a plain-JAX function (or a custom module) that computes batch
  statistics itself (e.g. ``x - x.mean(axis=0)``), state reached other than
  as above (a module-level variable read by a function that ``apply_fn``
  calls, an object of a compiled extension), and NNX / Equinox state more
  than four references away from ``apply_fn``. Such a model is the caller's
  to keep per-example.
  """
  found: list[str] = []
  for obj in _reachable(apply_fn) + _reachable(params, depth=1):
    for text in _nnx_state(obj) + _equinox_state(obj):
      if text not in found:
        found.append(text)
  if found:  # before tracing: such a model may not even trace as apply_fn(params, x)
    return found
  tracer = _LinenState()

  def traced(p, xs):
    with nn.intercept_methods(tracer):
      return apply_fn(p, xs)

  jax.eval_shape(traced, params, x)
  return tracer.found


def check_dp_model(apply_fn: ApplyFn, params: PyTree, x: jax.Array) -> None:
  """Refuses, under DP, a model that mixes examples or carries state outside its parameters.

  Runs at trace time (shapes only; one abstract trace of ``apply_fn``) for
  every ``per_example_method``; :func:`model_state_findings` says what is and
  is not detected.

  Raises:
    NotDpSafe: naming what was found (a :class:`~fedlap_jax.checks.ConfigError`).
  """
  found = model_state_findings(apply_fn, params, x)
  if found:
    raise NotDpSafe(found)


# Microbatch size that method="auto" uses on CPU for matmul-convolution models.
CPU_MICROBATCH = 16


def auto_plan(apply_fn: ApplyFn, params: PyTree, x: jax.Array) -> tuple[str, int | None]:
  """``(method, microbatch_size)`` that ``method="auto"`` uses (decided at trace time).

  * Every convolution a matrix product (:func:`fedlap_jax.models.conv_im2col` /
    :func:`~fedlap_jax.models.conv_hybrid`, the ConvNet's CPU implementations):
    ``vmap``, since ``vmap(grad)`` is then a batched matmul too; on the CPU
    backend, for batches larger than :data:`CPU_MICROBATCH`, in microbatches of
    that size, which skip the all-padding tail of a Poisson buffer and keep the
    per-example gradients in cache.
  * Other models the layer-wise path supports: ``layerwise`` in one pass (with
    XLA's convolution, ``vmap(grad)`` turns every weight gradient into a
    grouped convolution, and microbatches slow both paths down).
  * Anything else: ``vmap`` in one pass.

  Accelerators get one pass. The choice rests on the timings in docs/benchmarks.md.
  """
  try:
    calls = discover(apply_fn, params, x)
  except (Unsupported, NotDpSafe):  # under DP the caller has refused the latter already
    return "vmap", None
  matmul_convs = (models.conv_im2col, models.conv_hybrid)
  convs = [c for c in calls if c.rule == "conv"]
  if convs and all(c.module.conv_general_dilated in matmul_convs for c in convs):
    cpu = jax.default_backend() == "cpu" and x.shape[0] > CPU_MICROBATCH
    return "vmap", (CPU_MICROBATCH if cpu else None)
  return "layerwise", None


# ---------------------------------------------------------------------------
# Per-layer rules: per-example gradients from (input a, output cotangent g).
# ---------------------------------------------------------------------------


def _conv_pads(module: nn.Conv, x: jax.Array, kernel: jax.Array):
  strides = module.strides or 1
  strides = (strides,) * 2 if isinstance(strides, int) else tuple(strides)
  dil = module.kernel_dilation or 1
  dil = (dil,) * 2 if isinstance(dil, int) else tuple(dil)
  padding = nn.linear.canonicalize_padding(module.padding, 2)
  if isinstance(padding, str):
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel.shape[:2], dil)]
    padding = lax.padtype_to_pads(x.shape[1:3], dilated, strides, padding)
  return strides, dil, tuple(tuple(p) for p in padding)


def _patches(module: nn.Conv, x: jax.Array, kernel: jax.Array) -> jax.Array:
  """im2col patches ``(N, H_out, W_out, kh kw C)`` of a conv layer's input."""
  strides, dil, pads = _conv_pads(module, x, kernel)
  return models.im2col_patches(
    x, (kernel.shape[0], kernel.shape[1]), strides=strides, dilation=dil, padding=pads
  )


def _conv_from_patches(patches: jax.Array, params: dict) -> jax.Array:
  kernel = params["kernel"]
  n, ho, wo, k = patches.shape
  out = jnp.dot(patches.reshape(-1, k), kernel.reshape(k, -1)).reshape(n, ho, wo, -1)
  return out + params["bias"] if "bias" in params else out


# Ghost norms for conv layers: "auto" when P (K + O) < K O (P output pixels, K = kh kw C,
# O filters), i.e. when the two Gram matrices cost less than the per-example kernels.
GHOST_CONV = "auto"


class _Layer:
  """Per-example squared norms and the clipped sum of one layer call.

  ``materialised`` holds per-example gradients ``(N, *leaf.shape)`` (one per
  parameter leaf of the call, in leaf order) or ``None`` for ghost layers,
  which instead provide ``ghost_sqnorm`` ``(N,)`` and ``ghost_sum(scale)``.
  """

  def __init__(self, call: LayerCall, params: dict, a: jax.Array, g: jax.Array, allow_ghost: bool):
    self.call, self.params, self.a, self.g = call, params, a, g
    self.materialised = None
    self.ghost_sqnorm = None
    n = g.shape[0]
    if call.rule == "dense" and a.ndim == 2 and allow_ghost:
      gn = _sqnorm(g)
      self.ghost_sqnorm = _sqnorm(a) * gn + (gn if "bias" in params else 0.0)
      self._kind = "dense"
    elif call.rule == "conv":
      kernel = params["kernel"]
      patches = a if call.patches else _patches(cast(nn.Conv, call.module), a, kernel)
      p = patches.shape[1] * patches.shape[2]
      k, o = patches.shape[-1], kernel.shape[-1]
      self.a = patches.reshape(n, p, k)
      self.g = g.reshape(n, p, o)
      ghost = GHOST_CONV if GHOST_CONV != "auto" else p * (k + o) < k * o
      if allow_ghost and ghost:
        # ||sum_p a_p g_p^T||^2 = sum_{p,q} (a_p . a_q)(g_p . g_q), cheaper than dW_i.
        gram_a = jnp.einsum("npk,nqk->npq", self.a, self.a)
        gram_g = jnp.einsum("npo,nqo->npq", self.g, self.g)
        gn = jnp.sum(gram_g, axis=(1, 2))
        self.ghost_sqnorm = jnp.sum(gram_a * gram_g, axis=(1, 2)) + (
          gn if "bias" in params else 0.0
        )
        self._kind = "conv"
      else:
        dk = jnp.einsum("npk,npo->nko", self.a, self.g).reshape(n, *kernel.shape)
        tree = {"kernel": dk}
        if "bias" in params:
          tree["bias"] = jnp.sum(self.g, axis=1)
        self.materialised = _ordered(params, tree)
    elif call.rule == "dense":
      tree = {"kernel": jnp.einsum("n...i,n...o->nio", a, g)}
      if "bias" in params:
        tree["bias"] = jnp.sum(g, axis=tuple(range(1, g.ndim - 1))) if g.ndim > 2 else g
      self.materialised = _ordered(params, tree)
    else:

      def one(ai, gi):
        _, vjp = jax.vjp(lambda q: call.apply(q, ai[None]), params)
        return vjp(gi[None])[0]

      self.materialised = jax.tree.leaves(jax.vmap(one)(a, g))

  def ghost_sum(self, scale: jax.Array, ok: jax.Array) -> list[jax.Array]:
    """``sum_i scale_i grad_i`` for ghost layers; examples with ``ok`` False give 0."""
    mask = ok.reshape((-1,) + (1,) * (self.a.ndim - 1))
    a = jnp.where(mask, self.a, 0.0)
    g = jnp.where(mask, self.g, 0.0) * scale.reshape(mask.shape)
    if self._kind == "dense":
      tree = {"kernel": a.T @ g}
      if "bias" in self.params:
        tree["bias"] = jnp.sum(g, axis=0)
    else:
      k, o = a.shape[-1], g.shape[-1]
      tree = {
        "kernel": (a.reshape(-1, k).T @ g.reshape(-1, o)).reshape(self.params["kernel"].shape)
      }
      if "bias" in self.params:
        tree["bias"] = jnp.sum(g, axis=(0, 1))
    return _ordered(self.params, tree)


def _sqnorm(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))


def _ordered(own: dict, part: dict) -> list[jax.Array]:
  """Leaves of ``part`` in the order of ``jax.tree.leaves(own)``."""
  return jax.tree.leaves({k: part[k] for k in own})


def _clip_factors(norms, is_padding, l2_clip_norm):
  """``min(1, C / norm)``; 0 for padding and non-finite norms. Returns (scale, ok)."""
  scale = jnp.minimum(1.0, l2_clip_norm / norms)
  ok = jnp.logical_and(jnp.isfinite(norms), jnp.logical_not(is_padding))
  return jnp.where(ok, jnp.nan_to_num(scale, nan=0.0, posinf=0.0), 0.0), ok


def _weighted_sum(scale, ok, per_example):
  mask = ok.reshape((-1,) + (1,) * (per_example.ndim - 1))
  return jnp.tensordot(scale, jnp.where(mask, per_example, 0.0), axes=1)


def _clipped_sum_chunk(apply_fn, loss_fn, params, x, y, is_padding, l2_clip_norm):
  calls = discover(apply_fn, params, x)
  leaves, treedef = jax.tree.flatten(params)
  perts = [jnp.zeros(c.out_shape, c.out_dtype) for c in calls]

  def total_loss(perts):
    tracer = _Tracer(jax.tree.leaves(params), leaves, calls=calls, perturbations=perts)
    with nn.intercept_methods(tracer):
      logits = apply_fn(params, x)
    if len(tracer.inputs) != len(calls):
      raise Unsupported("apply_fn made a different sequence of layer calls when traced again")
    return jnp.sum(loss_fn(logits, y)), tracer.inputs

  cots, inputs = jax.grad(total_loss, has_aux=True)(perts)

  uses = [0] * len(leaves)
  for c in calls:
    for i in c.leaves:
      uses[i] += 1

  layers = []
  per_leaf = {}  # leaf index -> per-example gradient (summed over calls sharing it)
  sq = jnp.zeros((x.shape[0],), jnp.float32)
  for c, a, g in zip(calls, inputs, cots):
    own = jax.tree.unflatten(c.treedef, [leaves[i] for i in c.leaves])
    layer = _Layer(c, own, a, g, allow_ghost=all(uses[i] == 1 for i in c.leaves))
    if layer.materialised is None:
      sq = sq + layer.ghost_sqnorm
      layers.append(layer)
    else:
      for i, pe in zip(c.leaves, layer.materialised):
        per_leaf[i] = pe if i not in per_leaf else per_leaf[i] + pe
  sq = sq + sum((_sqnorm(pe) for pe in per_leaf.values()), jnp.zeros_like(sq))

  norms = jnp.sqrt(sq)
  scale, ok = _clip_factors(norms, is_padding, l2_clip_norm)
  sums = [jnp.zeros(l.shape, l.dtype) for l in leaves]
  for i, pe in per_leaf.items():
    sums[i] = _weighted_sum(scale, ok, pe).astype(leaves[i].dtype)
  for layer in layers:
    for i, part in zip(layer.call.leaves, layer.ghost_sum(scale, ok)):
      sums[i] = part.astype(leaves[i].dtype)
  return jax.tree.unflatten(treedef, sums), norms


def clipped_gradient_sum(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  l2_clip_norm: float,
  microbatch_size: int | None = None,
  loss_fn: LossFn | None = None,
) -> tuple[PyTree, jax.Array]:
  """``sum_i clip_C(grad_i)`` over non-padding examples, layer by layer.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits`` built from Flax modules.
    params: parameter pytree.
    x: ``(N, ...)`` inputs; y: ``(N,)`` labels.
    is_padding: ``(N,)`` bool; padding examples contribute exactly zero.
    l2_clip_norm: ``C`` > 0, the bound on each example's gradient norm over
      the whole pytree.
    microbatch_size: if set, process ``microbatch_size`` examples at a time
      to bound memory, up to the last chunk holding a real example
      (:func:`microbatched`); ``N`` is padded up to a multiple.
    loss_fn: per-example loss ``(logits, y) -> (N,)``; default softmax cross
      entropy with integer labels.

  Returns:
    ``(clipped_sum, norms)``: a pytree like ``params`` and the ``(N,)``
    pre-clipping per-example gradient norms.

  Raises:
    Unsupported: if the model is outside the scope of the layer-wise path.
  """
  loss_fn = _default_loss(loss_fn)

  def chunk(x, y, is_padding):
    return _clipped_sum_chunk(apply_fn, loss_fn, params, x, y, is_padding, l2_clip_norm)

  return microbatched(chunk, params, x, y, is_padding, microbatch_size)


def microbatched(
  chunk_fn: Callable[[jax.Array, jax.Array, jax.Array], tuple[PyTree, jax.Array]],
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  microbatch_size: int | None,
) -> tuple[PyTree, jax.Array]:
  """Runs ``chunk_fn`` on microbatches of a batch and adds up the results.

  ``N`` is padded with padding examples up to a multiple of ``microbatch_size``;
  the chunks run one after another, and only up to the last chunk that holds a
  real example (a ``while_loop``): a Poisson buffer keeps its real examples
  first (:func:`fedlap_jax.privacy.poisson_sample`), so its all-padding tail
  costs nothing.

  Args:
    chunk_fn: ``chunk_fn(x, y, is_padding) -> (total, per_example)`` on one
      chunk of ``m = microbatch_size`` examples: ``total`` a pytree shaped like
      ``params`` (summed over the chunks), ``per_example`` an ``(m,)`` array
      (e.g. gradient norms, as float32).
    params: the parameter pytree; gives the structure and dtypes of ``total``.
    x: ``(N, ...)`` inputs; y: ``(N,)`` labels; is_padding: ``(N,)`` bool.
    microbatch_size: examples per chunk; ``None`` or ``>= N`` calls
      ``chunk_fn`` once on the whole batch.

  Returns:
    ``(total, per_example)``: the sum of the chunks' totals and the ``(N,)``
    per-example values, 0 for the examples of chunks skipped.

  Raises:
    ConfigError: ``microbatch_size`` is not an integer >= 1.

  Not reverse-differentiable when chunked (the loop length is data-dependent).
  """
  n = x.shape[0]
  if microbatch_size is None or microbatch_size >= n:
    return chunk_fn(x, y, is_padding)
  if not isinstance(microbatch_size, int) or microbatch_size < 1:
    raise ConfigError("microbatch_size", microbatch_size, "an integer >= 1")
  chunks = math.ceil(n / microbatch_size)
  pad = chunks * microbatch_size - n

  def split(a, fill):
    if pad:
      a = jnp.concatenate([a, jnp.full((pad, *a.shape[1:]), fill, a.dtype)])
    return a.reshape(chunks, microbatch_size, *a.shape[1:])

  xs, ys, ps = split(x, 0), split(y, 0), split(is_padding, True)
  has_real = jnp.any(jnp.logical_not(ps), axis=1)
  needed = jnp.max(jnp.where(has_real, jnp.arange(1, chunks + 1), 0))

  def body(i, carry):
    acc, norms = carry
    s, chunk_norms = chunk_fn(xs[i], ys[i], ps[i])
    return jax.tree.map(jnp.add, acc, s), norms.at[i].set(chunk_norms)

  zero = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
  norms0 = jnp.zeros((chunks, microbatch_size), jnp.float32)
  total, norms = lax.fori_loop(0, needed, body, (zero, norms0))
  return total, norms.reshape(-1)[:n]


def _default_loss(loss_fn: LossFn | None) -> LossFn:
  """``loss_fn``, or softmax cross entropy with integer labels when ``None``."""
  if loss_fn is None:
    return cross_entropy
  return loss_fn


def per_example_gradients(
  apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, loss_fn: LossFn | None = None
) -> PyTree:
  """``vmap(grad)``: every leaf of ``params`` gains a leading ``(N,)`` axis.

  ``loss_fn`` is the per-example loss ``(logits, y) -> (N,)`` (default softmax
  cross entropy with integer labels).
  """
  loss_fn = _default_loss(loss_fn)

  def loss_one(p, xi, yi):
    return loss_fn(apply_fn(p, xi[None]), yi[None])[0]

  return jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params, x, y)


def clipped_gradient_sum_vmap(
  apply_fn: ApplyFn,
  params: PyTree,
  x: jax.Array,
  y: jax.Array,
  is_padding: jax.Array,
  *,
  l2_clip_norm: float,
  microbatch_size: int | None = None,
  loss_fn: LossFn | None = None,
) -> tuple[PyTree, jax.Array]:
  """The generic path for any ``apply_fn``: ``vmap(grad)``, clip, sum.

  Same arguments and results as :func:`clipped_gradient_sum`.
  """

  def chunk(x, y, is_padding):
    grads = per_example_gradients(apply_fn, params, x, y, loss_fn)
    norms = jnp.sqrt(sum(_sqnorm(g) for g in jax.tree.leaves(grads)))
    scale, ok = _clip_factors(norms, is_padding, l2_clip_norm)
    return jax.tree.map(lambda g: _weighted_sum(scale, ok, g).astype(g.dtype), grads), norms

  return microbatched(chunk, params, x, y, is_padding, microbatch_size)
