#!/usr/bin/env python3
"""Count where a lesson package reaches into another lesson's private parts (issue: one public
KV-manager contract). Three kinds, found in the source by its syntax tree:

  override  a class in lesson X defines `_name`, and a class of another lesson that X's class
            derives from defines `_name` too (X changes an earlier lesson's insides)
  import    lesson X imports a `_name` from another lesson's package
  reach     lesson X reads or writes `something._name` where `_name` is defined (a method, a
            function, a `self._name = ...`) by an earlier lesson and never in X's own package;
            `super()._name` is part of an override, not counted again

Dunder names are public. `python scripts/count_private_reaches.py` prints the total and each
finding; `--summary` prints one line per lesson and kind.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lesson_packages(root: Path = ROOT) -> list[Path]:
    return sorted((p for p in root.glob("l[0-9]*_*") if (p / "__init__.py").exists()),
                  key=lambda p: int(p.name[1:].split("_")[0]))


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Finding:
    kind: str  # override, import, reach
    lesson: str  # the package that reaches
    name: str
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.kind:8} {self.lesson:22} {self.name:32} {self.where}"


class PackageIndex:
    """What each lesson package defines: its classes (name -> bases, private methods) and the
    private names it defines anywhere (methods, functions, `self._x =` attributes)."""

    def __init__(self, packages: list[Path]):
        self.trees = {pkg.name: [(f, ast.parse(f.read_text(), str(f))) for f in sorted(pkg.glob("*.py"))]
                      for pkg in packages}
        self.classes: dict[str, tuple[str, list[str], set[str]]] = {}  # class name -> (package, bases, private defs)
        self.defines: dict[str, set[str]] = collections.defaultdict(set)  # package -> private names
        for pkg, files in self.trees.items():
            for _, tree in files:
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                                 for b in node.bases]
                        methods = {n.name for n in node.body
                                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_private(n.name)}
                        self.classes.setdefault(node.name, (pkg, bases, methods))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_private(node.name):
                        self.defines[pkg].add(node.name)
                    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for target in targets:
                            for sub in ast.walk(target):
                                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                                        and sub.value.id == "self" and is_private(sub.attr)):
                                    self.defines[pkg].add(sub.attr)
                                if isinstance(sub, ast.Name) and is_private(sub.id):
                                    self.defines[pkg].add(sub.id)

    def owner(self, name: str) -> str | None:
        """The first lesson (in course order) that defines private `name`."""
        return next((pkg for pkg in self.trees if name in self.defines[pkg]), None)

    def ancestors(self, class_name: str) -> list[tuple[str, str, set[str]]]:
        """(class, package, private methods) of every known base, transitively."""
        seen, out, todo = set(), [], list(self.classes.get(class_name, ("", [], set()))[1])
        while todo:
            name = todo.pop()
            if name in seen or name not in self.classes:
                continue
            seen.add(name)
            pkg, bases, methods = self.classes[name]
            out.append((name, pkg, methods))
            todo.extend(bases)
        return out


def is_super_call(node: ast.AST) -> bool:
    """`super()` (an override calling the version it overrides: counted as the override)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def findings(root: Path = ROOT) -> list[Finding]:
    packages = lesson_packages(root)
    names = {p.name for p in packages}
    index = PackageIndex(packages)
    out: list[Finding] = []
    for pkg, files in index.trees.items():
        for path, tree in files:
            rel = path.relative_to(root)
            for node in ast.walk(tree):
                where = f"{rel}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ClassDef):
                    own = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    for base, base_pkg, methods in index.ancestors(node.name):
                        for name in sorted(methods & own.keys()):
                            if base_pkg != pkg:
                                out.append(Finding("override", pkg, f"{base}.{name}", f"{rel}:{own[name].lineno}"))
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in names:
                    if node.module.split(".")[0] != pkg:
                        out.extend(Finding("import", pkg, f"{node.module}.{a.name}", where)
                                   for a in node.names if is_private(a.name))
                elif isinstance(node, ast.Attribute) and is_private(node.attr) and not is_super_call(node.value):
                    owner = index.owner(node.attr)
                    if owner is not None and owner != pkg and node.attr not in index.defines[pkg]:
                        out.append(Finding("reach", pkg, f"{owner}: {node.attr}", where))
    # a method that overrides several ancestors' versions is one change: one finding per definition
    unique: dict[tuple, Finding] = {}
    for f in out:
        unique.setdefault((f.kind, f.where) if f.kind == "override" else (f.kind, f.where, f.name), f)
    return list(unique.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="one line per lesson and kind")
    args = parser.parse_args(argv)
    found = findings()
    if args.summary:
        counts = collections.Counter((f.lesson, f.kind) for f in found)
        for (lesson, kind), n in sorted(counts.items()):
            print(f"{lesson:22} {kind:8} {n}")
    else:
        for f in found:
            print(f)
    kinds = collections.Counter(f.kind for f in found)
    print(f"total {len(found)}: {kinds['override']} overrides, {kinds['import']} imports, {kinds['reach']} reaches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
