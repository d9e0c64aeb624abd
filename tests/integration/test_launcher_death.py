"""kill -9 of the launcher of a 2-process run (FSDP2 over gloo, `accelerate launch` as users start it): the
workers, each in a session of its own, are not signalled by anyone; they notice their parent is gone, write
a checkpoint together at the next micro-batch boundary and exit, instead of running on as orphans holding the
run lock. The same command then resumes from that checkpoint."""
from __future__ import annotations

import signal
import time

import pytest

from .procs import last_metrics_step, trained_steps
from .test_distributed_faults import STOP_BOUND, launch, newest_step, training

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_workers_checkpoint_and_exit_when_their_launcher_is_killed(tmp_path):
    import psutil

    run = tmp_path / "run"
    proc, ranks = training(run, tmp_path / "a.log")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # The launcher is gone, so the kernel has sent the workers their SIGTERM (PR_SET_PDEATHSIG): rank 0 stops
    # after the step under way at the latest.
    seen = last_metrics_step(run)
    gone, alive = psutil.wait_procs(list(ranks.values()), timeout=STOP_BOUND)  # a guard against a hang
    took = time.monotonic() - t0
    text = (tmp_path / "a.log").read_text()
    for p in alive:
        p.kill()
    assert not alive, f"after {took:.1f} s\n{text[-3000:]}"  # (their exit codes belong to the dead launcher)
    step = newest_step(run)
    assert f"stopped by signal 15: wrote checkpoints/step-{step}" in text and step <= seen + 1, f"{seen}\n{text[-3000:]}"
    assert "the launcher (pid" in text
    print(f"\nlauncher killed: both workers checkpointed step {step} and exited after {took:.1f} s")

    # The same command (with an end in sight) resumes from that checkpoint.
    proc = launch(run, tmp_path / "b.log", extra=[f"train.max_steps={step + 2}"])
    code = proc.wait(timeout=600)
    text = (tmp_path / "b.log").read_text()
    assert code == 0, text[-3000:]
    assert f"resume: from {run / 'checkpoints' / f'step-{step}'} (step {step})" in text, text[-3000:]
    assert trained_steps(text) == [step + 1, step + 2], text[-3000:]  # resumed, not restarted
