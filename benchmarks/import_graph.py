"""The floor plan of ``fedlap_jax``: its modules, line counts and import graph.

Reads the source with :mod:`ast` (imports nothing of the library). Modules are
named by their dotted path inside the package (``client``, ``methods.fedlap``);
a subpackage's ``__init__.py`` is the module of the subpackage's name
(``methods``), and only the package's own ``__init__`` is left out: it
re-exports, it is not a floor. Every ``import`` / ``from ... import`` of a
``fedlap_jax`` module counts, also one inside a function (a deferred import is
still a dependency), one of a name that is a submodule (``from fedlap_jax
import dsa``, ``from fedlap_jax.methods import fedlap``) and a relative one.

A module's floor is 1 if it imports no other library module, else one more
than the highest floor it imports; the library's floors are the highest floor,
i.e. the number of modules on its longest import chain. A cycle has no floors
(reported as such). The *core* is every module outside the subpackage
``methods`` (the method registry and the methods' own modules sit on top of it);
``core_floors`` is the highest floor among the core's modules.

Usage: ``python -m benchmarks.import_graph`` prints the module list with line
counts, each module's floor and imports, the longest chain and any cycle;
``--json`` prints the graph, floors, longest chain and cycle as one JSON object;
``--importers DIR [DIR ...]`` adds, for every ``.py`` file under each folder
(e.g. ``experiments fedlap_flower``), the ``fedlap_jax`` modules it imports
(key ``importers``, paths relative to the current directory);
``python -m benchmarks.import_graph ROOT`` reads another package directory. The
exit status is 1 when there is a cycle.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

PACKAGE = "fedlap_jax"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE


# The subpackage of the method registry and the methods' own modules (outside the core).
METHODS_PACKAGE = "methods"


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """``{dotted module name: path}`` of the package's modules, without its own ``__init__``."""
  found = {}
  for p in sorted(root.rglob("*.py")):
    parts = p.relative_to(root).with_suffix("").parts
    if "__pycache__" in parts:
      continue
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if parts:
      found[".".join(parts)] = p
  return found


def _longest_known(dotted: str, names: set[str]) -> str | None:
  """The longest prefix of ``dotted`` (``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``) in ``names``."""
  parts = dotted.split(".")
  for n in range(len(parts), 0, -1):
    candidate = ".".join(parts[:n])
    if candidate in names:
      return candidate
  return None


def imports(path: pathlib.Path, names: set[str], module: str | None = None) -> set[str]:
  """Library modules (among ``names``) that the file at ``path`` imports anywhere.

  ``module`` is the file's own dotted name inside the package (for relative imports;
  ``None``: a file outside the package, whose relative imports are not the library's).
  """
  found = set()
  is_package = path.name == "__init__.py"
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[0] == PACKAGE and len(parts) > 1:
          hit = _longest_known(".".join(parts[1:]), names)
          if hit:
            found.add(hit)
    elif isinstance(node, ast.ImportFrom):
      if node.level == 0:
        if not node.module:
          continue
        parts = node.module.split(".")
        if parts[0] != PACKAGE:
          continue
        base = parts[1:]
      else:
        if module is None:
          continue
        here = module.split(".") if is_package else module.split(".")[:-1]
        up = node.level - 1
        if up > len(here):
          continue
        base = here[: len(here) - up] + (node.module.split(".") if node.module else [])
      prefix = ".".join(base)
      for alias in node.names:  # a name that is a submodule is that module
        sub = f"{prefix}.{alias.name}" if prefix else alias.name
        if sub in names:
          found.add(sub)
        elif prefix:
          hit = _longest_known(prefix, names)
          if hit:
            found.add(hit)
  return found & names


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """``{module: library modules it imports}`` (self-imports dropped)."""
  mods = modules(root)
  return {m: imports(p, set(mods), m) - {m} for m, p in mods.items()}


def is_core(module: str) -> bool:
  """Whether ``module`` belongs to the core (outside the subpackage ``methods``)."""
  return module.split(".")[0] != METHODS_PACKAGE


def importers(folders, names: set[str]) -> dict[str, list[str]]:
  """``{file: sorted library modules it imports}`` for every ``.py`` under ``folders``."""
  out = {}
  for folder in folders:
    for p in sorted(pathlib.Path(folder).rglob("*.py")):
      if "__pycache__" not in p.parts:
        out[p.as_posix()] = sorted(imports(p, names))
  return out


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
  """One import cycle ``[a, b, ..., a]``, or None if the graph is acyclic."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m):
    state[m] = 1
    path.append(m)
    for d in sorted(g[m]):
      if state.get(d) == 1:
        return path[path.index(d) :] + [d]
      if d not in state:
        cycle = visit(d)
        if cycle:
          return cycle
    path.pop()
    state[m] = 2
    return None

  for m in sorted(g):
    if m not in state:
      cycle = visit(m)
      if cycle:
        return cycle
  return None


def floors(g: dict[str, set[str]]) -> dict[str, int]:
  """``{module: floor}``. Raises ValueError on a cycle."""
  cycle = find_cycle(g)
  if cycle:
    raise ValueError(f"import cycle: {' -> '.join(cycle)}")
  memo: dict[str, int] = {}

  def floor(m):
    if m not in memo:
      memo[m] = 1 + max((floor(d) for d in g[m]), default=0)
    return memo[m]

  return {m: floor(m) for m in g}


def longest_chain(g: dict[str, set[str]]) -> list[str]:
  """A longest import chain, top module first."""
  f = floors(g)
  m = max(sorted(f), key=f.get)
  chain = [m]
  while g[m]:
    m = max(sorted(g[m]), key=f.get)
    chain.append(m)
  return chain


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "root",
    nargs="?",
    default=str(ROOT),
    help=f"the package directory (default: {PACKAGE}/ of this repository)",
  )
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument(
    "--importers",
    nargs="+",
    default=(),
    metavar="DIR",
    help="also list the library modules each .py file under these folders imports",
  )
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root)
  mods = modules(root)
  g = graph(root)
  cycle = find_cycle(g)
  if args.json:
    f = None if cycle else floors(g)
    out = {
      "graph": {m: sorted(d) for m, d in g.items()},
      "cycle": cycle,
      "floors": f,
      "core_floors": None if f is None else max(v for m, v in f.items() if is_core(m)),
      "longest_chain": None if cycle else longest_chain(g),
    }
    if args.importers:
      out["importers"] = importers(args.importers, set(mods))
    print(json.dumps(out))
    return 1 if cycle else 0
  lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
  init = root / "__init__.py"
  init_lines = len(init.read_text().splitlines()) if init.is_file() else 0
  print(f"{len(mods)} modules (+ __init__.py, {init_lines} lines), {sum(lines.values())} lines")
  if cycle:
    # Floors over the graph without deferred imports would hide it; report it plainly.
    print("import cycle:", " -> ".join(cycle))
    for m in sorted(mods):
      print(f"  {m:<22} {lines[m]:>5}  imports {', '.join(sorted(g[m])) or '-'}")
    return 1
  f = floors(g)
  for m in sorted(mods, key=lambda m: (f[m], m)):
    print(f"  floor {f[m]}  {m:<22} {lines[m]:>5}  imports {', '.join(sorted(g[m])) or '-'}")
  core = max(v for m, v in f.items() if is_core(m))
  print(
    f"{max(f.values())} floors ({core} in the core, outside {METHODS_PACKAGE}/); "
    f"longest chain: {' -> '.join(longest_chain(g))}"
  )
  if args.importers:
    for path, used in importers(args.importers, set(mods)).items():
      if used:
        print(f"  {path}: {', '.join(used)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
