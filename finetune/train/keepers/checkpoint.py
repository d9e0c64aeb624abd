"""Checkpoints: adapter + optimizer + scheduler + RNG + data position, never the frozen base.

A checkpoint is written under a temporary name and renamed once every rank has finished, so a visible
`checkpoints/step-N/` is always complete: its manifest (written last) lists every file with its size and
SHA-256, and resuming takes the newest checkpoint whose files match it (newer ones that do not are moved
aside to `corrupt-step-N`). Pruning keeps the newest `keep` checkpoints that are intact and removes the
rest; old checkpoints are renamed away before they are deleted, so a crash mid-delete never leaves a
visible, partial one. The manifest also holds the run's fingerprint (finetune.recipe.fingerprint). The adapter inside is in PEFT
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

from finetune.recipe import fingerprint as fp
from finetune.util import atomic
from finetune.util.digest import file_sha256
from finetune.util.errors import RecipeError, explain
from finetune.util.untrusted import safetensors_problem, weights_only_problem
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
         data_state: dict, keep: int, fingerprint: dict | None = None, scaler_state: dict | None = None,
         beside: tuple[str, ...] = ()) -> Path:
    """Collective: every rank calls it. `adapter` is (peft_config, full_state) on rank 0, None elsewhere.
    `beside`: files of the run dir (paths relative to it) that a resume reads besides the checkpoint (DPO's
    reference log-probs); the manifest records their size and SHA-256 as it does the checkpoint's own files.

    A failed write (disk full, quota) raises OutputWriteError on that rank; the .tmp-* directory is
    never renamed, so no visible step-N is partial."""
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    try:
        if rank == 0:
            # Prune before writing as well as after: a run killed between a rename and its prune left keep+1
            # checkpoints, and each resumed run killed at that moment again would add one more (the disk
            # fills). Pruning first bounds the count at keep+1 whenever a kill lands.
            prune(root, keep)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        _torch_save(optimizer.state_dict(), tmp / f"optimizer-rank{rank}.pt")
        _torch_save(_rng_state(), tmp / f"rng-rank{rank}.pt")
        if scaler_state:  # fp16: the loss scale reached, so a resumed run does not start over at 2^16
            _torch_save(scaler_state, tmp / f"scaler-rank{rank}.pt")
        if rank == 0:
            write_adapter(tmp / "adapter", *adapter)
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        barrier()
        if rank == 0:
            atomic.fsync_tree(tmp)
            files = {str(p.relative_to(tmp)): _file_entry(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            outside = {name: _file_entry(root.parent / name) for name in beside}
            # The manifest is written last, then the directory is renamed: a crash before the rename leaves
            # only a .tmp-* directory, which is ignored and cleaned; a visible step-N always has everything,
            # and the sizes and hashes let `problems()` notice files that lost data anyway (a disk lying
            # about fsync, a bit flip).
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"step": step, "world_size": world, "data": data_state, "files": files,
                           "fingerprint": fingerprint or {}, **({"beside": outside} if outside else {})}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            atomic.replace_dir(tmp, final)
            prune(root, keep)
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


def _file_entry(p: Path) -> dict:
    return {"bytes": p.stat().st_size, "sha256": file_sha256(p)}


def beside_problem(manifest: dict, run_dir: Path, name: str) -> str | None:
    """Why RUN_DIR/`name` is not the file the checkpoint's manifest recorded beside it (missing, another size,
    another SHA-256), or None; None too when the manifest recorded nothing (checkpoints older than `beside`)."""
    want = manifest.get("beside", {}).get(name)
    if want is None:
        return None
    path = Path(run_dir) / name
    if not path.is_file():
        return f"{path} is missing"
    got = path.stat().st_size
    if got != want["bytes"]:
        return f"{path} has {got} bytes, the checkpoint recorded {want['bytes']} (truncated or replaced)"
    if file_sha256(path) != want["sha256"]:
        return f"{path} is not the file the checkpoint recorded (its SHA-256 differs)"
    return None


def problems(path: Path, hashes: bool = True) -> str | None:
    """Why `path` is not a complete checkpoint, or None: the manifest must parse, hold values of the right
    types (its step the directory's), and every file it lists must be there with the size and (when
    `hashes`) the SHA-256 it had when written; with `hashes`, every torch file must also load with the
    weights-only unpickler and the adapter's safetensors header must fit the file (the hashes cover the
    files, not the manifest: one edited with the files proves nothing). Manifests of older versions list
    sizes only ({name: bytes})."""
    try:
        state = json.loads((path / MANIFEST).read_text())
        files = state["files"]
        if not isinstance(files, dict):  # {relative path: {"bytes": n, "sha256": hex}}
            raise TypeError("files")
        files = {k: v if isinstance(v, dict) else {"bytes": v} for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest ({type(e).__name__})"
    bad = manifest_problem(state, files, path.name)
    if bad:
        return f"hand-edited manifest ({bad})"
    for name, want in files.items():
        p = path / name
        if ".." in Path(name).parts or Path(name).is_absolute() or p.is_symlink() or not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != want.get("bytes"):
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want.get('bytes')}"
        if hashes and "sha256" in want and file_sha256(p) != want["sha256"]:
            return f"{name} does not have the content it was written with (SHA-256 differs)"
        why = (weights_only_problem(p) if name.endswith(".pt") else
               safetensors_problem(p) if name.endswith(".safetensors") else None) if hashes else None
        if why:
            return f"{name}: {why}"
    return None


def _count(v, least: int = 0) -> bool:
    return type(v) is int and least <= v < 2 ** 53


def manifest_problem(state: dict, files: dict, dirname: str) -> str | None:
    """The manifest's fields that a resume trusts, checked by type and range: a step that is not the
    directory's (`step: 1e30` would end the run at once as done), a process count, a data position."""
    m = STEP_DIR.match(dirname)
    data = state.get("data")
    if not _count(state.get("step")) or (m and state["step"] != int(m.group(1))):
        return f"step {state.get('step')!r} is not this directory's step"
    if not _count(state.get("world_size"), 1):
        return f"world_size {state.get('world_size')!r} is not a process count"
    if not isinstance(data, dict) or not _count(data.get("cursor")) or not _count(data.get("epoch", 0)):
        return f"data {data!r} is not a data position"
    for name, want in files.items():
        if not isinstance(name, str) or not _count(want.get("bytes")) or not isinstance(want.get("sha256", ""), str):
            return f"files entry {name!r} is not {{bytes, sha256}}"
    beside = state.get("beside", {})
    if not isinstance(beside, dict) or not all(isinstance(v, dict) and _count(v.get("bytes"))
                                               and isinstance(v.get("sha256"), str) for v in beside.values()):
        return "beside is not a mapping of run dir files to {bytes, sha256}"
    keys = state.get("fingerprint", {})
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        return "fingerprint is not a mapping of recipe keys to values"
    return None


