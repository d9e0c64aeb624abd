"""DPO's reference policy without a second copy of the base: the starting policy's log-probs of every pair,
computed once before the first step and kept in RUN_DIR/reference/logps.json.

The starting policy is the model before training: fresh adapters (B = 0, so exactly the base) or
`lora.init_adapter`'s weights. Computing its log-probs up front costs one no-grad forward per pair (a third of
a training step's work) and no memory during training, and it is the only correct choice when the run starts
from an adapter: switching the adapters off would give the base, not the starting policy. A resumed run's
model has moved on, so it must reuse the file, never recompute it; the file is written before the first step,
so every checkpoint has one beside it.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from finetune.data.batching import collate_pairs
from finetune.data.examples import attach
from finetune.train.loss import batch_kernels
from finetune.train.preference import sequence_logps
from finetune.util import atomic
from finetune.util.errors import RunError
from finetune.util.log import log
from finetune.data.transfer import to_device

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


def attach_reference(run) -> None:
    """Give every training and held-out pair its `ref` = (chosen, rejected) log-prob under the starting
    policy: read from RUN_DIR/reference/logps.json when it was made for this run, else computed now (all
    ranks take part: a sharded forward is collective) and written by rank 0. Call it after the wrap and
    before the first step of a fresh run; a resumed run must find the file."""
    if run.recipe.train.method != "dpo":
        return
    path, key = run.run_dir / FILE, reference_key(run.recipe, run.prepared.stats)
    stored = json.loads(path.read_text()) if path.exists() else None
    if stored is not None and stored.get("key") != key:
        stored = None
    if stored is None and run.resumed_from is not None:
        raise RunError([f"resume: {path} is missing or was made for another recipe; the reference log-probs "
                        "of a resumed DPO run cannot be recomputed (the model has moved on): start a fresh run"])
    if stored is None:
        log.info(f"reference: log-probs of the starting policy for {len(run.prepared.train)} + "
                 f"{len(run.prepared.eval)} pairs (once; kept in RUN_DIR/{FILE})")
        stored = {"key": key, "train": compute(run, run.prepared.train), "eval": compute(run, run.prepared.eval)}
        if run.acc.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(path, json.dumps(stored))
        run.acc.wait_for_everyone()
    for examples, refs in ((run.prepared.train, stored["train"]), (run.prepared.eval, stored["eval"])):
        attach(examples, "ref", [tuple(ref) for ref in refs])


@torch.no_grad()
def compute(run, examples: list[dict]) -> list[list[float]]:
    """[[chosen, rejected], ...] log-probs of `examples` under the model as it is now, in eval mode (no
    dropout). Each rank scores a contiguous block, padded so every rank runs the same number of forwards;
    the blocks are gathered in rank order."""
    acc, t = run.acc, run.recipe.train
    n, world = len(examples), acc.num_processes
    if not n:
        return []
    per = math.ceil(n / world)
    mine = list(range(acc.process_index * per, min(n, (acc.process_index + 1) * per)))
    mine += [0] * (per - len(mine))
    run.model.eval()
    out = []
    for s in range(0, per, t.micro_batch_size):
        batch = to_device(collate_pairs([examples[i] for i in mine[s: s + t.micro_batch_size]],
                                        run.tok.pad_token_id), acc.device)
        with batch_kernels(batch, acc.device.type, t):
            logps, _ = sequence_logps(run.model, batch, acc.device.type, t)
        b = logps.size(0) // 2
        out.append(torch.stack([logps[:b], logps[b:]], 1).double())
    run.model.train()
    logps = torch.cat(out)
    if world > 1:
        logps = acc.gather(logps)
    return logps[:n].cpu().tolist()
