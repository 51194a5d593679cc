"""Re-run every command whose output a lesson quotes and report the quoted lines it no longer prints.

    python scripts/check_lesson_quotes.py            # report; exit 1 on any mismatch
    python scripts/check_lesson_quotes.py --update   # rewrite the quoted lines from fresh output

The quote format and the matching rules are in harness/lesson_quotes.py. --update rewrites a
mismatched line with the output line in its place (or the one with the same `name:`); lines
abridged with `...` and lines it cannot place are listed for a hand edit. Read the diff before
committing: the text around a quote may cite the old figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import lesson_quotes as lq  # noqa: E402


def main(argv: list[str] | None = None, runner=lq.run_command) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--update", action="store_true", help="rewrite mismatched quoted lines from fresh output")
    p.add_argument("lessons", nargs="*", type=Path, help="lesson files (default: lessons/L*.md)")
    args = p.parse_args(argv)
    lessons = [path.resolve() for path in args.lessons] or None
    outputs: dict = {}  # each command runs once, however many passes --update makes
    quotes, problems, mismatches = lq.check(lessons, runner, outputs)
    while args.update and mismatches:  # one line per block and pass: a fixed line realigns the rest
        rewritten, _ = lq.update(mismatches)
        if not rewritten:
            break
        print(f"rewrote {rewritten} line(s)")
        quotes, problems, mismatches = lq.check(lessons, runner, outputs)
    for line in problems + [str(m) for m in mismatches]:
        print(line)
    commands = len({q.command for q in quotes})
    print(f"{len(quotes)} quoted blocks from {commands} commands: "
          f"{len(mismatches)} mismatched line(s), {len(problems)} problem(s) of form")
    return 1 if problems or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
