"""The floor plan of ``fedlap_jax``: its modules, line counts and import graph.

Reads the source with :mod:`ast` (imports nothing of the library). Every
``import`` / ``from ... import`` of a ``fedlap_jax`` module counts, also one
inside a function (a deferred import is still a dependency) and one of a name
that is a submodule (``from fedlap_jax import dsa``). The package's
``__init__`` is left out: it re-exports, it is not a floor.

A module's floor is 1 if it imports no other library module, else one more
than the highest floor it imports; the library's floors are the highest floor,
i.e. the number of modules on its longest import chain. A cycle has no floors
(reported as such).

Usage: ``python -m benchmarks.import_graph`` prints the module list with line
counts, each module's floor and imports, the longest chain and any cycle;
``--json`` prints the graph, floors, longest chain and cycle as one JSON object;
``python -m benchmarks.import_graph DIR`` reads another package directory. The
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


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """``{module name: path}`` of the package's modules, without ``__init__``."""
  return {p.stem: p for p in sorted(root.glob("*.py")) if p.stem != "__init__"}


def imports(path: pathlib.Path, names: set[str]) -> set[str]:
  """Library modules (among ``names``) that the file at ``path`` imports anywhere."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[0] == PACKAGE and len(parts) > 1:
          found.add(parts[1])
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      parts = node.module.split(".")
      if parts[0] != PACKAGE:
        continue
      if len(parts) > 1:
        found.add(parts[1])
      else:
        found.update(a.name for a in node.names)
  return found & names


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """``{module: library modules it imports}`` (self-imports dropped)."""
  mods = modules(root)
  return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


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
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root)
  mods = modules(root)
  g = graph(root)
  cycle = find_cycle(g)
  if args.json:
    print(
      json.dumps(
        {
          "graph": {m: sorted(d) for m, d in g.items()},
          "cycle": cycle,
          "floors": None if cycle else floors(g),
          "longest_chain": None if cycle else longest_chain(g),
        }
      )
    )
    return 1 if cycle else 0
  lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
  init = root / "__init__.py"
  init_lines = len(init.read_text().splitlines()) if init.is_file() else 0
  print(f"{len(mods)} modules (+ __init__.py, {init_lines} lines), {sum(lines.values())} lines")
  if cycle:
    # Floors over the graph without deferred imports would hide it; report it plainly.
    print("import cycle:", " -> ".join(cycle))
    for m in sorted(mods):
      print(f"  {m:<14} {lines[m]:>5}  imports {', '.join(sorted(g[m])) or '-'}")
    return 1
  f = floors(g)
  for m in sorted(mods, key=lambda m: (f[m], m)):
    print(f"  floor {f[m]}  {m:<14} {lines[m]:>5}  imports {', '.join(sorted(g[m])) or '-'}")
  print(f"{max(f.values())} floors; longest chain: {' -> '.join(longest_chain(g))}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
