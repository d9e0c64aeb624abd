"""Row 1, `throughput_ratio`: trained tokens/s of finetune's training loop over a plain transformers + peft +
accelerate loop (benchmarks/cpu/baseline.py), same tiny QLoRA model, data and settings.

Each run is a fresh process forked from a server that has only imported the libraries. finetune's side is
the real `finetune.train.loop.train()` on recipes/tiny_cpu.yaml; its throughput is read from the run's own
metrics.jsonl (logged every `warmup` steps), skipping the first window: steady state only. Runs alternate
A B C / C B A; the ratio is of the medians. The third arm, finetune's loop with torch's own SDPA kernel
choice, shows how much of the ratio comes from finetune.plan.attention.

    python -m benchmarks.cpu.throughput [--reps 5] [--warmup 5] [--steps 20]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

from benchmarks.common import TINY_RECIPE, fork_context, interleaved, median, read_jsonl, steady_rate


def overrides(warmup: int, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The tiny recipe trimmed to a timing run: no evaluation, no intermediate checkpoints, logs at every
    multiple of `warmup` so the windows after the first one cover exactly the timed steps."""
    return [f"train.max_steps={warmup + steps}", f"train.log_every={warmup}", "train.warmup_steps=1",
            "train.save_every=null", "train.eval_every=null", "data.eval_sources=[]", "data.eval_split=0",
            "output.progress_bar=false", "train.resume=false", *extra]


def round_steps(warmup: int, steps: int) -> int:
    """Timed steps rounded up to whole logging windows."""
    return max(1, math.ceil(steps / warmup)) * warmup


def finetune_run(extra: list[str], warmup: int, steps: int, torch_kernels: bool = False) -> dict:
    """finetune's loop as users run it (train() on the recipe); steady throughput from its metrics.jsonl.

    torch_kernels=True is the ablation arm: the same loop with torch's own SDPA kernel choice instead of
    finetune.plan.attention (this process only; each run is a fresh process)."""
    import torch

    from finetune import recipe as recipe_mod
    from finetune.train import loss as loss_mod
    from finetune.train.loop import train

    if torch_kernels:
        loss_mod.attention_kernels = lambda *args: contextlib.nullcontext()

    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        rec = recipe_mod.load(TINY_RECIPE, overrides(warmup, steps, tuple(extra)) + [f"output.dir={tmp}"])
        with contextlib.redirect_stdout(io.StringIO()):
            train(rec, Path(tmp))
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
    # step 1's loss: LoRA B starts at zero, so both loops must agree on it exactly (same model, same batch)
    return {**steady_rate(records, after_step=warmup), "threads": torch.get_num_threads(),
            "first_loss": records[0]["loss"]}


def precision() -> str:
    """The autocast finetune resolves for the tiny recipe here: bf16, or no autocast (fp32) on a CPU
    without native bf16 (finetune.train.precision); the plain loop is given the same."""
    from benchmarks.common import TINY_RECIPE, resolved_precision
    from finetune import recipe as recipe_mod

    return resolved_precision(recipe_mod.load(TINY_RECIPE)).train.mixed_precision


def run(reps: int = 5, warmup: int = 5, steps: int = 20) -> dict:
    from benchmarks.cpu.baseline import plain_run

    steps = round_steps(warmup, steps)
    ctx = fork_context()
    prec = precision()
    arms = {"finetune": (finetune_run, ([], warmup, steps)),
            "plain": (plain_run, (overrides(warmup, steps), warmup, steps))}
    if prec == "bf16":  # the kernel choice it ablates is made for bf16 on CPU only (finetune.plan.attention)
        arms["finetune_torch_kernels"] = (finetune_run, ([], warmup, steps, True))
    got = interleaved(ctx, arms, reps)
    rate = {k: [r["tokens_per_s"] for r in v] for k, v in got.items()}
    ft, pl = rate["finetune"], rate["plain"]
    return {"throughput_ratio": median(ft) / median(pl),
            "finetune_tokens_per_s": median(ft), "plain_tokens_per_s": median(pl),
            "finetune_s_per_step": median([r["s_per_step"] for r in got["finetune"]]),
            "plain_s_per_step": median([r["s_per_step"] for r in got["plain"]]),
            "pair_ratios": [a / b for a, b in zip(ft, pl)],
            # the ablation: finetune's loop with torch's own attention kernel choice, over the plain loop
            **({"torch_kernels_ratio": median(rate["finetune_torch_kernels"]) / median(pl)}
               if "finetune_torch_kernels" in rate else {}),
            "precision": prec, "samples": rate, "reps": reps, "warmup_steps": warmup, "timed_steps": steps,
            "threads": got["finetune"][0]["threads"],
            "first_loss": {k: v[0]["first_loss"] for k, v in got.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print(json.dumps(run(a.reps, a.warmup, a.steps), indent=1))
