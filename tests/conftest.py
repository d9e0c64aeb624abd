import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the machine's cores: one compute thread each, in this process and every process it
    # starts (set before torch is imported; tests that compare runs already pin OMP_NUM_THREADS=1).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["tests.durations"]  # --durations-file: where the suite's time goes (CI keeps it)


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A directory that `build(path)` fills once per pytest run, for the expensive runs whose results many
    tests only read. Under pytest-xdist every worker has its own session, so the first worker to ask builds it
    under a file lock in the directory the workers share, and the others wait for it and read the same files.
    A build that raises leaves nothing marked done: the next asker builds again (and fails the same way)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N/: one per run, shared by its workers
    path, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir():
    from finetune.util import builtin as tiny

    return tiny.model_dir()


@pytest.fixture(scope="session")
def tiny_data_dir():
    from finetune.util import builtin as tiny

    return tiny.dataset_dir()


def run_cli(args, cwd=None, timeout=600, env=None):
    """Run `python -m finetune ...` in a subprocess; returns CompletedProcess with text output."""
    import subprocess

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout, env=e)


@pytest.fixture(scope="session")
def tok():
    """The builtin tiny tokenizer, straight from the assets (tests that need another define their own)."""
    from transformers import AutoTokenizer

    from finetune.util import builtin as tiny

    return AutoTokenizer.from_pretrained(tiny.ASSETS / f"tiny-llama-{tiny.VERSION}")
