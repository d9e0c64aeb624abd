"""Can this run write its output? Checked before any weights load, from the recipe alone.

Two failures are worth finding before hours of training: an output directory that cannot be written
(a file in the way, a read-only mount, no permission) and a disk that cannot hold the checkpoints the
recipe will keep. The planned size comes from the model's shapes (finetune.plan.estimate): the full adapter,
every rank's optimizer state, and at the peak `keep_checkpoints + 1` checkpoints at once (the new one is
complete before the oldest is deleted), plus the exported adapter.

Light on purpose (no torch): `finetune validate` and the CLI's preflight import it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from finetune.recipe.rundir import foreign_recipe, planted_links
from finetune.util.errors import Problem, reason
from finetune.util.units import fmt, parse_size

# Pickled optimizer state carries per-tensor overhead (keys, bitsandbytes' 256-entry quantization maps,
# step counters) on top of the raw moments the estimate counts; this covers it for small adapters.
PER_TENSOR_OVERHEAD = 4096
SMALL_FILES = 1 << 20  # manifest, scheduler, RNG states, adapter_config, tokenizer files


@dataclass
class Need:
    checkpoint: int  # bytes of one checkpoints/step-N directory (all ranks)
    adapter: int  # bytes of RUN_DIR/adapter
    copies: int  # checkpoints on disk at the peak

    @property
    def total(self) -> int:
        return self.copies * self.checkpoint + self.adapter


def planned_bytes(recipe, arch, world: int) -> Need:
    """Disk the run needs at its peak, from the model's shapes (no weights)."""
    from dataclasses import replace

    from finetune.plan import estimate as E

    s = replace(E.from_recipe(recipe), gpus=world)
    adapter = E.weight_terms(arch, s)["lora"]
    opt = E.optimizer_terms(arch, s, shard=1)  # every rank's shard together: the whole state
    n_tensors = len(E.lora_tensor_sizes(arch, s))
    ckpt = adapter + sum(opt.values()) + n_tensors * PER_TENSOR_OVERHEAD + world * SMALL_FILES
    t = recipe.train
    saves = None
    if t.max_steps:
        saves = t.max_steps // t.save_every + 1 if t.save_every else 1
    copies = min(t.keep_checkpoints, saves or t.keep_checkpoints) + 1
    return Need(checkpoint=ckpt, adapter=adapter + SMALL_FILES, copies=copies)


# The tokenized-data cache (FINETUNE_CACHE/data): least recently used files go once it passes this size.
CACHE_MAX_ENV = "FINETUNE_DATA_CACHE_MAX"
DEFAULT_CACHE_MAX = 20 << 30
# Cached ids and labels are int64 lists: 16 bytes per token, at about 4 bytes of text per token.
CACHE_BYTES_PER_TEXT_BYTE = 4


def data_cache_dir() -> Path:
    from finetune.util.builtin import cache_root

    return cache_root() / "data"


def data_cache_cap(env=None) -> int:
    env = os.environ if env is None else env
    return parse_size(env.get(CACHE_MAX_ENV) or DEFAULT_CACHE_MAX, CACHE_MAX_ENV)


def cache_bytes(recipe, env=None) -> int:
    """Planned size of this recipe's tokenized-data cache, from its local data files' sizes (hub and builtin
    data are not counted), at most the cache's cap."""
    total = 0
    for src in [*recipe.data.sources, *recipe.data.eval_sources]:
        p = Path(os.path.expanduser(src.path))
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return min(total * CACHE_BYTES_PER_TEXT_BYTE, data_cache_cap(env))


