"""The notebooks run top to bottom on CPU, from notebooks/, as a reader runs them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_planning.ipynb", "03_merge_and_compare.ipynb"]


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A `python3` kernelspec that starts this interpreter. JUPYTER_PATH is searched before the user's and
    the system's kernel directories, so a python3 kernel installed elsewhere cannot stand in for the venv."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    spec = write_kernel_spec(str(root / "kernels" / "python3"))
    assert sys.executable in Path(spec, "kernel.json").read_text()
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name, jupyter_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    # The kernel imports this checkout's finetune, whatever an editable install elsewhere points at.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # Executes the in-memory copy; the committed file keeps no outputs. A failing cell raises
    # CellExecutionError with its traceback and stops the run.
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code) for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not every cell ran, in order"
