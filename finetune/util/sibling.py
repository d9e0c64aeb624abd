"""Outputs written beside their final name: a hidden, locked temporary sibling `.NAME.tmp-*` renamed into
place when complete, with the permissions the umask asks for. The writer holds flock(2) on the temporary for
as long as it writes; one left by a killed writer is unlocked, so the next run of the same verb into the same
output removes it (hidden full-size temporaries never stay forever), while one in use is left alone. Used by
`merge`, `quantize` (directories) and `export` (a file)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from finetune.util.log import log


def clean_stale(out: Path, verb: str) -> None:
    """Remove temporaries of earlier runs of `verb` into `out` whose writer is gone (their lock is free)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a writer running now holds it
        finally:
            os.close(fd)  # (closing also drops the lock we just took)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        log.info(f"{verb}: removed {tmp.name}, left by an earlier {verb} that did not finish")


@contextlib.contextmanager
def temp_dir(out: Path):
    """A locked temporary directory beside `out`, removed afterwards unless it was renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def temp_file(out: Path):
    """A locked temporary file beside `out` (another program may write it by name: the lock is on its
    inode), removed afterwards unless it was renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield Path(name)
    finally:
        os.close(fd)
        Path(name).unlink(missing_ok=True)


def apply_umask(root: Path) -> None:
    """Directories 0777 and files 0666, less the umask, as mkdir and open would make them (mkdtemp makes
    0700, and some writers 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, (0o777 if root.is_dir() else 0o666) & ~mask)
    for p in root.rglob("*") if root.is_dir() else ():
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def carried_oserror(e: Exception, path) -> OSError | None:
    """safetensors writes files itself and reports a failed write (disk full, quota) as a SafetensorError
    whose only trace of the errno is its message ("os error 28"): the OSError it was, or None."""
    import re

    m = re.search(r"os error (\d+)", str(e))
    return OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path)) if m else None