def cache_problems(recipe, out_base: Path, disk_usage=shutil.disk_usage) -> tuple[list, int]:
    """(problems, bytes to add to the output dir's plan: the cache's need when both are on one disk)."""
    need = cache_bytes(recipe)
    base, _ = existing_ancestor(data_cache_dir())
    if not need or base is None:
        return [], 0
    if os.stat(base).st_dev == os.stat(out_base).st_dev:
        return [], need
    free = disk_usage(base).free
    if need > free:
        return [Problem(level="error", path="data.sources", message=f"the tokenized-data cache ({data_cache_dir()}) "
                        f"needs about {fmt(need)}, {fmt(free)} free on its disk",
                        fix=f"free space, or set FINETUNE_CACHE to a directory on a larger disk (or lower "
                            f"{CACHE_MAX_ENV})")], 0
    return [], 0


def existing_ancestor(path: Path) -> tuple[Path | None, str | None]:
    """(deepest existing directory on the way to `path`, or None and why not)."""
    p = Path(os.path.abspath(os.path.expanduser(path)))
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                return None, f"{parent} is a file, not a directory"
            return parent, None
    return None, "no existing parent directory"


def probe_writable(directory: Path) -> str | None:
    """Why files cannot be created in `directory`, or None. Creates and removes one empty file: the
    only test that sees read-only mounts, ACLs and root-squashed network file systems alike."""
    try:
        fd, name = tempfile.mkstemp(prefix=".finetune-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return reason(e)
    return None


def sizeof(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def output_problems(recipe, arch=None, world: int = 1, disk_usage=shutil.disk_usage) -> list:
    """Problems with writing `output.dir`: not creatable, not writable, or too little free space for the
    checkpoints this recipe keeps (checked only when the model's shapes are known)."""
    if "\x00" in recipe.output.dir or not recipe.output.dir.strip():
        return [Problem(level="error", path="output.dir", message=f"not a usable path: {recipe.output.dir!r}",
                        fix="give a directory path")]
    try:  # the adapter's and checkpoints' writers (safetensors, JSON) need the path as UTF-8 text
        recipe.output.dir.encode("utf-8")
    except UnicodeEncodeError:
        return [Problem(level="error", path="output.dir", message=f"{recipe.output.dir!r} holds a byte that is not "
                        "UTF-8; the adapter could not be saved at the end of the run", fix="rename it with UTF-8 "
                        "characters only")]
    out_dir = Path(os.path.expanduser(recipe.output.dir))
    base, why = existing_ancestor(out_dir)
    if base is None:
        return [Problem(level="error", path="output.dir", message=f"cannot create {out_dir}: {why}",
                        fix="choose another output.dir")]
    why = probe_writable(base)
    if why:
        return [Problem(level="error", path="output.dir", message=f"cannot write to {base}: {why}",
                        fix="choose a writable output.dir (or fix its permissions / mount)")]
    links = planted_links(out_dir)
    if links:
        return [Problem(level="error", path="output.dir", message=links[0],
                        fix="remove the link, or choose another output.dir")]
    foreign = foreign_recipe(out_dir)
    if foreign:
        return [Problem(level="error", path="output.dir", message=foreign,
                        fix="keep your recipe outside the run dir (or move it), or choose another output.dir")]
    cache_found, cache_here = cache_problems(recipe, base, disk_usage)
    if arch is None:
        return cache_found
    need = planned_bytes(recipe, arch, world)
    # Checkpoints already there count against the plan: they are replaced or pruned as the run goes on.
    have = sizeof(out_dir / "checkpoints") + sizeof(out_dir / "adapter")
    free = disk_usage(base).free
    if need.total + cache_here - have > free:
        cache = f", plus the {fmt(cache_here)} tokenized-data cache" if cache_here else ""
        return [Problem(level="error", path="output.dir",
                        message=f"{fmt(free)} free on the disk of {base}, but the run needs about "
                                f"{fmt(need.total + cache_here - have)} ({need.copies} checkpoints of "
                                f"{fmt(need.checkpoint)} at the peak, plus the {fmt(need.adapter)} adapter{cache})",
                        fix="free space, choose an output.dir on a larger disk, or lower train.keep_checkpoints")]
    return cache_found
