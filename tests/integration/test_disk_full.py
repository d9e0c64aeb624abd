"""A disk that fills up mid-run: the checkpoint write fails with a clear error (exit 1, no traceback),
nothing that looks like a complete checkpoint is left, and with room again the same command finishes.
Also: the planned checkpoint size the preflight checks free space against matches what a run writes."""
from __future__ import annotations

import resource
import signal

import pytest
from safetensors.torch import load_file

from finetune import recipe as R
from finetune.plan import disk as D
from finetune.plan.archs import resolve
from finetune.train.keepers import checkpoint as C

from .procs import fork_cli, wait_pid
from .test_crash_safety import warm

pytestmark = pytest.mark.slow

ARGS = ["recipes/tiny_cpu.yaml", "train.max_steps=4", "train.warmup_steps=1", "train.save_every=2",
        "train.micro_batch_size=4", "train.log_every=1", "eval.max_batches=1", "output.progress_bar=false",
        "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 32}]", "data.eval_sources=[]"]


def file_size_limit(limit: int):
    def apply():
        # The kernel then refuses any write past `limit` bytes in a file (EFBIG): a full disk as one
        # process sees it, without filling the machine's disk.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return apply


def test_disk_full_at_the_first_checkpoint_then_resume_with_room(tmp_path):
    warm()
    run, log = tmp_path / "run", tmp_path / "log"
    pid = fork_cli(ARGS + [f"output.dir={run}"], log, before=file_size_limit(200_000))
    code = wait_pid(pid, 300)
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert "error: writing checkpoint step-2 failed: the file size limit was reached" in text, text[-3000:]
    assert "Traceback" not in text
    assert C.list_checkpoints(run / "checkpoints") == [] and not list((run / "checkpoints").glob(".tmp-*"))
    assert not (run / "adapter").exists()

    pid = fork_cli(ARGS + [f"output.dir={run}"], tmp_path / "log2")
    assert wait_pid(pid, 300) == 0, (tmp_path / "log2").read_text()[-3000:]
    assert "resume:" not in (tmp_path / "log2").read_text()
    assert load_file(str(run / "adapter" / "adapter_model.safetensors"))

    # The plan the preflight compares with free space, against what this run wrote.
    r = R.load(ARGS[0], ARGS[1:] + [f"output.dir={run}"])
    need = D.planned_bytes(r, resolve(r.model.name)[0], 1)
    step = C.latest(run / "checkpoints")
    actual = D.sizeof(step)
    assert actual <= need.checkpoint <= 2 * actual, (actual, need.checkpoint)
    assert D.sizeof(run / "adapter") <= need.adapter
    assert need.copies == 3 and len(C.list_checkpoints(run / "checkpoints")) == 2
