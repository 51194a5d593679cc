"""Output quoted in the lessons is what the commands print today (harness/lesson_quotes.py).

Every ```text block in lessons/*.md names its command; each distinct command runs once, in this
process, and every quoted line must be in its output. When a counter changes on purpose, run
`python scripts/check_lesson_quotes.py --update` and read the diff.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import lesson_quotes as lq
from harness.grading import LESSON_PACKAGES

ROOT = Path(__file__).resolve().parent.parent
# {"l1": "L1-contiguous.md", ...}: each lesson package's text
LESSON_FILES = {lesson: next(p.name for p in (ROOT / "lessons").glob(f"L{lesson[1:]}-*.md")
                             if "gpu" not in p.name) for lesson in LESSON_PACKAGES}

pytestmark = pytest.mark.course

QUOTES, PROBLEMS = lq.all_quotes()


@pytest.fixture(scope="module")
def outputs():
    """One run per distinct command, shared by every quote of it (and by the self-checks below)."""
    cache: dict[str, lq.Output] = {}

    def output(command: str) -> lq.Output:
        if command not in cache:
            cache[command] = lq.run_command(command)
        return cache[command]

    return output


def test_every_text_block_names_its_command():
    assert QUOTES, "no quoted output found in lessons/*.md"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("quote", QUOTES, ids=[q.where(0) for q in QUOTES])
def test_quoted_output_is_what_the_command_prints(quote, outputs):
    mismatches = lq.check_quote(quote, outputs(quote.command))
    assert not mismatches, "\n".join(map(str, mismatches)) + \
        "\n(after an intended change: python scripts/check_lesson_quotes.py --update)"


def test_an_edited_figure_is_reported_with_its_line(tmp_path, outputs):
    quote, index = next((q, i) for q in QUOTES for i, line in enumerate(q.lines)
                        if re.fullmatch(r"\w+: \d+", line))  # a counter such as `wasted_slots_peak: 38`
    lines = quote.path.read_text().split("\n")
    row = quote.first_line + index - 1
    name, value = lines[row].split(": ")
    lines[row] = f"{name}: {int(value) + 1}"
    copy = tmp_path / quote.path.name
    copy.write_text("\n".join(lines))
    _, problems, mismatches = lq.check([copy], runner=outputs)
    assert not problems
    assert [m.quote.where(m.index) for m in mismatches] == [f"{copy}:{row + 1}"]
    assert f"{name}: {int(value) + 1}" in str(mismatches[0]) and f"{name}: {value}" in str(mismatches[0])
    assert lq.update(mismatches)[0] == 1 and copy.read_text() == quote.path.read_text()  # --update restores it


def test_the_update_command_rewrites_every_changed_line(tmp_path, outputs, capsys):
    import runpy

    quote = next(q for q in QUOTES if sum(bool(re.fullmatch(r"\w+: \d+", line)) for line in q.lines) >= 2)
    original = quote.path.read_text()
    copy = tmp_path / quote.path.name
    copy.write_text(re.sub(r"(?m)^(\w+): (\d+)$", lambda m: f"{m[1]}: {int(m[2]) + 1}", original))
    main = runpy.run_path(str(lq.ROOT / "scripts" / "check_lesson_quotes.py"))["main"]
    assert main([str(copy)], runner=outputs) == 1
    assert main(["--update", str(copy)], runner=outputs) == 0
    assert copy.read_text() == original, capsys.readouterr().out


OUT = lq.Output(0, ["header", "a: 1", "b: 2", "noise", "c: 3", "PASS"])


def _quote(*lines: str) -> lq.Quote:
    return lq.Quote(lq.LESSONS / "L0.md", "python x.py", 10, list(lines))


@pytest.mark.parametrize("lines, bad", [
    (["a: 1", "b: 2", "...", "PASS"], []),
    (["a: 1", "...", "c: 3"], []),
    (["hea...", "...", "c: ..."], []),                  # `...` inside a line stands for any text
    (["a: 1", "c: 3"], [1]),                             # consecutive quoted lines must be consecutive
    (["c: 3", "...", "a: 1"], [2]),                      # and in order
    (["a: 1", "b: 3"], [1]),
    (["a: 1", "", "b: 2"], []),                          # blank lines in a quote are ignored
])
def test_matching_rules(lines, bad):
    assert [m.index for m in lq.check_quote(_quote(*lines), OUT)] == bad


def test_a_text_block_without_its_command_is_a_problem(tmp_path):
    lesson = tmp_path / "L0.md"
    lesson.write_text("Some drawing:\n\n```text\nA -> B\n```\n\nOutput of `python x.py --n 2`\n"
                      "(abridged):\n\n```text\nok\n```\n")
    quotes, problems = lq.find_quotes(lesson)
    assert [(q.command, q.first_line, q.lines) for q in quotes] == [("python x.py --n 2", 11, ["ok"])]
    assert len(problems) == 1 and problems[0].startswith(f"{lesson}:3:")


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code without its comment) of every line inside a ```python block."""
    found, inside = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip().startswith("```"):
            inside = line.strip() == "```python"
        elif inside and line.split("#")[0].strip():
            found.append((number, " ".join(line.split("#")[0].split())))
    return found


