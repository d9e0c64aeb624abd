"""One run per output dir: `output.dir/.lock`, held with flock(2) by the main process for the whole run.

A second run into the same dir (a scheduler requeue while the old job is still shutting down, the same
command started twice) stops at once with exit 2 naming the holder, instead of both appending to
metrics.jsonl and mixing checkpoints. The kernel releases a flock when its holder dies, however it dies
(SIGKILL, OOM killer), so a dead run never keeps the dir locked; the pid, host and start time written into
the file are only there to name the holder. Only the main process (RANK 0) of a run takes it: the other
ranks of that run write into the same dir. NFS (v4, and v3 with its lock manager) maps flock to
byte-range locks, which do work across machines; a file system that refuses locks is reported and the run
goes on unlocked.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from finetune.util.errors import RecipeError, RunError
from finetune.util.log import log

LOCK_NAME = ".lock"


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, started {since}"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"


@contextlib.contextmanager
def hold(run_dir: Path, rank: int | None = None):
    """Hold the run dir's lock for the duration of the block (a no-op on ranks other than 0)."""
    rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
    if rank != 0:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    try:  # never through a link planted at .lock: the pid would be written into the file it points to
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise RecipeError([f"output.dir: cannot open {run_dir / LOCK_NAME} ({e.strerror}); remove it if it is a "
                           "link, or choose another output.dir"]) from None
    try:
        _lock(fd, run_dir)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a starting run)


def _lock(fd: int, run_dir: Path):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RunError([f"output.dir: {run_dir} is in use by another run ({_holder(fd)}); wait for it to "
                               "finish (or stop it), or choose another output.dir"]) from None
        log.warning(f"output.dir: cannot lock {run_dir / LOCK_NAME} ({e.strerror}); make sure no other run "
                    "writes into this directory")
        return
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, me, 0)
