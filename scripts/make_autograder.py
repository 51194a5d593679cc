#!/usr/bin/env python3
"""Build the Gradescope autograder bundle: a zip of the student copy (no solutions), plus
`setup.sh`, `run_autograder` and the list of hidden tests.

    python scripts/make_autograder.py autograder.zip [--hidden-tests FILE]

Upload the zip as the assignment's autograder ("Zip file upload"). Gradescope unpacks it in
/autograder/source and runs `setup.sh` once; then, for each submission, `run_autograder` grades
the lesson packages the student uploaded (see instructor/autograder/run_autograder) and writes
/autograder/results/results.json. The bundle holds the student copy, not this repository, so no
solution is in it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = REPO_ROOT / "instructor" / "autograder"
EXECUTABLE = 0o100755 << 16  # zip external attributes of a regular file with mode 755


def _student_copy_tool():
    name = "make_student_copy"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses need it
    spec.loader.exec_module(module)
    return module


def build(zip_path: Path, hidden_tests: Path) -> int:
    """Write the bundle to `zip_path`; return the number of files in it."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "source"
        _student_copy_tool().make_student_copy(REPO_ROOT, copy)
        (copy / "hidden_tests.txt").write_text(hidden_tests.read_text(encoding="utf-8"), encoding="utf-8")
        files = sorted(p for p in copy.rglob("*") if p.is_file())
        with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in ("setup.sh", "run_autograder"):
                info = zipfile.ZipInfo(name)
                info.external_attr = EXECUTABLE
                zf.writestr(info, (TEMPLATES / name).read_bytes(), zipfile.ZIP_DEFLATED)
            for path in files:
                zf.write(path, path.relative_to(copy).as_posix())
    return len(files) + 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("zip_path", help="the zip to write, e.g. autograder.zip")
    parser.add_argument("--hidden-tests", default=str(REPO_ROOT / "instructor" / "hidden_tests.txt"),
                        help="node-id prefixes hidden until grades are published (default: %(default)s)")
    args = parser.parse_args(argv)
    hidden = Path(args.hidden_tests)
    if not hidden.is_file():
        print(f"error: {hidden} does not exist; pass --hidden-tests FILE", file=sys.stderr)
        return 2
    count = build(Path(args.zip_path).resolve(), hidden)
    print(f"wrote {args.zip_path}: {count} files (student copy + setup.sh + run_autograder)")
    print("upload it on Gradescope as the autograder; students submit their lesson packages "
          "(l1_contiguous/ ... l8_prefix/, l11_serve/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
