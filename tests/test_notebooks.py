"""The notebooks in notebooks/: committed without outputs (diffs stay readable), each plotting
cell tagged "plot", and every notebook executed headless by a Jupyter kernel (nbclient), from
an empty directory, within its time limit: any error fails the test, and every "plot" cell
must have produced an image. The quick start runs in the main job, the research notebooks in
the slow job."""
from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import nbformat
import pytest

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
QUICKSTART = "01_quickstart.ipynb"
# Each notebook runs in about 3 minutes on a 2-core CPU with a cold compile cache; the limit
# only stops a hung kernel.
LIMIT_S = 900
DRAWS = re.compile(r"\bplt\.|\bplots\.plot_")


def read(path: Path):
    return nbformat.read(path, as_version=4)


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def is_plot(cell) -> bool:
    return "plot" in cell.metadata.get("tags", [])


def test_the_notebooks_are_numbered_from_the_quick_start():
    names = [p.name for p in NOTEBOOKS]
    assert names[0] == QUICKSTART and len(names) >= 5
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", n) for n in names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = read(path)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_cell_is_tagged_plot_exactly_when_it_draws(path):
    cells = code_cells(read(path))
    assert any(map(is_plot, cells)), "a notebook without a figure"
    for cell in cells:
        assert bool(DRAWS.search(cell.source)) == is_plot(cell), cell.source[:80]


def execute(path: Path, cwd: Path):
    """Run every cell in a fresh python3 kernel started in `cwd`; raises on the first cell
    that fails (nbclient's CellExecutionError) or past LIMIT_S for the whole notebook. The
    kernels share this test run's compilation cache (tests/conftest.py), so a step one
    notebook compiled loads in the next."""
    from nbclient import NotebookClient
    nb = read(path)
    client = NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    env = {**os.environ, "SPECJAX_COMPILATION_CACHE": os.environ["SPECJAX_TESTS_JAX_CACHE"]}
    asyncio.run(asyncio.wait_for(client.async_execute(env=env), LIMIT_S))
    return nb


def check_run(path: Path, tmp_path: Path) -> None:
    nb = execute(path, tmp_path)
    cells = code_cells(nb)
    assert all(c.execution_count for c in cells)  # every cell ran
    for cell in filter(is_plot, cells):
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"{path.name}: no image from\n{cell.source[:200]}"


def test_the_quick_start_runs(tmp_path):
    check_run(FOLDER / QUICKSTART, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name != QUICKSTART],
                         ids=lambda p: p.stem)
def test_the_research_notebooks_run(path, tmp_path):
    check_run(path, tmp_path)