def verify(path: Path, world: int | None = None) -> dict:
    """The manifest of a complete checkpoint (written by `world` processes when given); RuntimeError
    otherwise. Resuming compares the process count with the rest of the fingerprint instead."""
    why = problems(path)
    if why:
        raise RuntimeError(f"checkpoint {path} is incomplete: {why}")
    state = json.loads((path / MANIFEST).read_text())
    if world is not None and state["world_size"] != world:
        raise RuntimeError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                           f"{world}; optimizer state is sharded per rank")
    return state


def prune(root: Path, keep: int):
    """Keep the newest `keep` intact checkpoints; remove older ones and every damaged one (sizes only, to
    stay cheap at each save): never a valid checkpoint while keeping an invalid one."""
    intact, damaged = [], []
    for _, path in list_checkpoints(root):
        (damaged if problems(path, hashes=False) else intact).append(path)
    for path in damaged + intact[:-keep]:
        atomic.delete_dir(path)


def set_aside_damaged(root: Path, notice=log.warning):
    """Before resuming (main process): checkpoints newer than the newest intact one (full hash check) are
    moved to `corrupt-step-N` with a notice, so they are never resumed from, pruned in place of valid
    ones, or mixed with this run's new checkpoints; nothing is deleted."""
    for _, path in reversed(list_checkpoints(root)):
        why = problems(path)
        if not why:
            return
        aside = root / f"corrupt-{path.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        if notice:
            notice(f"resume: {path} is damaged ({why}); moved it to {aside.name} and resuming from the newest "
                   "intact checkpoint")


def load_training_state(path: Path, rank: int, optimizer, scheduler):
    optimizer.load_state_dict(torch.load(path / f"optimizer-rank{rank}.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / f"rng-rank{rank}.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:

        restore_cuda_rng(rng["cuda"])  # only the devices visible now (fewer GPUs than at save time is fine)


def load_scaler_state(path: Path, rank: int) -> dict:
    """The fp16 loss scaler's state saved with checkpoint `path` ({} when the run saved none)."""
    f = path / f"scaler-rank{rank}.pt"
    return torch.load(f, weights_only=True) if f.exists() else {}


def clean_partial(root: Path):
    """Remove leftovers of an interrupted checkpoint write (.tmp-*) or delete (.del-*)."""
    if root.is_dir():
        for p in [*root.glob(".tmp-step-*"), *root.glob(".del-step-*")]:
            shutil.rmtree(p, ignore_errors=True)


def compare_fingerprint(state: dict, current: dict, path: Path, run_dir: Path) -> list[str]:
    """The checkpoint's fingerprint against this run's (RecipeError on a defining change); the process count
    is compared even for manifests written before fingerprints existed."""
    stored = {**state.get("fingerprint", {}), "processes": json.dumps(state["world_size"])}
    return fp.compare(stored, current, f"checkpoints/{path.name}", str(run_dir))


def resolve_resume(resume, ckpt_root: Path) -> Path | None:
    """The checkpoint `train.resume` names: None for a fresh run, the newest for auto, or the path given."""
    if resume is False:
        if latest(ckpt_root):
            raise RecipeError([f"train.resume: false, but {ckpt_root} holds checkpoints; use another "
                               "output.dir or resume: auto"])
        return None
    if resume in ("auto", True):
        return latest(ckpt_root)
    p = Path(resume)
    why = problems(p) if (p / MANIFEST).exists() else "no manifest"
    if why:
        raise RecipeError([f"train.resume: {resume} is not a complete checkpoint directory ({why})"])
    return p


def restore_cuda_rng(states: list) -> int:
    """Restore the CUDA generators of the devices that exist here; returns how many were restored. A
    checkpoint written with more visible GPUs than this process has would fail `set_rng_state_all`."""
    if not torch.cuda.is_available():
        return 0
    n = min(len(states), torch.cuda.device_count())
    for i in range(n):
        torch.cuda.set_rng_state(states[i], i)
    return n
