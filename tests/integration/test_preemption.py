"""Preemption: SIGTERM (a scheduler) or SIGINT (Ctrl-C) finishes the current step, writes a checkpoint and
exits 0; running the same command again resumes there, trains only the steps after it and ends where an
uninterrupted run ends. "The current step" is checked by events, not time: the stop is at most one step
after the last metrics line seen once the signal was sent. One process here; two processes in
test_distributed_faults.py."""
from __future__ import annotations

import os
import signal

import pytest
from safetensors.torch import load_file

from finetune.train.keepers import checkpoint as C

from .procs import (
    alive,
    fork_cli,
    last_metrics_step,
    metrics,
    spawn_cli,
    trained_steps,
    wait_for_first_metrics,
    wait_pid,
)
from .test_crash_safety import rel_diff, warm

pytestmark = pytest.mark.slow

STEPS = 16
BASE = ["recipes/tiny_cpu.yaml", f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.micro_batch_size=4",
        "train.log_every=1", "eval.max_batches=1", "output.progress_bar=false", "data.eval_sources=[]",
        "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 96}]"]


def stopped_step(log_text: str) -> int:
    line = next(ln for ln in log_text.splitlines() if ln.startswith("stopped by signal"))
    return int(line.split("checkpoints/step-")[1].split(";")[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, as a forked CLI with one torch thread like every run it is compared with."""
    warm()
    tmp = tmp_path_factory.mktemp("ref")
    pid = fork_cli(BASE + [f"output.dir={tmp / 'run'}", "train.save_every=8"], tmp / "log")
    assert wait_pid(pid, 300) == 0, (tmp / "log").read_text()[-3000:]
    return load_file(str(tmp / "run" / "adapter" / "adapter_model.safetensors"))


def check_stop_and_resume(run, log, code, seen, signum, reference, extra):
    """`seen`: the newest metrics step read after the signal was sent. The signal was pending then, so the
    run notices it at the latest after the step that was under way (seen + 1), whatever the machine's load."""
    text = log.read_text()
    assert code == 0, text[-3000:]
    step = stopped_step(text)
    assert f"stopped by signal {signum}" in text and 0 < step <= seen + 1 and step < STEPS, (seen, text[-2000:])
    assert C.latest(run / "checkpoints") == run / "checkpoints" / f"step-{step}"
    assert C.verify(run / "checkpoints" / f"step-{step}", 1)["step"] == step
    assert not (run / "adapter").exists()  # stopped early: no final adapter yet
    assert max(m["step"] for m in metrics(run)) == step
    rerun_log = log.with_suffix(".rerun")
    pid = fork_cli(BASE + [f"output.dir={run}", *extra], rerun_log)
    assert wait_pid(pid, 300) == 0, rerun_log.read_text()[-3000:]
    rerun = rerun_log.read_text()
    assert f"resume: from {run / 'checkpoints' / f'step-{step}'} (step {step})" in rerun
    assert trained_steps(rerun) == list(range(step + 1, STEPS + 1)), rerun[-2000:]  # resumed, not restarted
    got = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert rel_diff(got, reference) <= 1e-4
    assert [m["step"] for m in metrics(run) if "loss" in m] == list(range(1, STEPS + 1))


def test_sigterm_in_a_fresh_interpreter(tmp_path, reference):
    """`python -m finetune ...` as a scheduler starts it; SIGTERM after training is under way."""
    run, log = tmp_path / "run", tmp_path / "log"
    extra = ["train.save_every=8"]
    proc = spawn_cli(BASE[:] + [f"output.dir={run}", *extra], log, env={"OMP_NUM_THREADS": "1"})
    wait_for_first_metrics(run, lambda: proc.poll() is None, timeout=300)
    proc.send_signal(signal.SIGTERM)
    seen = last_metrics_step(run)
    code = proc.wait(timeout=90)
    check_stop_and_resume(run, log, code, seen, int(signal.SIGTERM), reference, extra)


def test_sigint_with_a_checkpoint_every_step(tmp_path, reference):
    """Ctrl-C while every step also writes its scheduled checkpoint: the stop must still happen."""
    run, log = tmp_path / "run", tmp_path / "log"
    extra = ["train.save_every=1"]
    pid = fork_cli(BASE + [f"output.dir={run}", *extra], log)
    wait_for_first_metrics(run, lambda: alive(pid))
    os.kill(pid, signal.SIGINT)
    seen = last_metrics_step(run)
    code = wait_pid(pid, 90)
    check_stop_and_resume(run, log, code, seen, int(signal.SIGINT), reference, extra)
