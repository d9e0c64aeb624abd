"""Checkpoints: adapter + optimizer + scheduler + RNG + data position, never the frozen base.

A checkpoint is written under a temporary name and renamed once every rank has finished, so a visible
`checkpoints/step-N/` is always complete. The adapter inside is in PEFT format, full shapes (gathered).
Each rank writes its own optimizer and RNG state (sharded under FSDP).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "trainer_state.json"


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


def write_adapter(out: Path, peft_config, state: dict):
    """PEFT format from a full (gathered) adapter state dict: loads with PeftModel.from_pretrained."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    peft_config.save_pretrained(str(out))


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / MANIFEST).exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save(root: Path, step: int, *, rank: int, world: int, barrier, adapter: tuple | None, optimizer, scheduler,
         data_state: dict, keep: int) -> Path:
    """Collective: every rank calls it. `adapter` is (peft_config, full_state) on rank 0, None elsewhere."""
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(optimizer.state_dict(), tmp / f"optimizer-rank{rank}.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        write_adapter(tmp / "adapter", *adapter)
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    barrier()
    if rank == 0:
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        # The manifest is written last, then the directory is renamed: a crash before the rename leaves only
        # a .tmp-* directory, which is ignored and cleaned; a visible step-N always has everything.
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "world_size": world, "data": data_state,
                                                "files": files}, indent=1))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def verify(path: Path, world: int) -> dict:
    """Read the manifest and check every listed file is there and the world size matches."""
    state = json.loads((path / MANIFEST).read_text())
    missing = [f for f in state["files"] if not (path / f).exists()]
    if missing:
        raise RuntimeError(f"checkpoint {path} is incomplete: missing {missing[:3]}")
    if state["world_size"] != world:
        raise RuntimeError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                           f"{world}; optimizer state is sharded per rank")
    return state


def load_training_state(path: Path, rank: int, optimizer, scheduler):
    optimizer.load_state_dict(torch.load(path / f"optimizer-rank{rank}.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    torch.set_rng_state(torch.load(path / f"rng-rank{rank}.pt", weights_only=True)["torch"])


def clean_partial(root: Path):
    """Remove leftovers of a checkpoint write that was interrupted."""
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
