"""Every lesson's notebook runs from top to bottom and draws at least one picture (`make notebooks`).

The notebooks share one Jupyter kernel, each starting from an empty namespace (`%reset -f`): a
name a notebook uses without defining it still fails, while torch, transformers and the lesson
packages are imported once instead of once per notebook (about ten seconds each on 2 cores). A
notebook that fails or times out leaves the kernel restarted for the next one.
"""

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


@pytest.fixture(scope="session")
def notebook_kernel():
    """One kernel for every notebook."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT))
    yield km
    km.shutdown_kernel(now=True)


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_executes_and_draws(path, notebook_kernel):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))  # the previous notebook's names are gone
    if not notebook_kernel.is_alive():
        notebook_kernel.restart_kernel(now=True)
    client = NotebookClient(nb, timeout=600, km=notebook_kernel, resources={"metadata": {"path": str(ROOT)}})
    failure, clean = None, False
    try:
        client.execute()
        clean = True
    except CellExecutionError as exc:  # IPython colours its tracebacks; a log or results.json should not
        failure = strip_ansi(str(exc))
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
        if not clean:  # a failed cell, a timeout, an interrupt: the next notebook gets a fresh kernel
            notebook_kernel.restart_kernel(now=True)
    if failure is not None:  # outside the except block, so pytest does not print the coloured original too
        pytest.fail(f"{path.name}: a cell failed\n{failure}", pytrace=False)
    images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no picture"
