"""Two processes (FSDP2 over gloo, launched as users launch it): preemption and a dying rank.

- SIGTERM to every rank (what SLURM sends the tasks on preemption): each finishes its step, they write
  one checkpoint together, each exits 0, and so does the launcher. "Its step" is checked by events, not
  time: the stop is at most one step after the last metrics line seen once the signals were sent.
- Re-running resumes from it (training only the steps after it); Ctrl-C (SIGINT to the launcher's process
  group, as a terminal sends it; the launcher forwards it to the ranks) then stops the resumed run the same
  way, at a later step and long before the run's end.
- SIGKILL of one rank: the job exits 1 (the launcher's ChildFailedError) within the documented bound
  (docs/robustness.md) and no
  process is left behind; the checkpoints on disk stay complete.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from finetune.train.keepers import checkpoint as C

from .procs import (
    ROOT,
    last_metrics_step,
    metrics,
    rank_processes,
    spawn_cli,
    trained_steps,
    wait_for_first_metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAUNCHER = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0",  # a free port
            "--config_file", str(ROOT / "configs" / "cpu_fsdp.yaml"), "--num_processes", "2", "-m", "finetune"]
ARGS = ["recipes/tiny_cpu_fsdp.yaml", "train.max_steps=200", "train.log_every=1", "train.warmup_steps=2",
        "train.save_every=100", "data.max_samples=400", "output.progress_bar=false", "eval.max_batches=1"]
DYING_RANK_BOUND = 45  # s: torchrun's monitor (0.1 s) + its 30 s grace before SIGKILL, plus slack for a busy CI
# s: only a guard against a hang (a stop takes one step and one checkpoint write, about a second each here);
# how soon a stop happens is checked in steps (see above).
STOP_BOUND = 120


# A rank that crashes (a fatal signal, an abort) prints the Python stack of each of its threads first.
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
CRASH = re.compile(r"Fatal Python error|terminate called|Traceback \(most recent call last\)|Signal \d+ \(SIG")


def launch(run, log, extra=()):
    return spawn_cli(ARGS + [f"output.dir={run}", *extra], log, env=LAUNCH_ENV, launcher=LAUNCHER)


def shown(text: str) -> str:
    """A launch's log as a failed assertion shows it (a str: pytest prints it whole, where it would cut the
    repr of a tuple): from the first sign of a crashed rank, else its end."""
    m = CRASH.search(text)
    return text[m.start():][:8000] if m else text[-4000:]


def training(run, log):
    """(launcher, {rank: worker}) of a 2-process run that has logged its first step."""
    proc = launch(run, log)
    wait_for_first_metrics(run, lambda: proc.poll() is None, timeout=600)
    ranks = rank_processes(proc.pid)
    assert sorted(ranks) == [0, 1]
    return proc, ranks


def newest_step(run) -> int:
    path = C.latest(run / "checkpoints", notice=None)
    assert path is not None and C.verify(path, 2)  # written by both ranks (one optimizer shard each)
    assert {"optimizer-rank0.pt", "optimizer-rank1.pt"} <= {p.name for p in path.iterdir()}
    return int(path.name.split("-")[1])


def test_preemption_resume_and_a_dying_rank(tmp_path):
    run = tmp_path / "run"

    # 1. SIGTERM to every rank.
    proc, ranks = training(run, tmp_path / "a.log")
    for r in ranks.values():
        r.send_signal(signal.SIGTERM)
    seen = last_metrics_step(run)  # the signals were pending: rank 0 stops after the step under way at the latest
    code = proc.wait(timeout=STOP_BOUND)
    text = (tmp_path / "a.log").read_text()
    assert code == 0, f"launcher exit {code}\n{shown(text)}"
    first = newest_step(run)
    assert f"stopped by signal 15: wrote checkpoints/step-{first}" in text and first <= seen + 1, f"{seen}\n{shown(text)}"
    assert max(m["step"] for m in metrics(run)) == first

    # 2. The same command resumes; Ctrl-C to the whole process group stops it at a later step.
    proc = launch(run, tmp_path / "b.log")
    wait_for_first_metrics(run, lambda: proc.poll() is None, timeout=600, min_step=first + 1)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=STOP_BOUND)
    text = (tmp_path / "b.log").read_text()
    assert f"resume: from {run / 'checkpoints' / f'step-{first}'} (step {first})" in text, shown(text)
    second = newest_step(run)
    assert f"stopped by signal 2: wrote checkpoints/step-{second}" in text, shown(text)
    # A later step, long before the run's end (200 steps); trained from the checkpoint on, not from step 1.
    assert first < second < 200 and trained_steps(text) == list(range(first + 1, second + 1)), shown(text)
    assert "failed (exitcode" not in text, shown(text)  # no rank failed: each wrote its shard and returned 0
    # (The launcher itself was signalled too: torchrun then re-raises the signal, exit 1; docs/robustness.md.)

    # 3. SIGKILL one rank: the job ends non-zero within the bound; nothing hangs or stays behind.
    proc = launch(run, tmp_path / "c.log")
    wait_for_first_metrics(run, lambda: proc.poll() is None, timeout=600, min_step=second + 1)
    ranks = rank_processes(proc.pid)
    t0 = time.monotonic()
    ranks[1].kill()
    code = proc.wait(timeout=DYING_RANK_BOUND + 60)
    elapsed = time.monotonic() - t0
    text = (tmp_path / "c.log").read_text()
    # 1: the launcher's ChildFailedError, uncaught (accelerate re-raises torchrun's); not a rank's own exit code
    assert code == 1 and elapsed < DYING_RANK_BOUND, f"launcher exit {code} after {elapsed:.1f} s\n{text[-3000:]}"
    assert "ChildFailedError" in text
    for r in ranks.values():
        assert not r.is_running() or r.status() == "zombie", r
    for _, path in C.list_checkpoints(run / "checkpoints"):
        assert C.problems(path) is None
    print(f"\ndying rank: launcher exited {code} after {elapsed:.1f} s")
