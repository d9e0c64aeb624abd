"""Checkpoints stay trustworthy when the process dies or the disk fails mid-write.

The real `checkpoint.save` runs in forked children that are SIGKILLed at chosen moments or that hit a
real write failure (RLIMIT_FSIZE: the kernel refuses writes past a size, as a full disk refuses them).
No model is involved: a small torch optimizer and a real PEFT LoraConfig stand in for the training state.
"""
from __future__ import annotations

import json
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from finetune.train.keepers import checkpoint as C
from tests import killpoints as KP


def training_state(seed: int = 0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 256)) for _ in range(4)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    adapter = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": p.detach().clone() for i, p in enumerate(params)}
    return opt, sched, (LoraConfig(r=64, target_modules=["q_proj"]), adapter)


def save(root: Path, step: int, keep: int = 2, state=None):
    opt, sched, adapter = state or training_state()
    return C.save(root, step, rank=0, world=1, barrier=lambda: None, adapter=adapter, optimizer=opt,
                  scheduler=sched, data_state={"epoch": 0, "cursor": step}, keep=keep)


def assert_every_visible_checkpoint_loads(root: Path):
    """What resuming does: verify, then load optimizer/scheduler/RNG state and the adapter."""
    from safetensors.torch import load_file

    for _, path in C.list_checkpoints(root):
        state = C.verify(path, 1)
        opt, sched, _ = training_state(1)
        C.load_training_state(path, 0, opt, sched)
        assert load_file(str(path / "adapter" / "adapter_model.safetensors"))
        assert state["data"]["cursor"] == state["step"]


