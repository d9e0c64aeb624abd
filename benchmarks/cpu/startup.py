"""Row 6: how long a user waits. Time to first step: `python -m finetune recipes/tiny_cpu.yaml` from the
command starting to its `step=1` line (imports, preflight, tokenizer, data, 4-bit model, LoRA, the first
optimizer step), builtin assets already built; the process is killed once the line appears. And the wall
time of `python -m finetune validate recipes/llama3_70b_qlora.yaml`, which plans a 70B run from the
built-in architecture table without touching weights or importing torch."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, TINY_RECIPE, child_env, median

VALIDATE_RECIPE = ROOT / "recipes" / "llama3_70b_qlora.yaml"


def first_step_seconds(timeout: float = 300) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp:
        cmd = [sys.executable, "-m", "finetune", str(TINY_RECIPE), f"output.dir={tmp}/run"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("step=1 "):
                    return time.perf_counter() - t0
                if time.perf_counter() - t0 > timeout:
                    break
            raise RuntimeError(f"no 'step=1' line from {' '.join(cmd)} (exit {proc.poll()})")
        finally:
            proc.kill()  # the timing is taken; the rest of the 300-step run is not part of it
            proc.communicate()


def validate_seconds() -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "finetune", "validate", str(VALIDATE_RECIPE)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"validate failed (exit {proc.returncode}):\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return seconds


def run(first_step_reps: int = 3, validate_reps: int = 5) -> dict:
    from finetune.util import builtin as tiny

    tiny.model_dir(), tiny.dataset_dir()  # build the builtin assets now if missing: a one-off, not startup
    first = [first_step_seconds() for _ in range(first_step_reps)]
    val = [validate_seconds() for _ in range(validate_reps)]
    return {"first_step_s": median(first), "validate_70b_s": median(val),
            "samples": {"first_step_s": first, "validate_70b_s": val}}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
