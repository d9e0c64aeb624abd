"""Committed notebooks are sources: valid, without outputs or execution counts, and built on finetune."""
from __future__ import annotations

import pytest

from tests.integration.test_notebooks import NAMES, NOTEBOOKS

nbformat = pytest.importorskip("nbformat")


def dirty_cells(nb) -> list[int]:
    """Indexes of code cells that carry outputs or an execution count."""
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]


def test_every_notebook_is_executed_in_ci():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_clean(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert not dirty_cells(nb), f"{name}: cells {dirty_cells(nb)} hold outputs or execution counts; clear them"
    assert any("from finetune import" in c.source for c in nb.cells if c.cell_type == "code")


def test_dirty_cells_finds_outputs_and_counts():
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    nb = new_notebook(cells=[new_markdown_cell("# title"), new_code_cell("x = 1"),
                             new_code_cell("x", execution_count=3,
                                           outputs=[new_output("execute_result", data={"text/plain": "1"},
                                                               execution_count=3)]),
                             new_code_cell("print(x)", outputs=[new_output("stream", text="1\n")]),
                             new_code_cell("x", execution_count=4)])
    assert dirty_cells(nb) == [2, 3, 4]
