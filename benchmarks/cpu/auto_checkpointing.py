"""`model.gradient_checkpointing: auto` on CPU, side by side: every layer checkpointed, `auto` where the
machine's RAM holds every activation (the planner checkpoints none), and `auto` under a memory cap
(`model.max_memory_gib`) that forces about half the layers to recompute.

The model is the 2 GB synthetic Llama of benchmarks/cpu/phase_rss.py (16 layers, hidden 2048, Llama 3's
vocabulary, seeded random bf16 weights) under the tiny CPU recipe's settings. Each arm is finetune's real
`train()` in a fresh process forked from one that imported the libraries (benchmarks/common.py), arms
alternating A B C / C B A. Per arm: the planner's choice (its one log line), trained tokens/s after the first
`warmup` steps, the loss of every step (checkpointing recomputes the same forward, so the curves must agree to
1e-5), and the steps' peak RSS against the plan of the layers that ran (RUN_DIR/memory.json). The cap is the
planner's own per-process figure with half the layers checkpointed, moved by what an arm's process holds at its
start beyond the plan's constant (as `auto` moves its plan: train.recompute), so `auto` under it must pick
about half.

Goals: tokens/s of `auto` (none) >= 1.2x and of `auto` capped >= 1.08x every layer's; losses equal
to 1e-5 over 20 steps; each arm's peak RSS within the planner's CPU accuracy of its plan (15%); the capped arm's
peak within its cap. On 2 shared cores a step of this model takes many seconds: `--steps` trades time for
noise.

    python -m benchmarks.cpu.auto_checkpointing [--steps 20] [--warmup 2] [--micro-batch 4] [--reps 1] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.common import (
    TINY_RECIPE,
    fork_context,
    in_fresh_process,
    interleaved,
    median,
    read_jsonl,
    steady_rate,
)

GIB = 2**30
MODEL = ("synthetic:meta-llama/Llama-3.2-1B?layers=16&hidden=2048&intermediate=8192&heads=32&kv_heads=8"
         "&vocab=128256")
CPU_ACCURACY = 0.15  # the planner's documented bound (docs/planner_accuracy.md, benchmarks row 4)


def overrides(model: str, warmup: int, steps: int, micro_batch: int) -> list[str]:
    """The tiny recipe on `model`, trimmed to a timing run that logs every step (each step's loss), packed."""
    # data.packing: every row of a step is max_seq_len tokens, the batch the planner plans (unpacked, the tiny
    # rows are shorter than max_seq_len, and the plan of the kept activations is their worst case: +20% here)
    return [f"model.name={model}", f"train.max_steps={warmup + steps}", "train.log_every=1", "data.packing=true",
            "train.warmup_steps=1", f"train.micro_batch_size={micro_batch}", "train.save_every=null",
            "train.eval_every=null", "data.eval_sources=[]", "data.eval_split=0", "output.progress_bar=false",
            "train.resume=false"]


def arm(extra: list[str], model: str, warmup: int, steps: int, micro_batch: int) -> dict:
    """One run of finetune's loop; what it chose, its rate, its losses and its memory against the plan."""
    from finetune import recipe as recipe_mod
    from finetune.train.loop import train

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        rec = recipe_mod.load(TINY_RECIPE, overrides(model, warmup, steps, micro_batch) + extra
                              + [f"output.dir={tmp}"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train(rec, Path(tmp))
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
        memory = json.loads((Path(tmp) / "memory.json").read_text())
    line = next((x for x in out.getvalue().splitlines() if x.startswith("gradient checkpointing:")),
                "gradient checkpointing: every layer (true)")
    steps_rss = max(r["phases"]["steps"]["peak_rss"] for r in memory["ranks"])
    return {**steady_rate(records, after_step=warmup), "choice": line,
            "losses": [r["loss"] for r in records if "loss" in r],
            "peak_rss_steps": steps_rss, "plan_steps": (memory.get("plan") or {}).get("steps")}


def start_rss() -> int:
    """What a fresh arm's process holds when its run begins (the training loop's modules imported), in bytes."""
    import finetune.train.loop  # noqa: F401  (imported before the run's memory keeper reads its start)
    from finetune.train.keepers.memory import _proc_status_kib

    return _proc_status_kib("VmRSS") * 1024


def half_cap(model: str, micro_batch: int, start: int = 0) -> tuple[float, int, int]:
    """The planner's per-process step figure with the first half of the layers checkpointed, in GiB (rounded
    up to 1e-4, about 100 KiB: half fits under it, one layer fewer does not): the cap under which `auto` should
    pick half. `start`: an arm's RSS at its start, which `auto` adds to its plan beyond estimate.CPU_START_RSS."""
    from benchmarks.common import resolved_precision
    from finetune import recipe as recipe_mod
    from finetune.plan import checkpointing as C
    from finetune.plan import estimate as E
    from finetune.plan.archs import resolve

    rec = resolved_precision(recipe_mod.load(TINY_RECIPE, overrides(model, 1, 1, micro_batch)))
    s = replace(E.from_recipe(rec), gpus=1, device="cpu")
    arch = resolve(model)[0]
    half = arch.layers // 2
    p, _ = C.fit(replace(s, checkpointing=half), arch)
    return -(-(C.peak_bytes(p) + E.start_offset(start)) * 10**4 // GIB) / 10**4, half, arch.layers


def run(steps: int = 20, warmup: int = 2, micro_batch: int = 4, reps: int = 1, model: str = MODEL) -> dict:
    from finetune.weights.built.synthetic import synthetic_dir

    if model.startswith("synthetic:"):
        synthetic_dir(model)  # built once, before any arm measures itself
    ctx = fork_context()
    cap, half, layers = half_cap(model, micro_batch, in_fresh_process(ctx, start_rss))
    common = (model, warmup, steps, micro_batch)
    got = interleaved(ctx, {"all": (arm, (["model.gradient_checkpointing=true"], *common)),
                            "auto": (arm, (["model.gradient_checkpointing=auto"], *common)),
                            "auto_capped": (arm, (["model.gradient_checkpointing=auto", f"model.max_memory_gib={cap}"],
                                                  *common))}, reps, timeout=7200)
    rate = {k: median([r["tokens_per_s"] for r in v]) for k, v in got.items()}
    first = {k: v[0] for k, v in got.items()}
    loss_diff = {k: max(abs(a - b) for a, b in zip(first[k]["losses"], first["all"]["losses"]))
                 for k in ("auto", "auto_capped")}
    plan_error = {k: (r["plan_steps"] - r["peak_rss_steps"]) / r["peak_rss_steps"] if r["plan_steps"] else None
                  for k, r in first.items()}
    return {"model": model, "layers": layers, "micro_batch": micro_batch, "seq": 64, "steps": steps,
            "warmup": warmup, "reps": reps, "cap_gib": cap, "cap_targets_layers": half,
            "choice": {k: r["choice"] for k, r in first.items()},
            "tokens_per_s": rate, "ratio_auto": rate["auto"] / rate["all"],
            "ratio_auto_capped": rate["auto_capped"] / rate["all"], "max_loss_diff": loss_diff,
            "peak_rss_steps_gib": {k: r["peak_rss_steps"] / GIB for k, r in first.items()},
            "plan_steps_gib": {k: (r["plan_steps"] or 0) / GIB for k, r in first.items()},
            "plan_error": plan_error,
            "capped_within_cap": first["auto_capped"]["peak_rss_steps"] <= cap * GIB,
            "losses": {k: r["losses"] for k, r in first.items()}}


def verdict(res: dict) -> list[str]:
    """The goals, each met or not, in words."""
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    errs = [e for e in res["plan_error"].values() if e is not None]
    return [f"auto (none checkpointed) {res['ratio_auto']:.3f}x every layer's tokens/s (>= 1.2: "
            f"{ok(res['ratio_auto'] >= 1.2)})",
            f"auto capped at {res['cap_gib']} GiB {res['ratio_auto_capped']:.3f}x (>= 1.08: "
            f"{ok(res['ratio_auto_capped'] >= 1.08)})",
            f"losses over {res['warmup'] + res['steps']} steps: largest difference "
            f"{max(res['max_loss_diff'].values()):.2e} (<= 1e-5: {ok(max(res['max_loss_diff'].values()) <= 1e-5)})",
            f"peak RSS against plan: " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in res["plan_error"].items()
                                                   if v is not None)
            + f" (within {100 * CPU_ACCURACY:.0f}%: {ok(errs and max(map(abs, errs)) <= CPU_ACCURACY)})",
            f"capped arm's peak {res['peak_rss_steps_gib']['auto_capped']:.2f} GiB within its cap "
            f"{res['cap_gib']} GiB: {ok(res['capped_within_cap'])}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the rate (default 2)")
    ap.add_argument("--micro-batch", type=int, default=4, help="rows of 64 tokens a step (default 4)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each arm, alternating (default 1)")
    ap.add_argument("--model", default=MODEL, help="the synthetic Llama (default: 16 layers, hidden 2048)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    a = ap.parse_args(argv)
    res = run(a.steps, a.warmup, a.micro_batch, a.reps, a.model)
    for k, line in res["choice"].items():
        print(f"{k:<12} {line}  {res['tokens_per_s'][k]:.1f} tokens/s, peak RSS {res['peak_rss_steps_gib'][k]:.2f} "
              f"GiB, plan {res['plan_steps_gib'][k]:.2f} GiB")
    print("\n".join(verdict(res)))
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
