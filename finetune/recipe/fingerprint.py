"""What a checkpoint was trained with, so a resume with a different recipe is refused instead of mixing two runs.

Every checkpoint's manifest stores a fingerprint: the recipe flattened to dotted keys, the process count and
the size of the prepared training data. On resume the current fingerprint is compared with the stored one.
A changed key that defines the trained result (learning rate, data, batch shape, LoRA shape, optimizer,
seeds, process count ...) is an error naming each change and the two ways forward; a changed key that only
says how long or how visibly the run goes (`FREE`) is allowed and printed.

Every key is defining unless listed in `FREE`: a new recipe field is protected by default.
"""
from __future__ import annotations

import hashlib
import json

from finetune.recipe.schema import Recipe
from finetune.util.errors import RecipeError
from finetune.util.redact import redact

# Keys (or section prefixes ending in ".") that may change between a checkpoint and its resume: how long
# the run goes, what it logs and saves, how it is evaluated, where it writes, and knobs that change memory
# or speed but not the computed result.
FREE = ("train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.save_every",
        "train.keep_checkpoints", "train.resume", "eval.", "output.", "distributed.timeout_minutes",
        "distributed.backend", "model.attn_implementation", "model.gradient_checkpointing",
        "model.reentrant_checkpointing", "model.trust_remote_code", "model.allow_pickle", "fsdp.cpu_offload",
        "fsdp.backward_prefetch", "fsdp.forward_prefetch", "train.compile")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    text = json.dumps(node, sort_keys=True)  # lists (sources, targets) compare whole
    if redact(text) != text:  # a secret pasted into a field never reaches the checkpoint; its hash compares
        text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return {prefix[:-1]: text}


def fingerprint(recipe: Recipe, world: int, data: dict | None = None) -> dict:
    """{dotted key: JSON value} of the recipe, plus `processes` and `data.prepared` (rows and tokens of the
    prepared training set: a data file whose content changed under the same path shows there)."""
    out = _flat(recipe.to_yaml_dict())
    out["processes"] = json.dumps(world)
    if data is not None:
        out["data.prepared"] = json.dumps(f"{data.get('rows')} rows, {data.get('tokens')} tokens")
    return out


def is_free(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


def compare(stored: dict, current: dict, checkpoint: str, run_dir: str) -> list[str]:
    """Raise RecipeError when a defining key differs; return one line per changed free key. Keys present on
    one side only (a field added or removed by a finetune upgrade) are not compared."""
    changed = [(k, stored[k], current[k]) for k in sorted(stored.keys() & current.keys()) if stored[k] != current[k]]
    defining = [c for c in changed if not is_free(c[0])]
    if defining:
        what = [f"{k}: {old} when {checkpoint} was written, now {new}" for k, old, new in defining]
        restore = ", ".join(f"{k}={old}" for k, old, _ in defining if k not in ("processes", "data.prepared"))
        how = [f"to start a new run with these values, choose a new output.dir (or delete {run_dir}/checkpoints)",
               f"to resume this run, restore the old values{': ' + restore if restore else ''}"
               + (" and launch the same number of processes" if any(k == "processes" for k, _, _ in defining) else "")
               + (" and use the same data" if any(k == "data.prepared" for k, _, _ in defining) else "")]
        raise RecipeError([f"output.dir {run_dir} holds checkpoints of a different run; changed since then:", *what,
                           *how])
    return [f"{k} changed from {old} to {new} since {checkpoint} (allowed: it does not change what was trained)"
            for k, old, new in changed]
