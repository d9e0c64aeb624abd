"""DPO's reference policy without a second copy of the base: the starting policy's log-probs of every pair,
computed once before the first step and kept in RUN_DIR/reference/logps.json.

The starting policy is the model before training: fresh adapters (B = 0, so exactly the base) or
`lora.init_adapter`'s weights. Computing its log-probs up front costs one no-grad forward per pair (a third of
a training step's work) and no memory during training, and it is the only correct choice when the run starts
from an adapter: switching the adapters off would give the base, not the starting policy. A resumed run's
model has moved on, so it must reuse the file, never recompute it: its Resume reads it
(finetune.train.keepers.resume) and hands it to `attach_reference`, which computes only for a fresh run. The
file is written before the first step, so every checkpoint has one beside it.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune.data.batching import collate_pairs
from finetune.data.examples import attach
from finetune.train.loss import batch_kernels
from finetune.train.preference import sequence_logps
from finetune.util import atomic
from finetune.util.log import log
from finetune.data.transfer import to_device

if TYPE_CHECKING:
    from finetune.train.run import Setup

FILE = Path("reference") / "logps.json"


def reference_key(recipe, stats: dict) -> str:
    """What the reference log-probs depend on: the base and its quantization, the starting adapter, the data
    and how it is encoded, the compute precision. A digest, stored with the log-probs."""
    r = recipe.to_yaml_dict()
    parts = {k: r[k] for k in ("model", "quantization", "lora", "data")}
    parts.update(precision=r["train"]["mixed_precision"], rows=stats.get("rows"), tokens=stats.get("tokens"))
    if recipe.lora.init_adapter:
        from finetune.util.digest import file_sha256

        parts["init_adapter_sha256"] = file_sha256(Path(recipe.lora.init_adapter) / "adapter_model.safetensors")
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def dpo_key(recipe, stats: dict) -> str | None:
    """The reference key of a DPO run (`reference_key`); None for the other methods, which have no reference."""
    return reference_key(recipe, stats) if recipe.train.method == "dpo" else None


def read_stored(run_dir: Path, key: str) -> dict | None:
    """RUN_DIR/reference/logps.json when it was made for `key` (`reference_key`), else None: also when it is
    damaged (truncated, not JSON, not two log-probs per pair), which a fresh run then recomputes (a resumed
    run's Resume checks the file against its checkpoint's manifest first)."""
    path = Path(run_dir) / FILE
    try:
        stored = json.loads(path.read_bytes()) if path.exists() else None
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        log.warning(f"reference: {path} cannot be read ({type(e).__name__}: {str(e)[:80]}); it is not used")
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    if not all(isinstance(stored.get(k), list) and all(isinstance(r, list) and len(r) == 2 for r in stored[k])
               for k in ("train", "eval")):
        log.warning(f"reference: {path} does not hold two log-probs per pair; it is not used")
        return None
    return stored


def attach_reference(recipe, run_dir: Path, s: Setup, model, stored: dict | None) -> None:
    """Give every training and held-out pair its `ref` = (chosen, rejected) log-prob under the starting
    policy. `stored`: a resumed run's, which its Resume read (keepers.resume: never recomputed). A fresh run
    reuses RUN_DIR/reference/logps.json when an earlier start of it (stopped before its first checkpoint)
    made it for this key, else computes them now (all ranks take part: a sharded forward is collective) and
    rank 0 writes the file. Call it after the wrap, before the first step."""
    key = dpo_key(recipe, s.prepared.stats)
    if key is None:
        return
    stored = stored or read_stored(run_dir, key)
    if stored is None:
        train, held_out = s.prepared.train, s.prepared.eval
        log.info(f"reference: log-probs of the starting policy for {len(train)} + {len(held_out)} pairs (once; "
                 f"kept in RUN_DIR/{FILE})")
        stored = {"key": key, "train": compute(recipe, s, model, train), "eval": compute(recipe, s, model, held_out)}
        if s.acc.is_main_process:
            (run_dir / FILE).parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(run_dir / FILE, json.dumps(stored))
        s.acc.wait_for_everyone()
    for examples, refs in ((s.prepared.train, stored["train"]), (s.prepared.eval, stored["eval"])):
        attach(examples, "ref", [tuple(ref) for ref in refs])


@torch.no_grad()
def compute(recipe, s: Setup, model, examples: list[dict]) -> list[list[float]]:
    """[[chosen, rejected], ...] log-probs of `examples` under the model as it is now, in eval mode (no
    dropout). Each rank scores a contiguous block, padded so every rank runs the same number of forwards;
    the blocks are gathered in rank order."""
    acc, t = s.acc, recipe.train
    n, world = len(examples), acc.num_processes
    if not n:
        return []
    per = math.ceil(n / world)
    mine = list(range(acc.process_index * per, min(n, (acc.process_index + 1) * per)))
    mine += [0] * (per - len(mine))
    model.eval()
    out = []
    for at in range(0, per, t.micro_batch_size):
        batch = to_device(collate_pairs([examples[i] for i in mine[at: at + t.micro_batch_size]],
                                        s.tok.pad_token_id), acc.device)
        with batch_kernels(batch, acc.device.type, t):
            logps, _ = sequence_logps(model, batch, acc.device.type, t)
        b = logps.size(0) // 2
        out.append(torch.stack([logps[:b], logps[b:]], 1).double())
    model.train()
    logps = torch.cat(out)
    if world > 1:
        logps = acc.gather(logps)
    return logps[:n].cpu().tolist()
