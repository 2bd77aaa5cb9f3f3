"""Counts the places where code branches on a method's name (read with ast; imports nothing).

Usage, from a checkout's root::

  python -m benchmarks.method_branches [--list] [--json] [--names a,b,...] [--repo DIR]

A *method-name site* is one of:

  cmp    a comparison (==, !=, in, not in) with a method-name string literal on either side,
         or with a tuple / list / set literal holding one (``cfg.method == "fedlap"``,
         ``method in ("fedprox", "dp_fedprox")``);
  list   a comparison whose other side names one of the method-list constants
         (``cfg.method in DP_BASELINE_METHODS``, ``self.method in DP_METHODS``);
  key    a dict key that is a method-name string literal (``{"fedlap": "FedLAP", ...}``);
  call   an argument that is a method-name literal passed to a function whose result
         depends on it (``method_label("fedlap", ...)``, ``baseline_config("fedavg", ...)``);
  type   ``isinstance(x, C)`` where C is one method's config class (a dispatch by type);
  tstate the same with one method's state or metrics class (a front end testing for
         FedLAP's ``RoundMetrics``);
  check  the same ``isinstance`` inside a ``require(...)``: a method validating its own
         argument, not a branch (listed, never counted).

Counted (``cmp + list + type``) are the branches; ``key`` and ``call`` sites are listed only.
Two figures:

* the *issue rule*: counted sites outside ``fedlap_jax/config.py``, which held the method
  lists and labels before the registry (the figure the redesign started from);
* the *registry rule*: counted sites outside the registry and the methods' own modules,
  ``fedlap_jax/methods/`` (the figure that must reach 0: no front end and no shared module
  reads a method's name).

Method names: ``--names`` (comma-separated; the structure tests pass the registry's), else
those the methods' modules give (``name=`` and ``algorithm_name=`` literals and the keys of
their ``LABELS`` tables), and in a tree from before the registry the keys of ``METHOD_LABELS``
in ``fedlap_jax/config.py`` (the twelve methods plus FedLAP's run name ``fedlap_dp``).
Files: every ``.py`` under fedlap_jax/, experiments/ (configs included) and fedlap_flower/;
tests and benchmarks are left out.

Output: counts per kind and per file and the two figures; ``--list`` prints every site as
``file:line kind text``; ``--json`` one JSON object (``sites``, ``issue_rule``,
``registry_rule``, ``by_folder``: the registry rule's sites per top-level folder).
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import pathlib
import sys

LIST_CONSTANTS = {
  "METHODS",
  "BASELINE_METHODS",
  "DP_BASELINE_METHODS",
  "ONE_SHOT_METHODS",
  "DP_ONE_SHOT_METHODS",
  "SYNTHETIC_METHODS",
  "DP_METHODS",
  "PROX_METHODS",
}
CONFIG_CLASSES = {"FedLAPConfig", "BaselineConfig", "FedDMConfig", "OneShotConfig"}
# One method's state or metrics types: a front end that tests for them branches on the method.
METHOD_TYPES = CONFIG_CLASSES | {
  "RoundMetrics",
  "FedLAPState",
  "BaselineState",
  "BaselineRoundMetrics",
  "FedDMState",
  "OneShotState",
  "OneShotMetrics",
}
LABEL_CALLS = {"method_label", "baseline_config", "get_baseline_config"}
FOLDERS = ("fedlap_jax", "experiments", "fedlap_flower")
COUNTED = ("cmp", "list", "type")
# Where the method lists and labels lived before the registry (left out by the issue rule).
OLD_REGISTRY = "fedlap_jax/config.py"
# The registry and the methods' own modules (left out by the registry rule).
METHODS_DIR = "fedlap_jax/methods/"


def _label_keys(path: pathlib.Path, table: str) -> set[str]:
  """The string keys of the dict literal assigned to ``table`` in ``path`` (read with ast)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if (
      isinstance(node, ast.Assign)
      and any(isinstance(t, ast.Name) and t.id == table for t in node.targets)
      and isinstance(node.value, ast.Dict)
    ):
      names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
  return names


