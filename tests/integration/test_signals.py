"""SIGHUP (a closed terminal or ssh session) and SIGUSR1 (a scheduler's warning) stop a run like SIGTERM:
finish the step, write a checkpoint, exit 0. A second Ctrl-C quits at once, and Ctrl-C while the data is
being prepared quits at once (exit 130) instead of waiting for the first step. The Ctrl-Cs land at chosen
moments (tests/killpoints.py): each is sent once the run has reached the point it is meant for."""
from __future__ import annotations

import os
import signal

import pytest

from finetune.train.keepers import checkpoint as C
from tests import killpoints as KP

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
    """Ctrl-C, then Ctrl-C again while the stop's checkpoint is being written: the run is held half-way
    through that write (tests/killpoints.py) until the second Ctrl-C, which is sent only once the first
    has been handled (the save it asked for has begun). A second Ctrl-C that did not quit would leave the
    run held there."""
    warm()
    run, log, marker = tmp_path / "run", tmp_path / "log", tmp_path / "at"
    point = KP.Point("write", None, "optimizer-rank0.pt")  # the first save: the stop's (save_every=100)
    pid = fork_cli(BASE + [f"output.dir={run}", "train.save_every=100"], log, before=lambda: KP.install(point, marker))
    wait_for_first_metrics(run, lambda: alive(pid))
    os.kill(pid, signal.SIGINT)
    KP.wait_for(marker, lambda: alive(pid))
    os.kill(pid, signal.SIGINT)
    code = wait_pid(pid, 60)
    text = log.read_text()
    assert code == 130 and "second Ctrl-C" in text and "Traceback" not in text, text[-2000:]
    # It quit inside the save: the checkpoint half written stays hidden, the stop never completed.
    assert "stopped by signal" not in text and C.latest(run / "checkpoints") is None, text[-2000:]
    assert len(list((run / "checkpoints").glob(".tmp-step-*/optimizer-rank0.pt"))) == 1
    visible_checkpoints_verify(run)


def test_ctrl_c_during_data_preparation_quits_at_once(tmp_path):
    """Ctrl-C while the rows are being tokenized (the run is held in the first batch until it comes:
    tests/killpoints.py) stops the process there; it used to go on to the first step. A Ctrl-C that only
    asked for a stop would leave the run held there."""
    warm()
    run, log, marker, cache = tmp_path / "run", tmp_path / "log", tmp_path / "at", tmp_path / "cache"
    pid = fork_cli(BASE + [f"output.dir={run}"], log, env={"FINETUNE_CACHE": str(cache)},  # nothing cached yet
                   before=lambda: KP.install(KP.Point("tokenizing"), marker))
    KP.wait_for(marker, lambda: alive(pid))
    os.kill(pid, signal.SIGINT)
    code = wait_pid(pid, 60)
    text = log.read_text()
    assert code == 130 and "signal 2 before training started" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    # The preparation never finished: no tokenized rows cached, no model announced, no step taken.
    assert not list(cache.rglob("train-*.arrow")) and "model:" not in text, text[-2000:]
    assert not (run / "metrics.jsonl").exists()
