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
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # Executes an in-memory copy. A failing cell raises CellExecutionError with its traceback and stops the run.
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code) for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not every cell ran, in order"
    if os.environ.get("FINETUNE_REGENERATE_NOTEBOOKS") == "1":  # commit what this run printed and drew
        for c in code:
            c.metadata.pop("execution", None)  # per-cell timestamps: noise in a diff
        nbformat.write(nb, NOTEBOOKS / name)
        return
    # The committed notebook carries the outputs a reader sees on GitHub: every cell that prints or draws
    # something here has output of the same kinds there (a figure where this run drew one), in run order.
    # Regenerate with FINETUNE_REGENERATE_NOTEBOOKS=1 pytest tests/integration/test_notebooks.py.
    kept = [c for c in committed.cells if c.cell_type == "code"]
    assert [c.execution_count for c in kept] == list(range(1, len(kept) + 1)), f"{name}: committed without its run"
    for i, (fresh, old) in enumerate(zip(code, kept)):
        kinds = lambda cell: {(o.output_type, tuple(sorted(o.get("data", {})))) for o in cell.outputs}  # noqa: E731
        assert kinds(fresh) == kinds(old), f"{name}, code cell {i + 1}: committed outputs {kinds(old)}, ran {kinds(fresh)}"
        assert all(o.output_type != "error" for o in old.outputs)
