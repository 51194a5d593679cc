#!/usr/bin/env python3
"""Make a student copy of the repository: solution regions replaced by NotImplementedError stubs.

    python scripts/make_student_copy.py OUT_DIR [--force] [--keep L1,L2]

Copies the files git tracks (as they are in the working tree; without git: the tree minus .git,
.venv and __pycache__) into OUT_DIR, leaving out what is for instructors only (`instructor/`, and
the course's own tests: modules marked `course` as a whole). A file git neither tracks nor ignores
(a draft `*_solution.md`) is left out too, and named: `git add` what students should get. In every `.py`
file of a lesson package, each region from a `# BEGIN SOLUTION` line to its `# END SOLUTION` line (both included)
becomes one line

    raise NotImplementedError("L2: reserve — see lessons/L2-paged.md §2.3")

at the BEGIN line's indentation, naming the lesson (from the package), the enclosing function or
`Class.method`, the lesson text and the section that explains it (from the table of the lesson's
"What you write" section). The copy's README is the repository's without its "For instructors"
section. `--keep L1` leaves L1's regions in place (a copy in which the student
finished L1). Other files (notebooks, .cu/.cpp sources) are copied as they are. Unbalanced or
nested fences stop the script with the file and line. The same tests then grade the student's
work: in OUT_DIR, `make setup`, `source .venv/bin/activate`, then `pytest -m l1`.

OUT_DIR may not be the repository, hold it, or lie inside it (unless git ignores it, as
student-copy/). The copy is built in a temporary folder beside OUT_DIR (`.OUT_DIR.partial-<pid>-*`)
and renamed into place, so Ctrl-C or a full disk never leaves a half copy; one that a kill -9 left
behind is removed by the next run. `--force` updates a folder this script made (it leaves
`.student-copy` in it, listing every file it wrote with its sha256) in place: the files it wrote
are replaced, files it wrote before and no longer writes are removed, and everything else (a
`.git` the instructor made, files the instructor added) is kept; it refuses if one of those would
be overwritten, and names it. A file it wrote that was edited since is not lost: it is kept as
`FILE.orig-edited` (one line names each), then replaced. Every delete stays inside OUT_DIR: a
marker that names a path outside it (`/abs/path`, `../x`, through a link) or in its `.git` is
refused.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every `lN_<name>/` package at the root is a lesson (harness/grading.py reads the same rule):
# {"l1_contiguous": "L1", ...}. A new lesson's fences are replaced without editing this script.
LESSON_PACKAGES = {p.parent.name: p.parent.name.split("_")[0].upper()
                   for p in sorted(REPO_ROOT.glob("l[0-9]*_*/__init__.py"),
                                   key=lambda p: int(p.parent.name[1:].split("_")[0]))}
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
MARKER = ".student-copy"  # written into every copy, with the files written: --force updates only those
MARKER_HEADER = ("made by scripts/make_student_copy.py; --force replaces the files listed below (sha256 as "
                 "written, two spaces, path) and keeps the rest\n")
_MARKED = re.compile(r"([0-9a-f]{64})  (.+)")  # a marker line with a hash; older markers list bare paths
EDITED = ".orig-edited"  # a file the script wrote and someone edited since: kept under this suffix
INSTRUCTOR_ONLY = ("instructor/",)  # path prefixes left out of the copy
INSTRUCTOR_SECTION = "## For instructors"  # the README's section the copy's README leaves out
# A test module marked `course` as a whole (the course's own checks: model files, the copy, the
# lessons' quotes) is instructor-only too: in a copy it could only fail because of the stubs.
_COURSE_MODULE = re.compile(r"^pytestmark\s*=.*\bmark\.course\b", re.M)
_SCOPE = re.compile(r"^(\s*)(?:async\s+def|def|class)\s+(\w+)")
# A row of a lesson's "What you write" table: | `Name.method` | `file.py` | §2.3 | ...
_ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|.*?(§\d+(?:\.\d+)*)")


class FenceError(ValueError):
    """A fence problem in one file; the message names the file and line."""


class Refused(ValueError):
    """OUT_DIR cannot be updated without losing or touching what is not the script's; the message
    says what and how to fix it."""


@dataclass
class Stubbed:
    path: str  # relative to the repository root
    regions: int


def strip_solutions(source: str, lesson: str, lesson_file: str, filename: str = "<source>",
                    sections: dict[str, str] | None = None) -> tuple[str, int]:
    """Replace each fenced region of `source` by a `raise NotImplementedError(...)` line.

    `sections` maps a function's name (`reserve`, `BlockAllocator.free`) to the lesson section
    that explains it (`§2.3`), named in the message when known. Returns (new source, number of
    regions). Raises FenceError on a nested, unclosed or unopened fence, naming `filename` and
    the 1-based line.
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
            where = f"{lesson_file} {sections[name]}" if name in (sections or {}) else lesson_file
            out.append(f'{indent}raise NotImplementedError("{lesson}: {name} — see {where}")\n')
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