def _method_names(path: pathlib.Path) -> set[str]:
  """The string literals a methods module gives a ``Method(...)`` as ``name=`` or
  ``algorithm_name=`` (FedLAP's ``fedlap_dp``) and the keys of its ``LABELS`` table (a
  family's names)."""
  names = _label_keys(path, "LABELS")
  for call in ast.walk(ast.parse(path.read_text())):
    func = getattr(call, "func", None)
    if not (
      isinstance(call, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "Method"
    ):
      continue
    for kw in call.keywords:
      if kw.arg in ("name", "algorithm_name"):
        names |= {
          c.value
          for c in ast.walk(kw.value)
          if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
  return names


def default_names(root: pathlib.Path) -> set[str]:
  """The methods' names, read with ast: of a tree with a registry, from its methods' modules
  (``fedlap_jax/methods/``); of an older one, the keys of ``METHOD_LABELS`` in
  ``fedlap_jax/config.py``. Empty if neither is there."""
  names = set()
  old = root / OLD_REGISTRY
  if old.is_file():
    names |= _label_keys(old, "METHOD_LABELS")
  for path in sorted((root / METHODS_DIR).glob("*.py")):
    names |= _method_names(path)
  return names


def sites(path: pathlib.Path, rel: str, names: set[str]) -> list[tuple[str, int, str, str]]:
  """Every method-name site of one file: ``(file, line, kind, text)``."""
  source = path.read_text()
  tree = ast.parse(source, rel)
  lines = source.splitlines()
  found = []
  validated = set()  # isinstance calls that are the first argument of require(...)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and node.args:
      validated.add(node.args[0])

  def literal(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return any(literal(e) for e in node.elts)
    return False

  def names_list(node) -> bool:
    if isinstance(node, ast.Name):
      return node.id in LIST_CONSTANTS
    if isinstance(node, ast.Attribute):
      return node.attr in LIST_CONSTANTS
    if isinstance(node, ast.BinOp):  # ("fedlap", "feddm") + ONE_SHOT_METHODS
      return names_list(node.left) or names_list(node.right)
    return False

  def add(node, kind):
    found.append((rel, node.lineno, kind, lines[node.lineno - 1].strip()[:110]))

  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      if not all(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops):
        continue
      sides = [node.left, *node.comparators]
      if any(literal(s) for s in sides):
        add(node, "cmp")
      elif any(names_list(s) for s in sides):
        add(node, "list")
    elif isinstance(node, ast.Dict):
      for k in node.keys:
        if k is not None and literal(k):
          add(k, "key")
    elif isinstance(node, ast.Call):
      fn = node.func
      name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
      if name == "isinstance" and len(node.args) == 2:
        cls = node.args[1]
        cname = cls.id if isinstance(cls, ast.Name) else getattr(cls, "attr", None)
        if cname in METHOD_TYPES:
          kind = "type" if cname in CONFIG_CLASSES else "tstate"
          add(node, "check" if node in validated else kind)
      elif name in LABEL_CALLS and any(literal(a) for a in node.args):
        add(node, "call")
  return found


def collect(root: pathlib.Path, names: set[str]) -> list[tuple[str, int, str, str]]:
  """Every site under the three folders of ``root``, sorted."""
  out = []
  for folder in FOLDERS:
    for path in sorted((root / folder).rglob("*.py")):
      if "__pycache__" not in path.parts:
        out += sites(path, path.relative_to(root).as_posix(), names)
  return sorted(out)


def figures(all_sites) -> dict:
  """The two rules' counts (see the module docstring) and the registry rule per folder."""
  counted = [s for s in all_sites if s[2] in COUNTED]
  registry_rule = [s for s in counted if not s[0].startswith(METHODS_DIR)]
  by_folder = collections.Counter(s[0].split("/")[0] for s in registry_rule)
  return {
    "issue_rule": len([s for s in counted if s[0] != OLD_REGISTRY]),
    "registry_rule": len(registry_rule),
    "by_folder": {f: by_folder.get(f, 0) for f in FOLDERS},
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repo", default=".")
  ap.add_argument("--list", action="store_true", help="print every site")
  ap.add_argument("--json", action="store_true", help="print one JSON object")
  ap.add_argument("--names", default=None, help="comma-separated method names")
  args = ap.parse_args(argv)
  root = pathlib.Path(args.repo)
  names = set(args.names.split(",")) if args.names else default_names(root)
  if not names:
    print("no method names: pass --names (no fedlap_jax/methods/ and no METHOD_LABELS)")
    return 2
  all_sites = collect(root, names)
  fig = figures(all_sites)
  if args.json:
    print(json.dumps({"names": sorted(names), "sites": all_sites, **fig}))
    return 0
  if args.list:
    for rel, line, kind, text in all_sites:
      print(f"{rel}:{line}  {kind:6s}  {text}")
    print()
  by_kind = collections.Counter(k for _, _, k, _ in all_sites)
  by_file = collections.Counter(r for r, _, k, _ in all_sites if k in COUNTED)
  print("by kind:", dict(sorted(by_kind.items())))
  print("counted (cmp + list + type) by file:")
  for rel, n in sorted(by_file.items(), key=lambda t: (-t[1], t[0])):
    print(f"  {n:3d}  {rel}")
  print(f"issue rule (counted, outside {OLD_REGISTRY}): {fig['issue_rule']}")
  print(
    f"registry rule (counted, outside {METHODS_DIR}): {fig['registry_rule']}  {fig['by_folder']}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
