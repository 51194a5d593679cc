"""Every lesson's notebook runs from top to bottom and draws at least one picture (`make notebooks`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.grading import strip_ansi

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("L*_*.ipynb"))


def _param(path: Path):
    lesson = path.name.split("_")[0].lower()  # "L2_paged.ipynb" -> "l2"
    # A whole notebook runs in one test: longer than the default per-test limit on a busy machine.
    marks = [getattr(pytest.mark, lesson), pytest.mark.notebook, pytest.mark.points(2), pytest.mark.timeout(900)]
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_executes_and_draws(path):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    failure = None
    try:
        client.execute()
    except CellExecutionError as exc:  # IPython colours its tracebacks; a log or results.json should not
        failure = strip_ansi(str(exc))
    if failure is not None:  # outside the except block, so pytest does not print the coloured original too
        pytest.fail(f"{path.name}: a cell failed\n{failure}", pytrace=False)
    images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no picture"
