"""Count a training run's host synchronisations on a GPU, by the line of finetune that caused each.

    python -m benchmarks.syncs RECIPE OUT.json        (or under torchrun: one OUT per rank, rank suffixed)

The run is `python -m finetune RECIPE`, in this process, with torch's CUDA sync debug mode set to warn:
torch then warns at every operation that makes the host wait for the GPU (`.item()`, `.tolist()`, a copy to
the CPU, a boolean mask). Each warning is recorded with the innermost frame of finetune that led to it, and
whether it came from a training step (loop.steps on the stack, its final export excluded). The loop's contract (issue 30): at
most one such wait per optimizer step, whatever the number of micro-batches. On the CPU nothing waits for a
device, torch reports nothing, and the result says so (`measurable: false`) instead of a count of zero.

Kernels that synchronise inside a library's C code (not through a torch operation) are not seen; the figure
is the loop's own waits.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

from benchmarks.common import ROOT, read_jsonl

PACKAGE = str(ROOT / "finetune")


def where(stack: list) -> tuple[str, bool]:
    """(innermost finetune frame as 'path:line function', whether it is part of a training step: the
    optimizer step with its micro-batches, or the loop's per-step work around it, not the final export)."""
    site, names = "outside finetune", []
    for fr in stack:
        if fr.filename.startswith(PACKAGE):
            site = f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno} {fr.name}"
            names.append(fr.name)
    in_steps = "steps" in names and "finish" not in names
    return site, in_steps


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    recipe, out = argv[0], Path(argv[1])
    import torch

    from finetune import cli

    measurable = torch.cuda.is_available()
    sites: Counter = Counter()
    in_steps = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        site, steps = where(traceback.extract_stack()[:-1])
        (in_steps if steps else sites)[site] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
    if measurable:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        code = cli.main([recipe])
    finally:
        if measurable:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    import yaml

    rec = yaml.safe_load(Path(recipe).read_text())
    run_dir = Path(rec["output"]["dir"])
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    accum = rec["train"].get("gradient_accumulation_steps", 1)
    total = sum(in_steps.values())
    res = {"exit": code, "measurable": measurable, "optimizer_steps": len(steps), "micro_batches_per_step": accum,
           "syncs_in_steps": total if measurable else None,
           "syncs_per_optimizer_step": round(total / len(steps), 2) if measurable and steps else None,
           "in_steps_by_site": dict(in_steps.most_common()), "outside_steps_by_site": dict(sites.most_common(15))}
    rank = os.environ.get("RANK")
    path = out if rank in (None, "0") else out.with_name(f"{out.stem}_rank{rank}{out.suffix}")
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
