"""Checkpoints: adapter + optimizer + scheduler + RNG + data position, never the frozen base.

A checkpoint is written under a temporary name and renamed once every rank has finished, so a visible
`checkpoints/step-N/` is always complete: its manifest (written last) lists every file with its size, and
resuming takes the newest checkpoint whose files match it. Old checkpoints are renamed away before they
are deleted, so a crash mid-delete never leaves a visible, partial one. The adapter inside is in PEFT
format, full shapes (gathered). Each rank writes its own optimizer and RNG state (sharded under FSDP).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from finetune.util import atomic
from finetune.util.errors import explain
from finetune.util.log import log

STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "trainer_state.json"


def _torch_save(obj, path: Path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic.write_bytes(path, buf.getbuffer())


def write_adapter(out: Path, peft_config, state: dict):
    """PEFT format from a full (gathered) adapter state dict: loads with PeftModel.from_pretrained."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    atomic.write_bytes(out / "adapter_model.safetensors", safetensors_bytes(tensors, metadata={"format": "pt"}))
    peft_config.save_pretrained(str(out))


def publish_dir(final: Path, build) -> Path:
    """Write a directory atomically: `build(tmp)` fills a hidden sibling, which then replaces `final`.
    A crash or a failed write leaves the old `final` (or none), never a half-written one."""
    try:
        return atomic.build_dir(final, build)
    except OSError as e:
        raise explain(e, f"writing {final.name}", final) from e


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every visible checkpoint with a manifest, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / MANIFEST).exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path, notice=log.warning) -> Path | None:
    """The newest checkpoint that passes `problems()`. A newer one that fails (a disk that lost data
    after the rename, a manifest edited by hand) is skipped with a notice (stderr; tests collect or
    silence it with `notice`), not resumed from."""
    for _, path in reversed(list_checkpoints(root)):
        why = problems(path)
        if not why:
            return path
        if notice:
            notice(f"resume: skipping {path}: {why}")
    return None


def save(root: Path, step: int, *, rank: int, world: int, barrier, adapter: tuple | None, optimizer, scheduler,
         data_state: dict, keep: int) -> Path:
    """Collective: every rank calls it. `adapter` is (peft_config, full_state) on rank 0, None elsewhere.

    A failed write (disk full, quota) raises OutputWriteError on that rank; the .tmp-* directory is
    never renamed, so no visible step-N is partial."""
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        _torch_save(optimizer.state_dict(), tmp / f"optimizer-rank{rank}.pt")
        _torch_save(_rng_state(), tmp / f"rng-rank{rank}.pt")
        if rank == 0:
            write_adapter(tmp / "adapter", *adapter)
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        barrier()
        if rank == 0:
            atomic.fsync_tree(tmp)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            # The manifest is written last, then the directory is renamed: a crash before the rename leaves
            # only a .tmp-* directory, which is ignored and cleaned; a visible step-N always has everything,
            # and the sizes let `problems()` notice files that lost data anyway (a disk lying about fsync).
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"step": step, "world_size": world, "data": data_state, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            atomic.replace_dir(tmp, final)
            for _, old in list_checkpoints(root)[:-keep]:
                atomic.delete_dir(old)
    except OSError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise explain(e, f"writing checkpoint step-{step}", root) from e
    barrier()
    return final


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def problems(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None: the manifest must parse and every file it lists
    must be there with the size it had when written."""
    try:
        state = json.loads((path / MANIFEST).read_text())
        files = state["files"]
        state["step"], state["world_size"], state["data"]["cursor"]
        if not isinstance(files, dict):  # {relative path: size in bytes}
            raise TypeError("files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({type(e).__name__})"
    for name, size in files.items():
        p = path / name
        if not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {size}"
    return None


def verify(path: Path, world: int) -> dict:
    """The manifest of a complete checkpoint written by `world` processes; RuntimeError otherwise."""
    why = problems(path)
    if why:
        raise RuntimeError(f"checkpoint {path} is incomplete: {why}")
    state = json.loads((path / MANIFEST).read_text())
    if state["world_size"] != world:
        raise RuntimeError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                           f"{world}; optimizer state is sharded per rank")
    return state


def load_training_state(path: Path, rank: int, optimizer, scheduler):
    optimizer.load_state_dict(torch.load(path / f"optimizer-rank{rank}.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / f"rng-rank{rank}.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        from finetune.train.device import restore_cuda_rng

        restore_cuda_rng(rng["cuda"])  # only the devices visible now (fewer GPUs than at save time is fine)


def clean_partial(root: Path):
    """Remove leftovers of an interrupted checkpoint write (.tmp-*) or delete (.del-*)."""
    if root.is_dir():
        for p in [*root.glob(".tmp-step-*"), *root.glob(".del-step-*")]:
            shutil.rmtree(p, ignore_errors=True)
