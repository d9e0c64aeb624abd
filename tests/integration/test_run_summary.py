"""The end of a run and its resume, as the command line shows them (issue 37): parameter counts in parameters
(not packed 4-bit bytes), the held-out source, a summary instead of `done: {dict}`, `time` going on across a
resume, and a resume that lengthens the run saying what the learning-rate schedule does."""
import json
import re

import pytest

from ..conftest import run_cli

pytestmark = pytest.mark.slow

ARGS = ["recipes/tiny_cpu.yaml", "train.log_every=5", "train.save_every=10", "train.warmup_steps=2",
        "data.max_samples=320", "eval.max_batches=2", "output.progress_bar=false"]


def test_a_run_ends_in_a_summary_and_its_resume_keeps_time_and_names_the_schedule(tmp_path):
    run = tmp_path / "run"
    first = run_cli([*ARGS, "train.max_steps=10", f"output.dir={run}"])
    assert first.returncode == 0, first.stderr[-2000:]
    out = first.stdout
    assert "done: {" not in out
    # The tiny Llama: 2.56M parameters in the base (2.36M of them in its 4-bit linears) + 262k of LoRA r=16.
    assert re.search(r"^model: 2\.82M parameters, 2\.36M of them in 4 bits, 262k trainable \(9\.3%\);", out, re.M), out
    assert "data: training on builtin:tiny-instruct; held out for eval: data.eval_sources builtin:tiny-instruct " \
           "(split eval)" in out
    assert re.search(r"^finished: 10 steps; [\d.]+ s wall for this command, [\d.]+ s of training in all, \d+ tokens/s$",
                     out, re.M), out
    assert re.search(r"^loss: [\d.]+ at step 1 -> [\d.]+ at step 10$", out, re.M)
    assert re.search(r"^held out: eval_loss [\d.]+ ", out, re.M)
    assert re.search(r"^peak memory: [\d.]+ GiB RSS per process \(phase \w+;", out, re.M)
    assert f"adapter: {run / 'adapter'}" in out and f"finetune merge {run}" in out

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    t10 = max(r["time"] for r in records if r["step"] == 10)
    second = run_cli([*ARGS, "train.max_steps=20", f"output.dir={run}"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert re.search(r"resume: the learning-rate schedule now spans 20 steps: step 10 ran at 0, the next steps run "
                     r"from [\d.e-]+ and decay to 0 at step 20", second.stderr), second.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r["time"] for r in records if r["step"] > 10]
    assert after and min(after) > t10, (t10, after)  # the clock goes on from the checkpoint's time