def test_keep_prunes_and_latest_is_newest(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [2, 3]
    assert C.latest(tmp_path) == tmp_path / "step-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]  # no .tmp-/.del- leftovers
    manifest = json.loads((tmp_path / "step-3" / C.MANIFEST).read_text())
    assert manifest["files"]["optimizer-rank0.pt"]["bytes"] == (tmp_path / "step-3" / "optimizer-rank0.pt").stat().st_size
    assert_every_visible_checkpoint_loads(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_is_skipped(tmp_path, damage):
    """A disk that lost data after the rename (or a hand edit): resume falls back to the previous one."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    newest = tmp_path / "step-2"
    if damage == "truncate":
        with open(newest / "adapter" / "adapter_model.safetensors", "r+b") as f:
            f.truncate(100)
    elif damage == "delete":
        (newest / "scheduler.pt").unlink()
    else:
        (newest / C.MANIFEST).write_text('{"step": 2, "files"')
    notices = []
    assert C.latest(tmp_path, notice=notices.append) == tmp_path / "step-1"
    assert len(notices) == 1 and "step-2" in notices[0]
    with pytest.raises(RuntimeError, match="incomplete"):
        C.verify(newest, 1)


def _in_child(fn) -> dict:
    """Run fn() in a forked child; its result (or exception) comes back as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            out = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts on it
            out = {"error": type(e).__name__, "message": str(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.parametrize("limit", [0, 2_000, 70_000, 200_000, 300_000])
def test_a_write_that_fails_midway_leaves_no_checkpoint_that_looks_complete(tmp_path, limit):
    """The kernel refuses writes past `limit` bytes per file (EFBIG, like ENOSPC on a full disk) at
    different points of the save: optimizer, RNG, adapter. The failed step never becomes visible, the
    error says what happened, and the previous checkpoint still loads."""
    save(tmp_path, 1)
    state = training_state(2)

    def limited_save():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            save(tmp_path, 2, state=state)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    out = _in_child(limited_save)
    assert out.get("error") == "OutputWriteError", out
    assert "writing checkpoint step-2 failed: the file size limit was reached" in out["message"]
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [1]
    assert C.latest(tmp_path) == tmp_path / "step-1"
    assert not list(tmp_path.glob(".tmp-*")), "a failed save removes its temporary directory"
    assert_every_visible_checkpoint_loads(tmp_path)
    save(tmp_path, 2, state=state)  # with room again, the same save succeeds
    assert C.latest(tmp_path) == tmp_path / "step-2"


def test_a_kill_between_rename_and_prune_never_leaves_more_than_keep_plus_one(tmp_path, monkeypatch):
    """Runs killed right after a checkpoint's rename, before its prune, left keep+1 checkpoints each time;
    the next save prunes first, so the count stays at keep+1 however often that moment is hit."""
    for step in (1, 2, 3, 4):  # what earlier runs killed at that moment would have left behind
        save(tmp_path, step, keep=10)
    real_replace = C.atomic.replace_dir

    def rename_then_die(tmp, final):
        real_replace(tmp, final)
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after the rename runs

    monkeypatch.setattr(C.atomic, "replace_dir", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 5)
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [3, 4, 5]
    assert_every_visible_checkpoint_loads(tmp_path)


# Where each trial's child is SIGKILLed (which of its saves: Point.step counts from 1), and which save of it
# is then the newest visible checkpoint (0: the one killed, -1: the one before). Each child resumes from
# what the kills before left: after "renamed" three checkpoints are visible, so the next save's first
# delete ("pruning" 1) is its prune before writing; elsewhere it is the prune after its rename.
KILLS = [(KP.Point("save", 3), -1), (KP.Point("write", 1, "optimizer-rank0.pt"), -1),
         (KP.Point("write", 2, "rng-rank0.pt"), -1), (KP.Point("write", 1, "adapter_model.safetensors"), -1),
         (KP.Point("write", 2, "scheduler.pt"), -1), (KP.Point("manifest", 1), -1), (KP.Point("renamed", 1), 0),
         (KP.Point("pruning", 1), -1), (KP.Point("renamed", 2), 0), (KP.Point("pruning", 2), 0),
         (KP.Point("save", 2), -1)]


@pytest.mark.slow
def test_sigkill_at_every_moment_of_a_save_never_leaves_a_partial_checkpoint(tmp_path):
    """A child saves checkpoints back to back (keep=2, so it also prunes), resuming from whatever is on
    disk, and is SIGKILLed at a chosen moment (tests/killpoints.py): between saves, half-way through each
    file, with the manifest written but not renamed, after the rename before the prune, and mid-delete of
    a pruned one. After every kill the newest visible checkpoint is the last one renamed, each visible
    checkpoint is complete and loads, and the leftovers are hidden names that the next run cleans."""
    state = training_state(3)
    root = tmp_path / "ckpt"
    for trial, (kp, newest) in enumerate(KILLS):
        last = C.latest(root)
        first = int(last.name.split("-")[1]) + 1 if last else 1
        point = KP.Point(kp.kind, first + kp.step - 1, kp.name)
        marker = tmp_path / f"at-{trial}"
        pid = os.fork()
        if pid == 0:
            try:
                KP.install(point, marker)
                C.clean_partial(root)
                for step in range(first, point.step + 2):  # then it ends: a point never reached fails the wait
                    save(root, step, state=state)
            finally:
                os._exit(1)
        try:
            assert KP.wait_for(marker, lambda pid=pid: os.waitpid(pid, os.WNOHANG)[0] == 0) == str(point)
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):  # it ended by itself, already reaped
                pass
        n = point.step
        visible = C.list_checkpoints(root)
        assert all(C.problems(p) is None for _, p in visible), (trial, [(p, C.problems(p)) for _, p in visible])
        # The newest visible checkpoint is the last one renamed into place: never the one being written.
        assert C.latest(root) == root / f"step-{n + newest}", (trial, point, visible)
        assert len(visible) <= 3
        hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
        if point.kind == "write":  # a part of the file is there, in the hidden directory only
            assert hidden == [f".tmp-step-{n}"] and list(root.glob(f".tmp-step-{n}/**/{point.name}")), hidden
        elif point.kind == "manifest":
            assert hidden == [f".tmp-step-{n}"] and (root / f".tmp-step-{n}" / C.MANIFEST).exists(), hidden
        elif point.kind == "pruning":
            assert len(hidden) == 1 and hidden[0].startswith(".del-step-"), hidden
        else:
            assert hidden == [], hidden
        if point.kind == "renamed":
            assert len(visible) == 3  # keep + 1 until the prune the kill prevented
        for p in root.iterdir():
            assert p.name.startswith(("step-", ".tmp-step-", ".del-step-")), p
    assert C.latest(root) == root / "step-10"  # each child got on: 10 saves completed over the 11 kills
    assert_every_visible_checkpoint_loads(root)
    C.clean_partial(root)
    assert all(p.name.startswith("step-") for p in root.iterdir())


def test_publish_dir_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "adapter"
    C.publish_dir(final, lambda d: (d / "a.txt").write_text("one"))

    def broken(d: Path):
        (d / "a.txt").write_text("two")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="the disk is full"):
        C.publish_dir(final, broken)
    assert (final / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    C.publish_dir(final, lambda d: (d / "b.txt").write_text("three"))
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]


def test_pruning_keeps_valid_checkpoints_over_damaged_ones(tmp_path):
    """A damaged checkpoint (here truncated) never survives pruning in place of a valid older one."""
    for step in (1, 2):
        save(tmp_path, step)
    with open(tmp_path / "step-2" / "scheduler.pt", "r+b") as f:
        f.truncate(10)
    save(tmp_path, 3)
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [1, 3]
    assert_every_visible_checkpoint_loads(tmp_path)


def test_same_size_corruption_is_found_by_hash_and_set_aside(tmp_path):
    for step in (1, 2):
        save(tmp_path, step)
    f = tmp_path / "step-2" / "adapter" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    notices = []
    C.set_aside_damaged(tmp_path, notice=notices.append)
    assert "SHA-256 differs" in notices[0] and (tmp_path / "corrupt-step-2").is_dir()
    assert C.latest(tmp_path) == tmp_path / "step-1"


def test_checkpoint_hashes_without_python_311s_file_digest(tmp_path, monkeypatch):
    """Python 3.10 is supported (pyproject) and has no hashlib.file_digest: a first checkpoint save after a
    whole training run must not crash there. Removing it here stands in for 3.10."""
    import hashlib

    from finetune.util.digest import file_sha256

    monkeypatch.delattr(hashlib, "file_digest", raising=False)
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(3 * 2**20 + 17))  # several read blocks and a short last one
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
