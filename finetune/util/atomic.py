"""Write-then-rename: a file or directory that can be seen is complete. A crash or a failed write leaves the
previous version (or nothing), never half of one. Data is fsynced before the rename that publishes it, so
after a power loss a renamed file cannot be empty or truncated."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


def write_bytes(path: Path, data: bytes) -> None:
    """Plain Python I/O, so a failed write raises OSError with its errno (disk full, quota, ...): torch.save
    and safetensors' save_file, writing themselves, report it as an error whose only trace is the message."""
    # O_NOFOLLOW: a link planted at a name finetune writes is an error (ELOOP), never written through.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        from finetune.util.errors import RecipeError

        raise RecipeError([f"{path} is a symbolic link (to {os.readlink(path)}); finetune does not write through "
                           "links: remove it"]) from None
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def temp_name(path: Path) -> Path:
    """The hidden sibling `write_text` writes before the rename (listed among a run dir's written names)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (a hidden sibling, fsynced, then renamed over it). A link planted
    at the sibling is refused (O_NOFOLLOW); one planted at `path` is replaced by the rename, never followed."""
    path = Path(path)
    tmp = temp_name(path)
    write_bytes(tmp, text.encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """Flush every file's data, then the directory, before the rename that publishes them."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`. An existing `final` is renamed away first (atomic),
    then deleted: a crash mid-delete leaves a hidden `.del-*` directory, never a visible one with files gone."""
    if final.exists():
        trash = final.parent / f".del-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def delete_dir(path: Path) -> None:
    """Rename away, then delete: a visible directory is never half deleted."""
    trash = path.parent / f".del-{path.name}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def build_dir(final: Path, build, tmp: Path | None = None) -> Path:
    """`build(tmp)` fills a hidden sibling, fsynced, which then replaces `final`. On an error the sibling is
    removed and the error raised; the old `final` (or none) stays."""
    tmp = tmp or final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        build(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)
    return final
