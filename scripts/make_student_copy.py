#!/usr/bin/env python3
"""Make a student copy of the repository: solution regions replaced by NotImplementedError stubs.

    python scripts/make_student_copy.py OUT_DIR [--force]

Copies the files git knows (tracked, plus untracked ones that are not ignored; without git: the
tree minus .git, .venv and __pycache__) into OUT_DIR. In every `.py` file of a lesson package, each
region from a `# BEGIN SOLUTION` line to its `# END SOLUTION` line (both included) becomes one line

    raise NotImplementedError("L1: RMSNorm.forward — see lessons/L1-contiguous.md")

at the BEGIN line's indentation, naming the lesson (from the package), the enclosing function or
`Class.method`, and the lesson text. Other files (notebooks, .cu/.cpp sources) are copied as they
are. Unbalanced or nested fences stop the script with the file and line. The same tests then grade
the student's work: `cd OUT_DIR && make test`, or `python -m pytest -m l1 --results-json results.json`.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LESSON_PACKAGES = {"l1_contiguous": "L1", "l2_paged": "L2", "l3_block_kernel": "L3",
                   "l5_eviction": "L5", "l8_prefix": "L8"}
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_SCOPE = re.compile(r"^(\s*)(?:async\s+def|def|class)\s+(\w+)")


class FenceError(ValueError):
    """A fence problem in one file; the message names the file and line."""


@dataclass
class Stubbed:
    path: str  # relative to the repository root
    regions: int


def strip_solutions(source: str, lesson: str, lesson_file: str, filename: str = "<source>") -> tuple[str, int]:
    """Replace each fenced region of `source` by a `raise NotImplementedError(...)` line.

    Returns (new source, number of regions). Raises FenceError on a nested, unclosed or unopened
    fence, naming `filename` and the 1-based line.
    """
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    open_at: int | None = None  # index of the open BEGIN line
    regions = 0
    for i, line in enumerate(lines):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if open_at is not None:
                raise FenceError(f"{filename}:{i + 1}: {BEGIN} inside the region opened at line {open_at + 1}")
            open_at = i
        elif marker.startswith(END):
            if open_at is None:
                raise FenceError(f"{filename}:{i + 1}: {END} without a {BEGIN} before it")
            indent = lines[open_at][: len(lines[open_at]) - len(lines[open_at].lstrip())]
            name = enclosing_name(lines, open_at) or Path(filename).stem
            out.append(f'{indent}raise NotImplementedError("{lesson}: {name} — see {lesson_file}")\n')
            open_at, regions = None, regions + 1
        elif open_at is None:
            out.append(line)
    if open_at is not None:
        raise FenceError(f"{filename}:{open_at + 1}: {BEGIN} is never closed by {END}")
    return "".join(out), regions


def enclosing_name(lines: list[str], index: int) -> str | None:
    """`func`, `Class.method` (or deeper) for the def/class scopes that enclose line `index`."""
    names: list[str] = []
    limit = _indent(lines[index])
    for line in reversed(lines[:index]):
        match = _SCOPE.match(line)
        if match and len(match.group(1)) < limit:
            names.append(match.group(2))
            limit = len(match.group(1))
            if limit == 0:
                break
    return ".".join(reversed(names)) or None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def lesson_file(root: Path, lesson: str) -> str:
    found = sorted((root / "lessons").glob(f"{lesson}-*.md"))
    return found[0].relative_to(root).as_posix() if found else f"lessons/{lesson}-*.md"


def repository_files(root: Path) -> list[str]:
    """Paths (relative, posix) of the files git knows, or of the tree when git is not there."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, check=True).stdout
        names = sorted({n for n in out.decode().split("\0") if n})
        return [n for n in names if (root / n).is_file()]  # deleted but still tracked: skip
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__"}
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and not skip & set(p.relative_to(root).parts))


def make_student_copy(root: Path, out_dir: Path) -> list[Stubbed]:
    """Copy `root` into `out_dir` (which must not exist) with solutions stripped; return what was stubbed."""
    files = repository_files(root)
    stubbed: list[Stubbed] = []
    planned: dict[str, str] = {}
    for rel in files:  # strip everything first, so a fence error leaves no half-made copy
        package = rel.split("/", 1)[0]
        if package in LESSON_PACKAGES and rel.endswith(".py"):
            lesson = LESSON_PACKAGES[package]
            text, n = strip_solutions((root / rel).read_text(encoding="utf-8"), lesson, lesson_file(root, lesson), rel)
            if n:
                try:
                    ast.parse(text, rel)
                except SyntaxError as exc:
                    raise FenceError(f"{rel}:{exc.lineno}: not valid Python once stubbed ({exc.msg})") from None
                planned[rel] = text
                stubbed.append(Stubbed(rel, n))
    for rel in files:
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel in planned:
            dest.write_text(planned[rel], encoding="utf-8")
            shutil.copymode(root / rel, dest)
        else:
            shutil.copy2(root / rel, dest)
    return stubbed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to create")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    if out_dir == REPO_ROOT or out_dir in REPO_ROOT.parents:
        print(f"error: {out_dir} holds the repository itself; choose another folder", file=sys.stderr)
        return 2
    if out_dir.exists() and any(out_dir.iterdir()):
        if not args.force:
            print(f"error: {out_dir} exists and is not empty; pass --force to replace it", file=sys.stderr)
            return 2
        shutil.rmtree(out_dir)
    try:
        stubbed = make_student_copy(REPO_ROOT, out_dir)
    except FenceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(s.regions for s in stubbed)
    for s in stubbed:
        print(f"stubbed {s.path}: {s.regions} region{'s' if s.regions != 1 else ''}")
    print(f"student copy in {out_dir}: {_count(out_dir)} files; {total} solution regions in "
          f"{len(stubbed)} files replaced by NotImplementedError")
    print(f"grade it: cd {out_dir} && make test")
    print("      or: python -m pytest -m l1 --results-json results.json")
    return 0


def _count(folder: Path) -> int:
    return sum(1 for _, _, names in os.walk(folder) for _ in names)


if __name__ == "__main__":
    sys.exit(main())
