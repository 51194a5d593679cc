"""Quoted output in the lessons, re-checked against the commands that print it.

A quote in `lessons/*.md` is a line naming the command, then a fenced `text` block:

    Output of `python scripts/l2_smoke.py --num-blocks 5`:

    ```text
    error: the pool of 5 blocks ran out ...
    ```

Checking a quote runs its command (once per distinct command, on the CPU, in this process) and
requires every quoted line in the output. Consecutive quoted lines must be consecutive output
lines; a line holding only `...` elides any number of lines, and `...` inside a line stands for
any text (a path, the rest of a long id list). Every ```` ```text ```` block must follow such a
command line: a drawing belongs in a plain ```` ``` ```` block.

`python scripts/check_lesson_quotes.py [--update]` is the maintainer's command.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
ELISION = "..."
# "Output of `CMD`:" — also "Abridged output of `CMD` (CPU, float32):", at the end of the paragraph
# right above the block (it may wrap over several lines), ending with a colon.
COMMAND_LINE = re.compile(r"[Oo]utput of `(?P<cmd>python [^`]+)`[^`]*:\s*$")


@dataclass
class Quote:
    path: Path
    command: str
    first_line: int  # 1-based line number of the block's first quoted line
    lines: list[str]

    def where(self, index: int) -> str:
        return f"{_shown(self.path)}:{self.first_line + index}"


@dataclass
class Mismatch:
    quote: Quote
    index: int  # which quoted line
    message: str
    replacement: str | None = None  # the output line that --update would write

    def __str__(self) -> str:
        return f"{self.quote.where(self.index)}: {self.message}"


@dataclass
class Output:
    status: int
    lines: list[str] = field(default_factory=list)


def _shown(path: Path) -> str:
    """`lessons/L2-paged.md` for a lesson of this repository, the full path for any other file."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def find_quotes(path: Path) -> tuple[list[Quote], list[str]]:
    """Every quote in one lesson, and the problems of form (a text block that names no command)."""
    text = path.read_text().split("\n")
    quotes, problems = [], []
    i = 0
    while i < len(text):
        if text[i].strip() != "```text":
            i += 1
            continue
        end = i + 1
        while end < len(text) and text[end].strip() != "```":
            end += 1
        match = COMMAND_LINE.search(" ".join(_paragraph_before(text, i)))
        if match is None:
            problems.append(f"{_shown(path)}:{i + 1}: a ```text block must follow a line naming its command "
                            "(\"Output of `python ...`:\"); use a plain ``` block for a drawing")
        else:
            quotes.append(Quote(path, match["cmd"], i + 2, text[i + 1:end]))
        i = end + 1
    return quotes, problems


def _paragraph_before(text: list[str], row: int) -> list[str]:
    """The lines of the paragraph that ends right above `row` (blank lines between allowed)."""
    row -= 1
    while row >= 0 and not text[row].strip():
        row -= 1
    lines = []
    while row >= 0 and text[row].strip():
        lines.insert(0, text[row].strip())
        row -= 1
    return lines


def all_quotes(lessons: list[Path] | None = None) -> tuple[list[Quote], list[str]]:
    quotes, problems = [], []
    for path in lessons or sorted(LESSONS.glob("L*.md")):
        q, p = find_quotes(path)
        quotes += q
        problems += p
    return quotes, problems


def run_command(command: str) -> Output:
    """Run `python SCRIPT ARGS...` in this process with CUDA hidden; stdout and stderr together."""
    import torch

    argv = shlex.split(command)
    if len(argv) < 2 or argv[0] != "python" or not argv[1].endswith(".py"):
        raise ValueError(f"only `python SCRIPT.py ARGS` commands can be checked, got `{command}`")
    script = ROOT / argv[1]
    buffer = io.StringIO()
    threads, available, old_argv = torch.get_num_threads(), torch.cuda.is_available, sys.argv
    sys.argv, torch.cuda.is_available = argv[1:], lambda: False  # quotes are CPU float32 runs
    torch.set_num_threads(1)  # tiny model: a second thread gains little and waits on a busy machine
    status = 0
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, torch.cuda.is_available = old_argv, available
        torch.set_num_threads(threads)
    return Output(status, buffer.getvalue().split("\n"))


def _line_matches(quoted: str, actual: str) -> bool:
    quoted, actual = quoted.rstrip(), actual.rstrip()
    if ELISION not in quoted:
        return quoted == actual
    pattern = ".*".join(re.escape(part) for part in quoted.split(ELISION))
    return re.fullmatch(pattern, actual) is not None


def _segments(quote: Quote) -> list[list[int]]:
    """Indices of quoted lines, cut at elisions and blank lines are dropped."""
    segments, current = [], []
    for i, line in enumerate(quote.lines):
        if line.strip() == ELISION:
            if current:
                segments.append(current)
            current = []
        elif line.strip():
            current.append(i)
    if current:
        segments.append(current)
    return segments


def _key(line: str) -> str:
    """What identifies an output line whose figures may change: `name:` or its first two words."""
    line = line.strip()
    if re.match(r"^[\w.-]+: ", line):
        return line.split(": ", 1)[0] + ": "
    return " ".join(line.split()[:2])


def check_quote(quote: Quote, output: Output) -> list[Mismatch]:
    """Mismatches of one quote against its command's output (empty when all quoted lines are there)."""
    out, cursor, found = output.lines, 0, []
    for segment in _segments(quote):
        best_start, best_len = None, -1
        for start in range(cursor, len(out)):
            n = 0
            while n < len(segment) and start + n < len(out) and _line_matches(quote.lines[segment[n]], out[start + n]):
                n += 1
            if n > best_len:
                best_start, best_len = start, n
            if n == len(segment):
                break
        if best_len == len(segment):
            cursor = best_start + best_len
            continue
        index = segment[best_len] if best_len > 0 else segment[0]
        if ELISION in quote.lines[index]:
            replacement = None  # an abridged line is rewritten by hand
        elif best_len > 0 and best_start + best_len < len(out):
            replacement = out[best_start + best_len]
        else:
            key = _key(quote.lines[index])
            replacement = next((line for line in out[cursor:] if _key(line) == key), None)
        found.append(Mismatch(quote, index, f"`{quote.command}` (exit {output.status}) does not print "
                                            f"{quote.lines[index].strip()!r}"
                              + (f"; it prints {replacement.strip()!r}" if replacement else ""), replacement))
    return found


def check(lessons: list[Path] | None = None, runner=run_command,
          outputs: dict[str, Output] | None = None) -> tuple[list[Quote], list[str], list[Mismatch]]:
    """Run every distinct command once (`outputs` caches them across calls); return the quotes,
    the problems of form and the mismatches."""
    quotes, problems = all_quotes(lessons)
    outputs = {} if outputs is None else outputs
    mismatches = []
    for quote in quotes:
        if quote.command not in outputs:
            outputs[quote.command] = runner(quote.command)
        mismatches += check_quote(quote, outputs[quote.command])
    return quotes, problems, mismatches


def update(mismatches: list[Mismatch]) -> tuple[int, list[Mismatch]]:
    """Write each mismatch's replacement line into its lesson; return (lines rewritten, left alone)."""
    by_file: dict[Path, list[Mismatch]] = {}
    left = []
    for m in mismatches:
        (by_file.setdefault(m.quote.path, []) if m.replacement is not None else left).append(m)
    rewritten = 0
    for path, items in by_file.items():
        text = path.read_text().split("\n")
        for m in items:
            text[m.quote.first_line + m.index - 1] = m.replacement.rstrip()
            rewritten += 1
        path.write_text("\n".join(text))
    return rewritten, left
