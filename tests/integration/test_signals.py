"""SIGHUP (a closed terminal or ssh session) and SIGUSR1 (a scheduler's warning) stop a run like SIGTERM:
finish the step, write a checkpoint, exit 0. A second Ctrl-C quits at once, and Ctrl-C while the data is
being prepared quits at once (exit 130) instead of waiting for the first step."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from finetune.train.keepers import checkpoint as C

from .procs import alive, fork_cli, wait_for_first_metrics, wait_pid
from .test_crash_safety import warm
from .test_preemption import BASE, stopped_step

pytestmark = pytest.mark.slow


def visible_checkpoints_verify(run):
    for _, path in C.list_checkpoints(run / "checkpoints"):
        assert C.problems(path) is None, path


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1], ids=["SIGHUP", "SIGUSR1"])
def test_hangup_and_scheduler_warning_checkpoint_and_stop(tmp_path, sig):
    warm()
    run, log = tmp_path / "run", tmp_path / "log"
    pid = fork_cli(BASE + [f"output.dir={run}", "train.save_every=100"], log)
    wait_for_first_metrics(run, lambda: alive(pid))
    os.kill(pid, sig)
    code = wait_pid(pid, 90)
    text = log.read_text()
    assert code == 0 and f"stopped by signal {int(sig)}" in text, text[-2000:]
    step = stopped_step(text)
    assert C.latest(run / "checkpoints") == run / "checkpoints" / f"step-{step}"
    visible_checkpoints_verify(run)


def test_a_second_ctrl_c_quits_at_once(tmp_path):
    warm()
    run, log = tmp_path / "run", tmp_path / "log"
    pid = fork_cli(BASE + [f"output.dir={run}", "train.save_every=100"], log)
    wait_for_first_metrics(run, lambda: alive(pid))
    os.kill(pid, signal.SIGINT)
    time.sleep(0.1)  # two signals sent back to back are merged into one by the kernel
    os.kill(pid, signal.SIGINT)
    code = wait_pid(pid, 60)
    text = log.read_text()
    assert code == 130 and "interrupted" in text and "Traceback" not in text, text[-2000:]
    visible_checkpoints_verify(run)


def test_ctrl_c_during_data_preparation_quits_at_once(tmp_path):
    """40,000 rows take seconds to read and tokenize; Ctrl-C then used to wait for the first step."""
    warm()
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}\n", "completion": f"word {i} " * 8}) + "\n"
                            for i in range(40_000)))
    run, log = tmp_path / "run", tmp_path / "log"
    pid = fork_cli(BASE + [f"output.dir={run}", f"data.sources=[{{path: '{data}'}}]"], log,
                   env={"FINETUNE_CACHE": str(tmp_path / "cache")})
    deadline = time.monotonic() + 120
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731 - the child creates it
    while "tokenizing" not in text() and time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    assert "tokenizing" in text(), text()[-2000:]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGINT)
    code = wait_pid(pid, 60)
    text = log.read_text()
    assert code == 130 and "interrupted" in text, text[-2000:]
    took = time.monotonic() - t0
    assert took < 30, took  # a bound, not a figure: not after the rest of the preparation and a step
    assert not (run / "metrics.jsonl").exists()
