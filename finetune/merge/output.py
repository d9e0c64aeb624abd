"""Where a merge writes, safely: which output directory, whether it may be replaced, its temporary sibling
(locked while in use, cleaned by the next merge once its writer is gone), and the permissions and errors of
what is written.

- `--force` replaces only a directory that a merge wrote (it holds merge_info.json), or an empty one: never
  an arbitrary directory such as RUN_DIR/checkpoints.
- The merged model is readable as the umask says (a server running as another user must read it):
  mkdtemp's 0700 is widened to what a plain mkdir would have made.
- The temporary sibling `.NAME.tmp-*` is flock-ed by its writer; a merge killed mid-way leaves it unlocked,
  and the next merge into the same output removes it.
- An OSError while writing (read-only, disk full, quota) is one line naming the output and what was kept.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from finetune.util.errors import OutputWriteError, RecipeError, reason
from finetune.util.log import log

INFO = "merge_info.json"


def output_dir(src, output) -> Path:
    """--output, else RUN_DIR/merged (ADAPTER_DIR/merged for a plain adapter); never around the inputs."""
    out = Path(output).expanduser().resolve() if output else (src.run_dir or src.adapter_dir) / "merged"
    for inside in (src.adapter_dir, src.base_dir):
        if inside == out or out in inside.parents:
            raise RecipeError([f"--output {out} contains the inputs ({inside}); pick another directory"], "merge")
    return out


def up_to_date(out: Path, fp: dict, force: bool) -> bool:
    """True when `out` already holds this very merge. Any other non-empty `out` needs --force, and --force
    replaces only a directory a merge wrote (its merge_info.json), never anything else."""
    if out.exists() and not out.is_dir():
        raise RecipeError([f"--output {out} is a file, not a directory"], "merge")
    if not out.exists() or not any(out.iterdir()):
        return False
    info = out / INFO
    if not info.is_file():
        raise RecipeError([f"--output {out} is not empty and was not written by finetune merge (no {INFO}); "
                           "--force replaces only a previous merge output: pick another directory, or empty "
                           "this one yourself"], "merge")
    if force:
        return False
    try:
        same = json.loads(info.read_text()).get("inputs") == fp
    except (OSError, ValueError, AttributeError):
        same = False
    if same:
        return True
    raise RecipeError([f"output {out} holds a different merge; pass --force to replace it"], "merge")


def clean_stale(out: Path) -> None:
    """Remove temporaries of earlier merges into `out` whose writer is gone (their lock is free)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a merge running now holds it
        finally:
            os.close(fd)  # (closing also drops the lock we just took)
        shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"merge: removed {tmp.name}, left by a merge that did not finish")


@contextlib.contextmanager
def temp_dir(out: Path):
    """A locked temporary sibling of `out`, removed afterwards unless it was renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


def apply_umask(root: Path) -> None:
    """Directories 0777 and files 0666, less the umask, as mkdir and open would make them (mkdtemp makes
    0700, and some writers 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def write_error(e: OSError, out: Path) -> OutputWriteError:
    where = e.filename or out
    return OutputWriteError(e.errno, f"merge: writing {out} failed: {reason(e)} ({where}); nothing was written "
                                     f"to {out} (what it held before is intact) and the temporary files were removed")