def lesson_sections(root: Path, lesson_path: str) -> dict[str, str]:
    """Function name -> section, from the table of the lesson's "What you write" section."""
    path = root / lesson_path
    if not path.is_file():
        return {}
    sections, inside = {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            inside = line[3:].strip().lower().startswith("what you write")
        elif inside and (match := _ROW.match(line)):
            sections[match.group(1)] = match.group(2)
    return sections


def repository_files(root: Path) -> list[str]:
    """Paths (relative, posix) of the files git tracks, or of the tree when git is not there. Only
    tracked ones: an untracked file (a draft answer, a bundle with hidden tests) is the
    instructor's until they `git add` it (`untracked_files` names them)."""
    names = _git_files(root, "--cached")
    if names is None:
        skip = {".git", ".venv", ".venv-clients", "__pycache__"}
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and not skip & set(p.relative_to(root).parts))
    return [n for n in names if (root / n).is_file()]  # deleted but still tracked: skip


def untracked_files(root: Path) -> list[str]:
    """Files git neither tracks nor ignores: left out of the copy ([] without git)."""
    return [n for n in _git_files(root, "--others", "--exclude-standard") or [] if (root / n).is_file()]


def untracked_note(root: Path) -> str | None:
    """The line that names the untracked files left out, or None when there are none."""
    left_out = untracked_files(root)
    if not left_out:
        return None
    shown = ", ".join(left_out[:10]) + (f", ... ({len(left_out) - 10} more)" if len(left_out) > 10 else "")
    return (f"left out {len(left_out)} file(s) git does not track: {shown} (git add what students "
            f"should get, then run again)")


