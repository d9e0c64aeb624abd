"""Committed notebooks carry the run a reader sees on GitHub: valid, every code cell run once, in
order, no error output and no per-cell timestamps, and built on finetune. tests/integration/test_notebooks.py runs
them afresh and checks the committed outputs against that run (FINETUNE_REGENERATE_NOTEBOOKS=1 rewrites them)."""
from __future__ import annotations

import pytest

from tests.integration.test_notebooks import NAMES, NOTEBOOKS

nbformat = pytest.importorskip("nbformat")


def run_problems(nb) -> list[str]:
    """What keeps a notebook from being one clean top-to-bottom run: a cell unrun or out of order, an error
    output, timestamps left in a cell's metadata."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    out = []
    if [c.execution_count for c in code] != list(range(1, len(code) + 1)):
        out.append(f"execution counts {[c.execution_count for c in code]} are not 1..{len(code)}")
    out += [f"code cell {i + 1}: error output" for i, c in enumerate(code) if any(o.output_type == "error"
                                                                              for o in c.outputs)]
    out += [f"code cell {i + 1}: execution timestamps" for i, c in enumerate(code) if "execution" in c.metadata]
    return out


def test_every_notebook_is_executed_in_ci():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_with_its_run(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert not run_problems(nb), f"{name}: {run_problems(nb)}"
    assert any(c.outputs for c in nb.cells if c.cell_type == "code"), f"{name}: committed without outputs"
    assert any("from finetune import" in c.source for c in nb.cells if c.cell_type == "code")


def test_run_problems_finds_unrun_cells_errors_and_timestamps():
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    clean = new_notebook(cells=[new_code_cell("x = 1", execution_count=1),
                                new_code_cell("x", execution_count=2,
                                              outputs=[new_output("execute_result", data={"text/plain": "1"},
                                                                  execution_count=2)])])
    assert run_problems(clean) == []
    unrun = new_notebook(cells=[new_code_cell("x = 1", execution_count=1), new_code_cell("x")])
    assert run_problems(unrun) == ["execution counts [1, None] are not 1..2"]
    err = new_notebook(cells=[new_code_cell("1/0", execution_count=1,
                                            outputs=[new_output("error", ename="ZeroDivisionError", evalue="",
                                                                traceback=[])])])
    assert run_problems(err) == ["code cell 1: error output"]
    stamped = new_notebook(cells=[new_code_cell("x = 1", execution_count=1, metadata={"execution": {}})])
    assert run_problems(stamped) == ["code cell 1: execution timestamps"]
