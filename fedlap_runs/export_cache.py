"""A warm first round: the round program kept as a serialised ``jax.export`` beside JAX's cache.

JAX's persistent compilation cache (:mod:`fedlap_runs.compilation_cache`) keeps the compiled
round, but a process still traces and lowers the round (1-2 s on two cores) to find the cache
entry. This module keeps the traced and lowered program as well: on its first call,
:class:`ExportedRound` looks for the round's ``jax.export`` serialisation (StableHLO, a few
hundred kB) in the ``exported/`` folder of the compilation cache, reads it back instead of
tracing (a few milliseconds), and runs it under ``jax.jit``, whose compiled program then comes
from JAX's cache. On a miss it exports the round itself (the trace and lowering a plain call
pays), writes the entry and runs it the same way, so the first run and every later one compile
and run the same program.

It is on exactly when JAX's persistent cache is (:func:`directory`: the config field
``compilation_cache_dir`` and ``$FEDLAP_COMPILATION_CACHE`` govern both).

An entry is keyed (:func:`entry_key`) by everything that decides the program: the versions of
Python, JAX, jaxlib and the libraries the round calls; the backend, its version, the devices'
kinds and count; ``XLA_FLAGS`` and the ``--xla`` arguments; JAX's configuration (every value
but the caches' and the logs' settings); a digest of the source of ``fedlap_jax``,
``experiments`` and ``fedlap_flower`` (an edit of any traces afresh); the inputs' pytree
structure, shapes, dtypes, weak types and shardings; and a fingerprint of the round's static
arguments (the method, its library config, the model's functions, by value: fields, code,
closed-over values), and of the jitted function itself where it is a closure. A value
the fingerprint cannot read (:class:`Unkeyable`) leaves the round as it is. An entry that is
missing, unreadable, damaged (its digest), foreign (another key inside) or that does not fit
the inputs is traced again after a one-line notice; writes are atomic (a temporary file,
then a rename), and at most :data:`MAX_ENTRIES` entries are kept (the least recently used
go).

The round takes the clients' records and the keys as arguments; an entry holds the program, its
constants (the model's shapes, the config's numbers) and the names of the state's types, not
data (tests/integration/test_compilation_cache.py searches an entry for the records).

:func:`wrap_program` serves any other jitted program the same way: the Flower app's client and
server steps (``fedlap_flower``), whose processes start afresh for every message.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import marshal
import os
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from fedlap_jax.client_data import ClientData

FORMAT = 1
SUBDIR = "exported"
SUFFIX = ".jaxexport"
MAGIC = b"fedlap_jax exported round\n"
MAX_ENTRIES = 64  # ~0.2-0.4 MB each
# Exported programs loaded in this process (key -> jitted call), so that the runs of a suite
# or a sweep share one compiled program, as they share the plain round's jit.
MAX_LOADED = 8
# The libraries whose code the round runs (their versions key an entry).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "chex", "numpy", "ml_dtypes", "scipy")
# JAX settings that cannot change a program: the caches', the logs' and the dumps' (every other
# value of ``jax.config.values`` keys an entry).
_NOT_PROGRAM = (
  "jax_compilation_cache",
  "jax_enable_compilation_cache",
  "jax_persistent_cache",
  "jax_raise_persistent_cache_errors",
  "jax_log",
  "jax_explain_cache_misses",
  "jax_compiler_detailed_logging",
  "jax_debug_log_modules",
  "jax_dump_ir",
  "jax_include_debug_info_in_dumps",
  "jax_pprint",
  "jax_traceback",
  "jax_tracer_error_num_traceback_frames",
  "jax_captured_constants",
)
# Module prefixes whose NamedTuple types an entry may name (the state's and metrics' types).
_TYPE_MODULES = ("fedlap_jax.", "experiments.", "optax.", "flax.", "chex.")


class Unkeyable(TypeError):
  """A static argument holds a value :func:`fingerprint` cannot read by value."""


# ----------------------------------------------------------------------------
# The key.
# ----------------------------------------------------------------------------


# The packages whose code a cached program may run: ``fedlap_flower`` (the Flower app's client
# and server steps) is found, not imported (it is optional, and its import would be Flower's).
PACKAGES = ("fedlap_jax", "experiments", "fedlap_runs", "fedlap_flower")


def source_digest() -> str:
  """SHA-256 of every ``.py`` file of :data:`PACKAGES` (path and bytes; those installed)."""
  h = hashlib.sha256()
  for name in PACKAGES:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      continue
    root = Path(next(iter(spec.submodule_search_locations))).resolve()
    for path in sorted(root.rglob("*.py")):
      h.update(str(path.relative_to(root.parent)).encode() + b"\0")
      h.update(path.read_bytes() + b"\0")
  return h.hexdigest()


# The source this process imported (read when this module is, beside fedlap_jax's own import):
# an entry is written only while the files on disk still have it (see ExportedRound._export).
SOURCE_AT_IMPORT = source_digest()


def _importable_name(obj: Any) -> str | None:
  """``module:qualname`` when that name reaches ``obj`` itself (a module-level definition)."""
  module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
  if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
    return None
  target: Any = sys.modules.get(module)
  for part in qualname.split("."):
    target = getattr(target, part, None)
  return f"{module}:{qualname}" if target is obj else None


def fingerprint(value: Any) -> str:
  """SHA-256 of ``value`` read by value: what a jit static argument decides of a program.

  Numbers and strings by ``repr``; tuples, lists, dicts, sets, NamedTuples and dataclasses
  (Flax modules included) by their type and items; arrays by dtype, shape and bytes;
  module-level functions, classes and objects by their importable name (their code is keyed
  by :func:`source_digest` and the library versions); other functions (lambdas, closures) by
  their code, defaults and closed-over values; ``functools.partial`` and bound methods by
  their parts.

  Raises:
    Unkeyable: ``value`` holds something else (then nothing may be cached by it).
  """
  h = hashlib.sha256()
  seen: dict[int, int] = {}
  keep: list[Any] = []  # holds what ``seen`` names, so that no id is reused meanwhile

  def put(*parts: object) -> None:
    for p in parts:
      h.update(str(p).encode() + b"\x1f")

  def walk(v: Any) -> None:
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
      put(type(v).__name__, repr(v))
      return
    if isinstance(v, enum.Enum):
      put("enum", type(v).__module__, type(v).__qualname__, v.name)
      return
    if id(v) in seen:
      put("ref", seen[id(v)])
      return
    seen[id(v)] = len(seen)
    keep.append(v)
    if isinstance(v, type):
      name = _importable_name(v)
      if name is None:
        raise Unkeyable(f"the class {v!r} is not importable by name")
      put("class", name)
    elif isinstance(v, (np.ndarray, np.generic, jax.Array)):
      a = np.asarray(
        jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
      )
      put(
        "array",
        str(v.dtype),
        a.shape,
        hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
      )
    elif isinstance(v, tuple) and hasattr(type(v), "_fields"):  # a NamedTuple
      put("namedtuple", type(v).__module__, type(v).__qualname__, len(v))
      for f in type(v)._fields:
        put(f)
        walk(getattr(v, f))
    elif isinstance(v, (tuple, list)):
      put(type(v).__name__, len(v))
      for x in v:
        walk(x)
    elif isinstance(v, dict):
      put("dict", len(v))
      for k in sorted(v, key=repr):
        walk(k)
        walk(v[k])
    elif isinstance(v, (set, frozenset)):
      put(type(v).__name__, sorted(fingerprint(x) for x in v))
    elif isinstance(v, functools.partial):
      put("partial")
      walk(v.func)
      walk(v.args)
      walk(v.keywords)
    elif isinstance(v, types.MethodType):
      put("method")
      walk(v.__func__)
      walk(v.__self__)
    elif (name := _importable_name(v)) is not None:  # a module-level function or object
      put("named", name)
    elif isinstance(v, types.FunctionType):
      put("function", v.__module__, v.__qualname__)
      put(hashlib.sha256(marshal.dumps(v.__code__)).hexdigest())
      walk(v.__defaults__)
      walk(v.__kwdefaults__)
      for cell in v.__closure__ or ():
        walk(cell.cell_contents)
    elif dataclasses.is_dataclass(v):
      put("dataclass", type(v).__module__, type(v).__qualname__)
      for f in dataclasses.fields(v):
        put(f.name)
        walk(getattr(v, f.name))
    else:
      raise Unkeyable(f"a {type(v).__module__}.{type(v).__qualname__} cannot be keyed by value")

  walk(value)
  return h.hexdigest()


def _library_versions() -> dict[str, str | None]:
  out: dict[str, str | None] = {}
  for name in LIBRARIES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _jax_settings() -> dict[str, str]:
  return {
    k: repr(v) for k, v in sorted(jax.config.values.items()) if not k.startswith(_NOT_PROGRAM)
  }


def _aval(x: Any) -> list:
  sharding = getattr(x, "sharding", None)
  return [
    list(np.shape(x)),
    str(getattr(x, "dtype", type(x).__name__)),
    bool(getattr(getattr(x, "aval", None), "weak_type", False)),
    "" if sharding is None else repr(sharding),
  ]


def entry_key(fn_name: str, static: str, args: tuple, source: str) -> str:
  """The SHA-256 key of the exported program of ``fn_name`` on ``args`` (see module doc).

  Args:
    fn_name: the jitted function's importable name.
    static: :func:`fingerprint` of its static arguments.
    args: the positional (array) arguments.
    source: :func:`source_digest` of the code that traced it.
  """
  devices = jax.devices()
  leaves, treedef = jax.tree.flatten(args)
  facts = {
    "format": FORMAT,
    "python": sys.version,
    "libraries": _library_versions(),
    "backend": jax.default_backend(),
    "platform_version": devices[0].client.platform_version,
    "devices": [d.device_kind for d in devices],
    "processes": jax.process_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "xla_argv": [a for a in sys.argv if a.startswith("--xla")],
    "jax_config": _jax_settings(),
    "source": source,
    "function": fn_name,
    "static": static,
    "treedef": str(treedef),
    "inputs": [_aval(x) for x in leaves],
  }
  return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------
# Entries.
# ----------------------------------------------------------------------------


def directory() -> Path | None:
  """``<JAX's compilation cache>/exported``, or ``None`` while JAX's persistent cache is off."""
  given = jax.config.jax_compilation_cache_dir
  if not jax.config.jax_enable_compilation_cache or not given:
    return None
  return Path(given) / SUBDIR


def _namedtuple_types(treedef: Any) -> list[type]:
  """The NamedTuple types of a pytree structure, each once, in order of appearance."""
  found: list[type] = []

  def walk(td: Any) -> None:
    data = td.node_data()
    if data is not None:
      typ = data[0]
      if isinstance(typ, type) and issubclass(typ, tuple) and hasattr(typ, "_fields"):
        if typ not in found:
          found.append(typ)
    for child in td.children():
      walk(child)

  walk(treedef)
  return found


_registering = threading.Lock()


def _register(typ: type) -> str:
  """Registers NamedTuple ``typ`` with ``jax.export`` (once) under its importable name."""
  name = _importable_name(typ)
  if name is None or not name.startswith(_TYPE_MODULES):
    raise Unkeyable(f"the type {typ!r} is not one an exported round may name")
  with _registering:
    try:
      if typ is ClientData:  # a NamedTuple whose static max_classes is its pytree aux data
        jax.export.register_pytree_node_serialization(
          typ,
          serialized_name=name,
          serialize_auxdata=lambda aux: json.dumps(aux).encode(),
          deserialize_auxdata=json.loads,
        )
      else:
        jax.export.register_namedtuple_serialization(typ, serialized_name=name)
    except ValueError:  # registered already: by this module, under ``name``
      pass
  return name


def _resolve(name: str) -> type:
  """The NamedTuple type ``module:qualname`` an entry names (only of :data:`_TYPE_MODULES`)."""
  module, _, qualname = name.partition(":")
  if not (module + ".").startswith(_TYPE_MODULES) or not qualname:
    raise ValueError(f"it names a type outside the project: {name!r}")
  target: Any = importlib.import_module(module)
  for part in qualname.split("."):
    target = getattr(target, part)
  if not (isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")):
    raise ValueError(f"{name!r} is not a NamedTuple")
  return target


def write_entry(path: Path, key: str, exported: Any) -> None:
  """Writes ``exported`` (a ``jax.export.Exported``) under ``key`` to ``path``, atomically."""
  kinds = _namedtuple_types(exported.in_tree)
  kinds += [t for t in _namedtuple_types(exported.out_tree) if t not in kinds]
  names = [_register(t) for t in kinds]
  blob = exported.serialize()
  header = {"key": key, "types": names, "sha256": hashlib.sha256(blob).hexdigest()}
  path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(MAGIC + json.dumps(header).encode() + b"\n" + blob)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
  entries = sorted(path.parent.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
  for old in entries[:-MAX_ENTRIES]:
    old.unlink(missing_ok=True)


def read_entry(path: Path, key: str) -> Any:
  """The ``jax.export.Exported`` in ``path``, checked against ``key``.

  Raises:
    OSError: it cannot be read (``FileNotFoundError``: there is none).
    ValueError: it is not an entry, is damaged, or holds another key.
  """
  raw = path.read_bytes()
  if not raw.startswith(MAGIC):
    raise ValueError("it is not an exported round")
  line, sep, blob = raw[len(MAGIC) :].partition(b"\n")
  if not sep:
    raise ValueError("it is truncated")
  try:
    header = json.loads(line)
  except ValueError:
    raise ValueError("its header is damaged") from None
  if not isinstance(header, dict) or header.get("key") != key:
    raise ValueError("it holds another program (its key differs)")
  if hashlib.sha256(blob).hexdigest() != header.get("sha256"):
    raise ValueError("it is damaged (its digest differs)")
  for name in header.get("types", []):
    _register(_resolve(str(name)))
  exported = jax.export.deserialize(bytearray(blob))
  os.utime(path)  # recently used
  return exported


# ----------------------------------------------------------------------------
# The round.
# ----------------------------------------------------------------------------

_loaded: collections.OrderedDict[str, Callable] = collections.OrderedDict()
_loaded_lock = threading.Lock()


def _notice(message: str) -> None:
  print(f"note: {message}", file=sys.stderr, flush=True)


def _jitted(exported: Any, device: Any) -> Callable:
  """``jax.jit`` of the exported program's call, named as the function it exports.

  Its inputs and outputs are placed on ``device`` explicitly (a one-device program), so that
  the initial state (not yet committed to a device) and the later rounds' (committed) lower
  to one program: without it, round 2 would lower and compile the call again.
  """

  def call(*args):
    return exported.call(*args)

  call.__name__ = call.__qualname__ = exported.fun_name
  if exported.nr_devices != 1:
    return jax.jit(call)
  placed = jax.sharding.SingleDeviceSharding(device)
  return jax.jit(call, in_shardings=placed, out_shardings=placed)


def _check_inputs(exported: Any, args: tuple) -> None:
  """Raises ValueError unless ``exported`` takes ``args`` (their structure, shapes, dtypes)."""
  if exported.in_tree != jax.tree.structure((args, {})) or [
    (tuple(a.shape), str(a.dtype)) for a in exported.in_avals
  ] != [(tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(args)]:
    raise ValueError("its inputs differ from the round's")


def _keep_loaded(key: str, fn: Callable) -> Callable:
  with _loaded_lock:
    _loaded[key] = fn
    _loaded.move_to_end(key)
    while len(_loaded) > MAX_LOADED:
      _loaded.popitem(last=False)
  return fn


# ----------------------------------------------------------------------------
# Prefetch: the next run of a config loads its round's program while it sets up.
# ----------------------------------------------------------------------------

HINTS = "hints"  # <cache>/exported/hints/<hint>.key: the entry key a run of <hint> last ran
_HEX64 = frozenset("0123456789abcdef")
_prefetching: dict[str, concurrent.futures.Future] = {}
PREFETCH_THREAD = "fedlap-prefetch"
_prefetch_threads: list[threading.Thread] = []


def hint_of(*parts: Any) -> str:
  """A SHA-256 naming a run by ``parts`` (e.g. its config without its seed) and this source.

  Only a guess of which entry a run will need: :func:`prefetch` loads what the hint names, and
  the round uses it only when its own key (:func:`entry_key`) is that entry's.
  """
  text = json.dumps([SOURCE_AT_IMPORT, *parts], sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()


def _read_hint(cache_dir: Path, hint: str) -> str | None:
  """The entry key kept under ``hint`` in ``cache_dir``, or ``None`` (none, or not a key)."""
  try:
    key = (cache_dir / HINTS / f"{hint}.key").read_text()
  except OSError:
    return None
  return key if len(key) == 64 and set(key) <= _HEX64 else None


def _write_hint(cache_dir: Path, hint: str, key: str) -> None:
  """Keeps ``key`` under ``hint``; a load :func:`prefetch` started for the key the hint named
  before, which this run does not run, is dropped (its program is not kept in memory)."""
  path = cache_dir / HINTS / f"{hint}.key"
  old = _read_hint(cache_dir, hint)
  if old == key:
    return
  if old is not None:
    with _loaded_lock:
      _prefetching.pop(old, None)
  try:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
      f.write(key)
    os.replace(tmp, path)
    hints = sorted(path.parent.glob("*.key"), key=lambda p: p.stat().st_mtime)
    for old in hints[:-MAX_ENTRIES]:
      old.unlink(missing_ok=True)
  except OSError:  # a guess for the next run; this run goes on without it
    pass


def _load(path: Path, key: str) -> tuple[Any, Callable, Any]:
  """``(exported, jitted call, its device)``: the entry read and its program compiled (from
  JAX's cache when it holds it) for the exported inputs' shapes."""
  exported = read_entry(path, key)
  device = jax.devices()[0]
  fn = _jitted(exported, device)
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in exported.in_avals]
  args, kwargs = jax.tree.unflatten(exported.in_tree, avals)
  fn.lower(*args, **kwargs).compile()  # jit keeps it: the round's first call compiles nothing
  return exported, fn, device


def prefetch(hint: str, cache_dir: Path | None = None) -> bool:
  """Starts loading, on a background thread, the program the last run of ``hint`` ran: the
  entry read back and its executable compiled (read from JAX's cache), while this run sets up
  (its data, its state) on the main thread. The round takes it when its own key is that entry's
  (:class:`ExportedRound`); otherwise it is left unused. Whether a load started (a hint kept
  in ``cache_dir``, default :func:`directory`, and not loaded already)."""
  cache_dir = directory() if cache_dir is None else cache_dir
  if cache_dir is None or jax.config.jax_disable_jit:
    return False
  key = _read_hint(cache_dir, hint)
  if key is None:
    return False
  path = cache_dir / f"{key}{SUFFIX}"
  with _loaded_lock:
    if key in _loaded or key in _prefetching or not path.is_file():
      return False
    future: concurrent.futures.Future = concurrent.futures.Future()
    _prefetching[key] = future

  def work() -> None:
    try:
      future.set_result(_load(path, key))
    except BaseException as e:  # noqa: BLE001 - the round reads it again itself
      future.set_exception(e)

  # A daemon, so a run may go on without it; a process that exits waits for it (settle).
  thread = threading.Thread(target=work, name=PREFETCH_THREAD, daemon=True)
  thread.start()
  _prefetch_threads.append(thread)
  return True


def settle() -> None:
  """Waits for the loads :func:`prefetch` started: a process that exits (``experiments.run``,
  also after an early error) calls it first, as the interpreter's shutdown would meet a load
  still inside XLA and abort the process (``terminate called ...``) instead of exiting."""
  while _prefetch_threads:
    _prefetch_threads.pop().join()


class ExportedRound:
  """``round(state, clients)`` served from the export cache in ``cache_dir`` (see module doc).

  Attributes:
    round: the plain round: a ``functools.partial`` of a jitted function and its static
      keyword arguments (:func:`fedlap_jax.rounds.make_round_fn`).
    cache_dir: the folder of the entries.
    hint: :func:`hint_of` the run, or ``None``: the key of the entry the round runs is kept
      under it, for :func:`prefetch` in the next run of the same config.
  """

  def __init__(
    self,
    round_fn: functools.partial,
    cache_dir: Path,
    notice: Callable[[str], None] = _notice,
    hint: str | None = None,
  ):
    self.round = round_fn
    self.cache_dir = cache_dir
    self.hint = hint
    self._notice = notice
    func = round_fn.func
    name = _importable_name(func)
    self._fn_name = name or f"{func.__module__}:{getattr(func, '__qualname__', '')}"
    static: tuple = (round_fn.args, round_fn.keywords)
    if name is None:  # a closure (or a lambda): its code and closed-over values decide it too
      static = (getattr(func, "__wrapped__", func), *static)
    self._static = fingerprint(static)
    self._calls: dict[tuple, Callable] = {}
    self._lock = threading.Lock()

  def __call__(self, *args):
    return self.program(*args)(*args)

  def program(self, *args) -> Callable:
    """The jitted program this round runs on ``args`` (loaded, or exported and written)."""
    leaves, treedef = jax.tree.flatten(args)
    signature = (treedef, tuple(tuple(map(str, _aval(x))) for x in leaves))
    with self._lock:
      fn = self._calls.get(signature)
      if fn is None:
        fn = self._calls[signature] = self._build(args)
    return fn

  def _build(self, args: tuple) -> Callable:
    key = entry_key(self._fn_name, self._static, args, SOURCE_AT_IMPORT)
    with _loaded_lock:
      if key in _loaded:
        _loaded.move_to_end(key)
        return _loaded[key]
    if self.hint is not None:
      _write_hint(self.cache_dir, self.hint, key)
    devices = {d for x in jax.tree.leaves(args) for d in getattr(x, "devices", lambda: ())()}
    device = devices.pop() if len(devices) == 1 else jax.devices()[0]
    path = self.cache_dir / f"{key}{SUFFIX}"
    fn = self._prefetched(key, args, device)
    if fn is not None:
      return _keep_loaded(key, fn)
    exported = None
    try:
      exported = read_entry(path, key)
      _check_inputs(exported, args)
    except FileNotFoundError:
      exported = None
    except Exception as e:  # noqa: BLE001 - any failure to read means: trace again
      self._notice(f"the exported round {path} cannot be used ({e}); tracing it again")
      exported = None
    if exported is None:
      exported = self._export(args, path, key)
      if exported is None:
        return self.round
    return _keep_loaded(key, _jitted(exported, device))

  def _prefetched(self, key: str, args: tuple, device: Any) -> Callable | None:
    """The program :func:`prefetch` loaded for ``key`` (waiting for it), or ``None``."""
    with _loaded_lock:
      future = _prefetching.pop(key, None)
    if future is None:
      return None
    try:
      exported, fn, on = future.result()
      _check_inputs(exported, args)
      if on != device:
        return None
    except Exception as e:  # noqa: BLE001 - read it again in this thread
      self._notice(f"the prefetched round {key} cannot be used ({e}); reading it again")
      return None
    return fn

  def _export(self, args: tuple, path: Path, key: str) -> Any:
    try:
      exported = jax.export.export(self.round.func)(*self.round.args, *args, **self.round.keywords)
    except Exception as e:  # noqa: BLE001 - a round jax.export cannot take runs as it is
      self._notice(f"the round cannot be exported ({type(e).__name__}: {e}); it runs uncached")
      return None
    if source_digest() != SOURCE_AT_IMPORT:
      self._notice(
        "the source of fedlap_jax, experiments or fedlap_flower changed during this run; "
        "the exported round is not kept"
      )
      return exported
    try:
      write_entry(path, key, exported)
    except Exception as e:  # noqa: BLE001 - the run goes on without an entry
      self._notice(f"the exported round cannot be kept in {path.parent} ({e})")
    return exported


def wrap(
  alg: Any,
  cache_dir: Path | None = None,
  *,
  notice: Callable[[str], None] = _notice,
  hint: str | None = None,
) -> Any:
  """``alg`` (a :class:`~fedlap_jax.algorithm.FederatedAlgorithm`) with its round served by
  :class:`ExportedRound` from ``cache_dir`` (default :func:`directory`).

  ``alg`` is returned as it is when there is no directory (JAX's persistent cache is off),
  when jit is disabled, when its round is not a jitted function's ``functools.partial`` (the
  ``shard`` backend's placed round), or when its static arguments cannot be keyed (one line
  says so). ``hint``: see :attr:`ExportedRound.hint`.
  """
  cache_dir = directory() if cache_dir is None else cache_dir
  round_fn = alg.round
  if (
    cache_dir is None
    or jax.config.jax_disable_jit
    or not isinstance(round_fn, functools.partial)
    or not hasattr(round_fn.func, "trace")
  ):
    return alg
  try:
    return alg._replace(round=ExportedRound(round_fn, cache_dir, notice, hint))
  except Unkeyable as e:
    notice(f"the round is not kept exported ({e})")
    return alg


def wrap_program(
  fn: Callable, cache_dir: Path | None = None, *, notice: Callable[[str], None] = _notice
) -> Callable:
  """``fn`` (a jitted function called with positional array arguments) served from the export
  cache in ``cache_dir`` (default :func:`directory`), as :func:`wrap` serves a round.

  A closure is keyed by its code and the values it closes over (:func:`fingerprint`). ``fn`` is
  returned as it is when there is no directory, when jit is disabled, when it is not jitted, or
  when it cannot be keyed (one line says so). The result runs the program; tracing it (as
  ``jax.eval_shape`` does) needs ``fn`` itself.
  """
  cache_dir = directory() if cache_dir is None else cache_dir
  if cache_dir is None or jax.config.jax_disable_jit or not hasattr(fn, "trace"):
    return fn
  try:
    return ExportedRound(functools.partial(fn), cache_dir, notice)
  except Unkeyable as e:
    notice(f"the program {getattr(fn, '__qualname__', fn)!r} is not kept exported ({e})")
    return fn
