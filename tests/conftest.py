import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.durations"]  # --durations-file: where the suite's time goes (CI keeps it)


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
