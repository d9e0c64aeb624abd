"""Where a merge writes, safely: which output directory, whether it may be replaced, its temporary sibling
(locked while in use, cleaned by the next merge once its writer is gone), and the permissions and errors of
what is written.

- `--force` replaces only a directory that a merge wrote (it holds merge_info.json), or an empty one: never
  an arbitrary directory such as RUN_DIR/checkpoints.
- The merged model is readable as the umask says (a server running as another user must read it):
  mkdtemp's 0700 is widened to what a plain mkdir would have made.
- The temporary sibling `.NAME.tmp-*` is flock-ed by its writer; a merge killed mid-way leaves it unlocked,
  and the next merge into the same output removes it (finetune/util/sibling.py, shared with quantize and export).
- An OSError while writing (read-only, disk full, quota) is one line naming the output and what was kept.
"""
from __future__ import annotations

import json
from pathlib import Path

from finetune.util.errors import OutputWriteError, RecipeError, reason

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


def write_error(e: OSError, out: Path, need: int | None = None) -> OutputWriteError:
    """The one line of a failed write, as training words its full disk: what failed, that nothing partial was
    kept and, when known, how much space the merge needs."""
    from finetune.util.units import fmt

    where = e.filename or out
    room = f"; the merge needs about {fmt(need)} free on that disk" if need else ""
    return OutputWriteError(e.errno, f"merge: writing {out} failed: {reason(e)} ({where}); nothing was written "
                                     f"to {out} (what it held before is intact) and the temporary files were "
                                     f"removed{room}")


# Beyond the weights: config, tokenizer, model card and merge_info.json, and the file system's own blocks.
SMALL_FILES_MARGIN = 1 << 20


def space_problem(out: Path, need: int, disk_usage=None) -> OutputWriteError | None:
    """Too little free space where `out`'s temporary sibling is written (beside it, while the old output
    stays): the error to raise before anything is written, or None."""
    import errno
    import shutil

    from finetune.plan.disk import existing_ancestor
    from finetune.util.units import fmt

    base, _ = existing_ancestor(out.parent)
    if base is None:
        return None  # not creatable: the write reports it
    free = (disk_usage or shutil.disk_usage)(base).free
    if need <= free:
        return None
    return OutputWriteError(errno.ENOSPC, f"merge: writing {out} needs about {fmt(need)}, {fmt(free)} free on the "
                                          f"disk of {base}; nothing was written (what {out} held before is intact). "
                                          "Free space, or choose an --output on a larger disk")