def test_code_quoted_in_the_lessons_is_in_the_code():
    """A ```python block quotes the course's code: each of its lines (comments aside) is in a .py file."""
    sources = {" ".join(line.split("#")[0].split()) for path in lq.ROOT.glob("[hl]*/**/*.py")
               for line in path.read_text().split("\n")}
    missing = [f"lessons/{lesson.name}:{number}: {code}" for lesson in sorted(lq.LESSONS.glob("L*.md"))
               for number, code in _code_lines(lesson.read_text()) if code not in sources]
    assert not missing, "\n".join(missing)


# ---------------------------------------------------------------- figures quoted from docs/benchmarks.md

BENCHMARKS = lq.ROOT / "docs" / "benchmarks.md"


def _section_tables(name: str) -> list[list[dict]]:
    """The markdown tables between `<!-- BEGIN name` and `<!-- END name -->`, as lists of rows."""
    text = BENCHMARKS.read_text()
    body = text.split(f"<!-- BEGIN {name} ", 1)[1].split(f"<!-- END {name} -->", 1)[0]
    tables, header = [], None
    for line in body.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append([])
        elif not set(cells[0]) <= set("- "):
            tables[-1].append(dict(zip(header, cells)))
    return tables


def _section_rows(name: str) -> list[dict]:
    return [row for table in _section_tables(name) for row in table]


def _cell(section: str, column: str, **where) -> float:
    hits = [r for r in _section_rows(section) if all(r.get(k) == v for k, v in where.items())]
    assert len(hits) == 1, (section, where, len(hits))
    return float(hits[0][column])


def _l10(workload: str, system: str, column: str = "speed-up") -> float:
    return _cell("bench_l10", column, workload=workload, system=system)


def _l12_gpu(column: str) -> float:
    """The H200 table of L12's codes, copied from one bench_l3_kernel.py run (a GPU-only bench)."""
    return _cell("l12 gpu h200", column, **{"batch x context": "32 x 2048"})


# (file, the sentence's figure as written, the same figure from the table it comes from)
QUOTED_FIGURES = [
    ("lessons/L10-speculative.md", "1.12x HF greedy", lambda: _l10("embedded, batch 16", "L10 prompt lookup")),
    ("lessons/L10-speculative.md", "1.25x\nL8 without speculation",
     lambda: _l10("embedded, batch 16", "L10 prompt lookup", "tokens/s") / _l10("embedded, batch 16", "L8 plain", "tokens/s")),
    ("lessons/L10-speculative.md", "against 2.36x at batch 1", lambda: _l10("embedded, batch 1", "L10 prompt lookup")),
    ("lessons/L10-speculative.md", "from 2.36x to 1.12x", lambda: _l10("embedded, batch 1", "L10 prompt lookup")),
    ("docs/benchmarks.md", "(0.90x, and HF's", lambda: _l10("embedded, batch 1", "L10 draft model")),
    ("docs/benchmarks.md", "with the same draft 0.74x", lambda: _l10("embedded, batch 1", "HF assistant (draft)")),
    ("docs/benchmarks.md", "is 2.36x HF greedy", lambda: _l10("embedded, batch 1", "L10 prompt lookup")),
    ("docs/benchmarks.md", "prompt lookup's 2.05x", lambda: _l10("embedded, batch 1", "HF prompt lookup")),
    ("lessons/L12-quantized-kv.md", "took 97.9 us over fp8 codes", lambda: _l12_gpu("fp8")),
    ("lessons/L12-quantized-kv.md", "against 90.2 us over the bf16", lambda: _l12_gpu("bf16 cache")),
    ("lessons/L12-quantized-kv.md", "took\n337.9 us", lambda: _l12_gpu("fp8 before")),
]


@pytest.mark.parametrize("path,quoted,figure", QUOTED_FIGURES, ids=[q for _, q, _ in QUOTED_FIGURES])
def test_a_figure_quoted_from_a_benchmark_table_equals_the_table(path, quoted, figure):
    text = (lq.ROOT / path).read_text()
    assert " ".join(quoted.split()) in " ".join(text.split()), f"{path} no longer says {quoted!r}: update this list"
    number = float(re.search(r"\d+\.\d+", quoted).group())
    assert round(figure(), 2) == number, f"{path} says {quoted!r}; the table gives {figure():.2f}"


def test_l1s_bf16_margins_agree_with_the_bf16_table():
    """L1 §5 quotes the largest teacher-forced differences that set the rule's bounds."""
    text = " ".join((lq.ROOT / "lessons" / "L1-contiguous.md").read_text().split())
    rows = _section_rows("bf16 cpu")
    embedded = max(float(r["in spacings"]) for r in rows if r["model"].startswith("embedded"))
    shape = max(float(r["in spacings"]) for r in rows if r["model"].startswith("0.6B shape"))
    assert "at most 2 spacings on the embedded model" in text and embedded == 2, embedded
    assert "about 10 on a random model" in text and round(shape) == 10, shape
    assert all(r["verdict"] == "PASS" for r in rows)


