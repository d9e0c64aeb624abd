"""The GPU proof's `long_context` stage (benchmarks/gpu/stages.py registers it): the 8B recipe (synthetic
weights, full depth) at micro-batch 1 with activation offloading and the tiled MLP, at the longest
data.max_seq_len the planner says fits (finetune.plan.longest, the `estimate --max-seq-len` answer) on this
card, and again within 24 GiB (torch.cuda.set_per_process_memory_fraction, benchmarks/gpu/capped.py): 2
optimizer steps each, loss finite, the steps' peak against the plan.

The goal: >= 500,000 tokens on an 80 GB card and >= 128,000 within 24 GiB, peak within 10% of
the plan. The dry run trains the tiny stand-in at 256 tokens with a 32-token tiled MLP (offloading needs
CUDA) and records the planner's answers for the real 8B on 80 and 24 GiB, which cost no device.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from benchmarks.gpu.harness import (GIB, estimate, finetune, plan_errors, plan_figures, python_m, recipe,
                                    train_and_read, write_recipe)

GOALS = {"card": 500_000, "24gib": 128_000}  # tokens, at micro-batch 1 (80 GB card; 24 GiB cap)


def host_memory() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def planned_longest(path: Path, gib: float, host: int | None) -> dict:
    from finetune import recipe as R
    from finetune.plan import estimate as E
    from finetune.plan import longest as LG

    s = replace(E.from_recipe(R.load(path)), gpu_memory=int(gib * GIB), device="cuda")
    n = LG.longest(s, host)
    return {"gpu_gib": gib, "max_seq_len": n, "limit": LG.limit(s, n, host)}


def _recipe(model: str, seq: int, out: Path, knobs: dict) -> dict:
    """The 8B recipe at micro-batch 1, 2 steps, with the long-context knobs."""
    rec = recipe(model, seq, 2, out, held_out=False, train={"micro_batch_size": 1})
    rec["model"].update(knobs)
    return rec


def _run(work: Path, sh_: dict, name: str, seq: int, knobs: dict, gib: float | None) -> dict:
    rec = _recipe(sh_["m8"], seq, work / name, knobs)
    launcher = finetune if gib is None else (lambda p: python_m("benchmarks.gpu.capped", str(gib), p))
    try:
        res = train_and_read(rec, work, name, {**sh_, "warmup": 1}, launcher=launcher)
    except Exception as e:  # an out-of-memory at the planned length is a result, not a crash of the stage
        return {"seq": seq, "ok": False, "error": str(e)[-1500:]}
    res["plan"] = plan_figures(estimate(work / f"{name}.yaml", work / "commands.log"))
    res["errors_pct"] = plan_errors(res["memory"], res["plan"])
    res["losses_finite"] = all(math.isfinite(x) for x in (res["first_loss"], res["last_loss"]))
    res["seq"], res["ok"] = seq, True
    return res


def stage_long_context(work: Path, sh_: dict) -> dict:
    knobs = {"activation_offloading": sh_["device"] == "cuda", "tiled_mlp": True}
    probe = write_recipe(_recipe(sh_["m8"], 2048, work / "long_probe", knobs), work / "long_probe.yaml")
    out = {"planned_8b": {}}
    real = write_recipe(_recipe("meta-llama/Llama-3.1-8B-Instruct", 2048, work / "long_8b",
                                {"activation_offloading": True, "tiled_mlp": True}), work / "long_8b.yaml")
    for gib in (80, 24):  # the planner's answer for the real 8B: what the GPU run is held to
        out["planned_8b"][f"{gib}gib"] = planned_longest(real, gib, None)
    if sh_["device"] != "cuda":
        out["dry"] = _run(work, sh_, "long_dry", 256, {"tiled_mlp": 32}, None)
        return out
    import torch

    card = torch.cuda.get_device_properties(0).total_memory / GIB
    host = host_memory()
    for key, gib in (("card", card), ("24gib", 24.0)):
        plan = planned_longest(probe, gib, host)
        res = _run(work, sh_, f"long_{key}", plan["max_seq_len"], knobs, None if key == "card" else gib)
        res["planned_longest"] = plan
        res["goal_tokens"] = GOALS[key]
        steps_err = res.get("errors_pct", {}).get("steps_allocated")
        res["goal_met"] = bool(res["ok"] and res["losses_finite"] and plan["max_seq_len"] >= GOALS[key]
                               and steps_err is not None and abs(steps_err) <= 10)
        out[key] = res
    return out


STAGES = {"long_context": stage_long_context}