def _git_files(root: Path, *options: str) -> list[str] | None:
    """`git ls-files` with `options` in `root`, sorted; None when git or the repository is not there."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", *options], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sorted({n for n in out.decode().split("\0") if n})


def instructor_only(root: Path, rel: str) -> bool:
    if rel.startswith(INSTRUCTOR_ONLY):
        return True
    return (rel.startswith("tests/test_") and rel.endswith(".py")
            and bool(_COURSE_MODULE.search((root / rel).read_text(encoding="utf-8"))))


def make_student_copy(root: Path, out_dir: Path, keep: frozenset[str] = frozenset()) -> list[Stubbed]:
    """Copy `root` into `out_dir` (new or empty) with solutions stripped, except those of the
    lessons in `keep` ("L1", ...); return what was stubbed. The marker lists every file written."""
    files = [rel for rel in repository_files(root) if not instructor_only(root, rel)]
    stubbed: list[Stubbed] = []
    planned: dict[str, str] = {}
    for rel in files:  # strip everything first, so a fence error leaves no half-made copy
        package = rel.split("/", 1)[0]
        if package in LESSON_PACKAGES and LESSON_PACKAGES[package] not in keep and rel.endswith(".py"):
            lesson = LESSON_PACKAGES[package]
            text_file = lesson_file(root, lesson)
            text, n = strip_solutions((root / rel).read_text(encoding="utf-8"), lesson, text_file, rel,
                                      lesson_sections(root, text_file))
            if n:
                try:
                    ast.parse(text, rel)
                except SyntaxError as exc:
                    raise FenceError(f"{rel}:{exc.lineno}: not valid Python once stubbed ({exc.msg})") from None
                planned[rel] = text
                stubbed.append(Stubbed(rel, n))
    if "README.md" in files:
        planned["README.md"] = student_readme((root / "README.md").read_text(encoding="utf-8"))
    for rel in files:
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel in planned:
            dest.write_text(planned[rel], encoding="utf-8")
            shutil.copymode(root / rel, dest)
        else:
            shutil.copy2(root / rel, dest)
    write_marker(out_dir, {rel: {file_hash(out_dir / rel)} - {None} for rel in files})
    return stubbed


def file_hash(path: Path) -> str | None:
    """sha256 of a regular file's bytes; None for anything else (a link, a folder, gone)."""
    if path.is_symlink() or not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(out_dir: Path, written: dict[str, set[str]]) -> None:
    """List every file written with the hash(es) of what was written (none: not known)."""
    lines = [f"{h}  {rel}" if h else rel for rel in sorted(written) for h in sorted(written[rel]) or [None]]
    (out_dir / MARKER).write_text(MARKER_HEADER + "".join(f"{line}\n" for line in lines), encoding="utf-8")


def written_files(out_dir: Path) -> dict[str, set[str]] | None:
    """The files the marker says this script wrote, each with the hashes its content had when
    written (empty: a marker too old to say); None for a marker of a version that listed nothing
    (then only files the new copy writes are replaced). Refused if one lies outside `out_dir`."""
    lines = (out_dir / MARKER).read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("made by scripts/make_student_copy.py; --force replaces"):
        return None
    written: dict[str, set[str]] = {}
    for line in filter(None, lines[1:]):
        match = _MARKED.fullmatch(line)
        rel, digest = (match.group(2), match.group(1)) if match else (line, None)
        written.setdefault(rel, set()).update({digest} - {None})
    if outside := [rel for rel in written if escapes(out_dir, rel)]:
        more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
        raise Refused(f"{out_dir / MARKER} lists {outside[0]!r}{more}, outside {out_dir} (or in its .git); "
                      f"--force deletes only inside the copy: remove those lines from the marker, then run again")
    return written


