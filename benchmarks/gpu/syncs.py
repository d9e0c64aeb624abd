"""Count a training run's host synchronisations on a GPU, by the line of finetune that caused each.

    python -m benchmarks.gpu.syncs RECIPE OUT.json [--probe-backward]   (under torchrun: one OUT per rank)

The run is `python -m finetune RECIPE`, in this process, with torch's CUDA sync debug mode set to warn:
torch then warns at every operation that makes the host wait for the GPU (`.item()`, `.tolist()`, a copy to
the CPU, a boolean mask). Each warning is recorded with the innermost frame of finetune that led to it, and
whether it came from a training step (loop.steps on the stack, its final export excluded). The loop's contract: at
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


def where(stack: list) -> tuple[str, str, bool]:
    """(innermost finetune frame as 'path:line function', the innermost frame of all (a library's, when
    the wait is inside one), whether it is part of an optimizer step: its micro-batches, the clip and the
    update, not the loop's logging, checkpoints, eval or export)."""
    site, names = "outside finetune", []
    for fr in stack:
        if fr.filename.startswith(PACKAGE):
            site = f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno} {fr.name}"
            names.append(fr.name)
    stack = [fr for fr in stack if not fr.filename.endswith("warnings.py")]  # the warning's own machinery
    inner = None  # None: the wait is finetune's own line; else the library's three innermost frames
    if stack and not stack[-1].filename.startswith(PACKAGE):
        lib = []
        for fr in reversed(stack):
            if fr.filename.startswith(PACKAGE) or len(lib) == 3:
                break
            lib.append(f"{'/'.join(Path(fr.filename).parts[-2:])}:{fr.lineno} {fr.name}")
        inner = " < ".join(lib)
    return site, inner, "optimizer_step" in names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    recipe, out = argv[0], Path(argv[1])
    import torch

    from finetune import cli

    probe = "--probe-backward" in argv
    measurable = torch.cuda.is_available()
    sites: Counter = Counter()
    in_steps = Counter()
    per_step = [0]  # waits inside each optimizer step, the step's closing read included
    probed: list = []

    def record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "Error detected in" in text or "Traceback of forward call" in text:  # anomaly mode's report
            probed.append(text[-4000:])
        if "synchronizing CUDA operation" not in text:
            return shown(message, category, filename, lineno, file, line)
        site, inner, steps = where(traceback.extract_stack()[:-1])
        if steps:
            key = site if inner is None else f"{site} via {inner}"
            in_steps[key] += 1
            per_step[-1] += 1
            if site.endswith(" read_step_values"):  # the step's one read: the next wait is the next step's
                per_step.append(0)
        else:
            sites[site] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
    if measurable:
        torch.cuda.set_sync_debug_mode("warn")
    if probe and measurable:
        probe_backward(probed)
    try:
        code = cli.main([recipe])
    except SystemExit as e:  # the backward probe ends the run
        code = e.code
    finally:
        if measurable:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    import yaml

    rec = yaml.safe_load(Path(recipe).read_text())
    run_dir = Path(rec["output"]["dir"])
    metrics = run_dir / "metrics.jsonl"
    steps = [r["step"] for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
    accum = rec["train"].get("gradient_accumulation_steps", 1)
    total = sum(in_steps.values())
    counted = per_step[:-1] if per_step and per_step[-1] == 0 else per_step
    res = {"exit": code, "measurable": measurable, "optimizer_steps": len(steps), "micro_batches_per_step": accum,
           "syncs_in_steps": total if measurable else None,
           "syncs_per_optimizer_step": round(total / len(steps), 2) if measurable and steps else None,
           # the first step also makes the optimizer's state: the steady figure is the later steps'
           "syncs_by_step": counted if measurable else None,
           "steady_syncs_per_step": max(counted[1:]) if measurable and len(counted) > 1 else None,
           "in_steps_by_site": dict(in_steps.most_common()), "outside_steps_by_site": dict(sites.most_common(15))}
    if probe:
        res["backward_probe"] = (probed or "no wait in the probed backward") if measurable else None
    rank = os.environ.get("RANK")
    path = out if rank in (None, "0") else out.with_name(f"{out.stem}_rank{rank}{out.suffix}")
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)
    return code


def probe_backward(probed: list) -> None:
    """Find which operation of a backward waits: torch replays the autograd threads' warnings on the caller
    at the end of backward, without their stacks. For the 6th backward (the second step at 4 micro-batches)
    the debug mode is set to raise, under anomaly mode, which reports the forward line that made the
    failing backward node; the run then stops (this is a diagnosis run, not a measurement)."""
    import torch
    from accelerate import Accelerator

    original, calls = Accelerator.backward, [0]

    def backward(self, loss, **kwargs):
        calls[0] += 1
        if calls[0] != 6:
            return original(self, loss, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                original(self, loss, **kwargs)
            probed.append("the probed backward did not wait")
        except RuntimeError as e:
            probed.append(f"{type(e).__name__}: {e}"[:2000])
        finally:
            torch.cuda.set_sync_debug_mode("warn")
        raise SystemExit(0)

    Accelerator.backward = backward


if __name__ == "__main__":
    sys.exit(main())