def test_l5s_sentence_on_recompute_and_swap_agrees_with_its_table():
    """L5 says swap finished ahead at both pool sizes; the generated table must say so too."""
    text = " ".join((lq.ROOT / "lessons" / "L5-eviction.md").read_text().split())
    assert "swap finished ahead at both sizes" in text
    tables = [t for t in _section_tables("bench_l5") if any(r.get("system", "").startswith("L5 pool") for r in t)]
    assert len(tables) >= 1
    for table in tables:  # the embedded model's, and the 0.6B shape's
        for pool in ("50", "25"):
            rows = {r["system"]: float(r["best s"]) for r in table if r.get("pool %") == pool}
            assert rows[f"L5 pool {pool}% swap"] <= rows[f"L5 pool {pool}% recompute"], (pool, rows)


def test_the_readme_counts_the_lessons_it_has():
    """The first paragraph's count follows the lesson packages (it once said five of seven)."""
    words = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    count = len(list(lq.ROOT.glob("l[0-9]*_*/__init__.py")))
    first = (lq.ROOT / "README.md").read_text().split("\n\n")[1]
    assert f"{words[count]} working lessons" in " ".join(first.split()), first[:300]


@pytest.fixture(scope="module")
def graded_manifest(tmp_path_factory) -> dict[str, dict]:
    """The graded tests of this repository with their points and `-k` names (pytest's own collection)."""
    manifest = tmp_path_factory.mktemp("points") / "manifest.json"
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--graded-only", "-p", "no:cacheprovider",
                    "--manifest", str(manifest)], cwd=ROOT, capture_output=True, check=True, timeout=300)
    return json.loads(manifest.read_text())


@pytest.fixture(scope="module")
def collected_points(graded_manifest) -> dict[str, float]:
    """Points per lesson."""
    points: dict[str, float] = {}
    for test in graded_manifest.values():
        points[test["lesson"]] = points.get(test["lesson"], 0.0) + test["points"]
    return points


def points_of_selection(manifest: dict[str, dict], command: str) -> float:
    """The points `pytest FILES [-k EXPR] --graded-only` would run, from the manifest: -k is evaluated
    by pytest's own expression parser on the names pytest matches (harness.grading._keywords_of)."""
    from _pytest.mark import KeywordMatcher  # pytest's -k machinery (private, but the same code path)
    from _pytest.mark.expression import Expression
    args = shlex.split(command)
    assert args[0] == "pytest", command
    expr = args[args.index("-k") + 1] if "-k" in args else None
    files = [a for a in args[1:] if a.endswith(".py")]
    selected = Expression.compile(expr) if expr else None
    return sum(test["points"] for nodeid, test in manifest.items()
               if nodeid.split("::")[0] in files
               and (selected is None or selected.evaluate(KeywordMatcher(frozenset(test["keywords"])))))


@pytest.mark.parametrize("lesson", sorted(LESSON_FILES))
def test_the_points_of_each_function_are_the_points_its_tests_carry(lesson, graded_manifest):
    """The What-you-write table's last column: the points of the row's pytest command(s), and for
    L5 the whole path's share, as the paragraph below the table names that command."""
    text = (ROOT / "lessons" / LESSON_FILES[lesson]).read_text()
    rows = re.findall(r"^\| `[^|]+` \| `[^|]+` \| [^|]+ \| (.+) \| (.+) \|$", text, re.M)
    assert rows, f"{LESSON_FILES[lesson]}: no What-you-write table with a points column"
    whole = re.search(r"\(`(pytest [^`]+)`\): their points are earned by", " ".join(text.split()))
    for graded_by, cell in rows:
        commands = [" ".join(c.split()) for c in re.findall(r"`(pytest [^`]+)`", graded_by)]
        stated = re.fullmatch(r"(\d+)(?: \(\+ the whole path's (\d+), shared\))?", cell)
        assert commands and stated, (graded_by, cell)
        assert int(stated[1]) == sum(points_of_selection(graded_manifest, c) for c in commands), (graded_by, cell)
        if stated[2]:
            assert whole and int(stated[2]) == points_of_selection(graded_manifest, whole[1]), (graded_by, cell)


@pytest.mark.parametrize("lesson", sorted(LESSON_FILES))
def test_the_points_a_lesson_states_are_the_points_its_tests_carry(lesson, collected_points):
    text = (ROOT / "lessons" / LESSON_FILES[lesson]).read_text()
    stated = re.search(r"\*\*Points\.\*\* This lesson's graded tests carry (\d+) points: (\d+) in `make check-",
                       text.replace("\n", " "))
    assert stated, f"{LESSON_FILES[lesson]}: no '**Points.**' line after the What-you-write table"
    total, check = int(stated[1]), int(stated[2])
    assert total == collected_points[lesson] and check == total - 2, (lesson, total, collected_points[lesson])