def escapes(folder: Path, rel: str) -> bool:
    """Would `folder / rel` lie outside `folder` (an absolute path, `..`, a link on the way that leads
    out) or inside its `.git`? What --force writes or deletes must not."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or parts[0] == ".git":
        return True
    root, parent = folder.resolve(), (folder / rel).parent.resolve()
    return parent != root and root not in parent.parents


def existing_files(folder: Path) -> set[str]:
    """Every file (and link) under `folder`, relative, `.git` left out."""
    found = set()
    for dirpath, dirnames, names in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) == folder and d == ".git")]
        found.update((Path(dirpath) / n).relative_to(folder).as_posix() for n in names)
    return found - {MARKER}


@dataclass
class Update:
    written: int  # files replaced or added
    removed: list[str]  # written by an earlier copy, not by this one
    kept: list[str]  # not written by this script
    edited: dict[str, str]  # written by an earlier copy, edited since -> where the edit was kept


def update_in_place(new: Path, out_dir: Path) -> Update:
    """Move the freshly built copy `new` over `out_dir`, a copy made earlier. Refuses (Refused)
    before changing anything if a file the script did not write would be overwritten, or a path
    leads out of `out_dir`. A file it wrote whose content changed since is renamed FILE.orig-edited
    first (`keep_edited`)."""
    new_written = written_files(new)
    new_files = set(new_written)
    ours_before = written_files(out_dir)
    before = ours_before if ours_before is not None else {}
    present = existing_files(out_dir)
    foreign = present - (set(before) if ours_before is not None else new_files)
    clash = sorted(foreign & new_files)
    if clash:
        raise Refused(f"{out_dir} holds {len(clash)} file(s) this script did not write at paths the copy "
                      f"writes ({', '.join(clash[:3])}); move them away, then run again")
    if through := sorted(rel for rel in new_files if escapes(out_dir, rel)):
        raise Refused(f"{out_dir / through[0]} lies through a link that leads out of {out_dir}; replace the "
                      f"link by a folder, then run again")
    stale = sorted(set(before) - new_files)
    edited = sorted(rel for rel in present & set(before) if before[rel] and file_hash(out_dir / rel) not in before[rel])
    # A Ctrl-C or kill from here on: a rerun still knows every file, and takes both the old and
    # the new content of each for its own (what it moved already is not seen as an edit).
    write_marker(out_dir, {rel: new_written.get(rel, set()) | before.get(rel, set()) for rel in new_files | set(stale)})
    kept_as = {rel: keep_edited(out_dir, rel) for rel in edited}
    for rel in new_files:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(new / rel, out_dir / rel)
    for rel in stale:
        (out_dir / rel).unlink(missing_ok=True)
    write_marker(out_dir, new_written)
    return Update(len(new_files), stale, sorted(foreign), kept_as)


def keep_edited(out_dir: Path, rel: str) -> str:
    """Rename `rel`, edited since the script wrote it, to `rel.orig-edited` (-2, -3, ... when an
    earlier edit holds that name); returns the new name."""
    backup, n = rel + EDITED, 1
    while (out_dir / backup).exists() or (out_dir / backup).is_symlink():
        n += 1
        backup = f"{rel}{EDITED}-{n}"
    os.rename(out_dir / rel, out_dir / backup)
    return backup


def destination_problem(out_dir: Path, force: bool) -> str | None:
    """Why `out_dir` must not be written (or, with --force, replaced), or None. Never the repository,
    a folder of it that git would copy, or a folder this script did not make."""
    if out_dir == REPO_ROOT or out_dir in REPO_ROOT.parents:
        return f"{out_dir} holds the repository itself; choose another folder"
    if REPO_ROOT in out_dir.parents and not _git_ignored(out_dir):
        return (f"{out_dir} is inside the repository (and not ignored by git); choose a folder outside it, "
                f"or student-copy/, which git ignores")
    if out_dir.exists() and not out_dir.is_dir():
        return f"{out_dir} is a file; choose a folder"
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            return f"{out_dir} exists and is not empty; pass --force to update it"
        if not (out_dir / MARKER).is_file():
            return (f"{out_dir} is not a student copy made by this script (it has no {MARKER}), so --force "
                    f"will not touch it; choose another folder")
        try:
            written_files(out_dir)  # refused now, before a build, if it names paths outside the copy
        except Refused as exc:
            return str(exc)
    return None


def _git_ignored(path: Path) -> bool:
    """Would git ignore `path`, whether or not it exists yet? (A pattern ending in `/` matches only
    an existing directory, so a folder not made yet is also asked about as `path/x`.)"""
    try:
        return any(subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q", "--no-index", str(p)],
                                  capture_output=True).returncode == 0 for p in (path, path / "x"))
    except OSError:  # no git: nothing inside the repository is known to be safe
        return False


def student_readme(text: str) -> str:
    """The README without its instructors' section and without the layout's `instructor/` line."""
    lines, skipping = [], False
    for line in text.split("\n"):
        if line.startswith("## "):
            skipping = line.strip() == INSTRUCTOR_SECTION
        if not skipping and not line.startswith("instructor/"):
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to create")
    parser.add_argument("--force", action="store_true",
                        help="update OUT_DIR in place if this script made it (keeps .git and files it did not "
                             f"write; a file it wrote and someone edited since is kept as FILE{EDITED}, one line "
                             "each, then replaced)")
    parser.add_argument("--keep", default="", metavar="L1,L2",
                        help="lessons whose solutions stay in the copy (e.g. to check the grading)")
    args = parser.parse_args(argv)
    keep = frozenset(x.strip().upper() for x in args.keep.split(",") if x.strip())
    if unknown := keep - set(LESSON_PACKAGES.values()):
        print(f"error: --keep names no lesson {', '.join(sorted(unknown))}; choose from "
              f"{', '.join(LESSON_PACKAGES.values())}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir).resolve()
    if problem := destination_problem(out_dir, args.force):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    try:
        return build(out_dir, keep)
    except KeyboardInterrupt:
        print(f"error: interrupted; {out_dir} is as it was (or, during an update, each file whole: run "
              f"again with --force to finish)", file=sys.stderr)
        return 2
    except (FenceError, Refused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}; "
              f"{out_dir} is as it was: free some space or fix the permissions, then run again", file=sys.stderr)
        return 2


def build(out_dir: Path, keep: frozenset[str]) -> int:
    """Build the copy in a temporary folder beside `out_dir`, then rename it into place (a new or
    empty `out_dir`) or update `out_dir` in place (a copy made before)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_partials(out_dir):
        print(f"removed {stale}, a half-built copy that an interrupted run left behind")
    tmp = Path(tempfile.mkdtemp(prefix=f"{partial_prefix(out_dir)}{os.getpid()}-", dir=out_dir.parent))
    try:
        stubbed = make_student_copy(REPO_ROOT, tmp, keep)
        if out_dir.exists() and any(out_dir.iterdir()):
            done = update_in_place(tmp, out_dir)
            for rel, backup in done.edited.items():
                print(f"kept your edit of {rel} as {backup} (it differed from what this script wrote); "
                      f"{rel} is the new version")
            kept = done.kept
            print(f"updated {out_dir} in place: {done.written} files written, {len(done.removed)} removed (written "
                  f"by an earlier copy, gone now), {len(kept)} kept (not written by this script"
                  f"{': ' + ', '.join(kept[:3]) + (', ...' if len(kept) > 3 else '') if kept else ''})"
                  f"{'; .git kept' if (out_dir / '.git').exists() else ''}")
        else:
            if out_dir.exists():
                out_dir.rmdir()
            os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if note := untracked_note(REPO_ROOT):
        print(note)
    total = sum(s.regions for s in stubbed)
    for s in stubbed:
        print(f"stubbed {s.path}: {s.regions} region{'s' if s.regions != 1 else ''}")
    print(f"student copy in {out_dir}: {_count(out_dir)} files; {total} solution regions in "
          f"{len(stubbed)} files replaced by NotImplementedError")
    print(f"grade it: cd {out_dir} && make test   (one lesson: make check-l1, or pytest -m l1)")
    return 0


def partial_prefix(out_dir: Path) -> str:
    """How the temporary folders beside `out_dir` begin: `.<name>.partial-`, then the pid that made it."""
    return f".{out_dir.name}.partial-"


def remove_stale_partials(out_dir: Path) -> list[Path]:
    """Remove the temporary folders of `out_dir` that a killed run (kill -9, a power cut) left beside
    it: those named as `build` names them whose process is gone (or, made by an older version,
    that name none). Nothing else is touched: not another target's, not a live run's."""
    pattern = re.compile(re.escape(partial_prefix(out_dir)) + r"(?:(\d+)-)?[a-z0-9_]{8}")
    removed = []
    for path in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and not (match.group(1) and _alive(int(match.group(1)))):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _count(folder: Path) -> int:
    return sum(1 for _, _, names in os.walk(folder) for _ in names)


if __name__ == "__main__":
    sys.exit(main())
