"""Row 12, `moe_speedup`: trained tokens/s of the grouped 4-bit experts (finetune/weights/experts/grouped.py)
over the per-expert loop they replace, through the real training loop, side by side in one run.

The model: a synthetic Qwen3-MoE with the routing of the issue's target, Qwen3-30B-A3B (128 experts, top-8),
at small widths (2 layers, hidden 128, expert intermediate 64, 4 heads of 32), 4-bit NF4 experts with LoRA
on them (`lora.target_parameters: auto`) and on attention, the tiny recipe's data (8 rows a micro-batch).
Why these numbers:
- the expert count and top-k are the target's own, because they set how much per-expert work the loop
  repeats: the loop's cost grows with the experts a batch reaches, the grouped path's calls do not;
- the widths are small because the comparison is about the balance of per-expert overhead against
  arithmetic, and on the GPU the loop is all overhead. On an H100 at Qwen3-30B-A3B widths the loop took
  2.37 s per 2,048-token step for 4 layers (benchmarks/RESULTS_GPU.md): about 4.6 ms per expert and layer,
  against ~10 us of that expert's arithmetic (128 rows x ~28 MFLOP forward, backward and recompute), some
  500:1. Here the loop costs ~5 ms per expert and layer (fwd + bwd, one core) and an expert's arithmetic
  at these widths (~8 rows x ~150 kFLOP) ~20 us, some 250:1: the same regime. At the target's widths a
  CPU would spend ~200x more on each expert's arithmetic, a 1:1 balance that no GPU run has;
- what the CPU cannot show: torch's grouped_mm on CPU is itself a C++ loop of one small matmul per expert
  (on the GPU it is one kernel), and in bf16 (this row's compute dtype where the CPU has AMX/AVX512-BF16,
  as the recipe resolves it) each of those costs ~20-26 us of oneDNN fixed cost, 16 per expert and layer
  with LoRA on both expert parameters (fp32: ~3-5 us). So the ratio here understates the GPU's; `--fp32`
  measures the same run in fp32 compute (train.mixed_precision: no, quantization.compute_dtype: float32).

Each run is a fresh process forked from the benchmark server: `train()` on recipes/tiny_cpu.yaml pointed at the
synthetic model, FINETUNE_MOE_EXPERTS choosing the path (`per_expert`, or the grouped default); both arms
train the same rows for the same steps. Throughput is read from the run's metrics.jsonl after the first
window (steady state), peak RSS is the process's high-water mark over the run (reset before the model
loads, /proc/self/clear_refs). Runs alternate A B / B A; the ratios are of the medians. The goal: >= 10x
the tokens/s at no more peak RSS.

    python -m benchmarks.cpu.moe_speedup [--reps 3] [--warmup 2] [--steps 6] [--fp32]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from benchmarks.common import TINY_RECIPE, fork_context, interleaved, median, read_jsonl, steady_rate

MODEL = ("synthetic:Qwen/Qwen3-30B-A3B?layers=2&hidden=128&intermediate=256&moe_intermediate=64&heads=4"
         "&kv_heads=2&head_dim=32&vocab=384&experts=128&experts_per_tok=8")
FP32 = ["train.mixed_precision=no", "quantization.compute_dtype=float32"]
ARMS = {"per_expert": "per_expert", "grouped": "auto"}  # arm -> FINETUNE_MOE_EXPERTS


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def moe_run(layout: str, warmup: int, steps: int, seq: int, batch: int, fp32: bool = False) -> dict:
    """The real loop on the synthetic MoE with the experts in `layout`: steady tokens/s and peak RSS."""
    from finetune import recipe as recipe_mod
    from finetune.train.loop import train
    from finetune.weights.built.synthetic import synthetic_dir

    os.environ["FINETUNE_MOE_EXPERTS"] = layout
    synthetic_dir(MODEL)  # built once into the cache (the first arm), not part of either run's peak
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        rec = recipe_mod.load(TINY_RECIPE, [
            f"model.name={MODEL}", f"train.max_steps={warmup + steps}", f"train.log_every={warmup}",
            "train.warmup_steps=1", "train.save_every=null", "train.eval_every=null", "data.eval_sources=[]",
            "data.eval_split=0", "output.progress_bar=false", "train.resume=false", f"data.max_seq_len={seq}",
            f"train.micro_batch_size={batch}", "lora.target_parameters=auto", f"output.dir={tmp}",
            *(FP32 if fp32 else [])])
        with contextlib.redirect_stdout(io.StringIO()):
            train(rec, Path(tmp))
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
    return {**steady_rate(records, after_step=warmup), "peak_rss": _peak_rss(),
            "losses": [r["loss"] for r in records if "loss" in r]}


def run(reps: int = 3, warmup: int = 2, steps: int = 6, seq: int = 64, batch: int = 8, fp32: bool = False) -> dict:
    ctx = fork_context()
    got = interleaved(ctx, {arm: (moe_run, (layout, warmup, steps, seq, batch, fp32))
                            for arm, layout in ARMS.items()}, reps)
    rate = {k: [r["tokens_per_s"] for r in v] for k, v in got.items()}
    rss = {k: [r["peak_rss"] for r in v] for k, v in got.items()}
    speedup = median(rate["grouped"]) / median(rate["per_expert"])
    rss_ratio = median(rss["grouped"]) / median(rss["per_expert"])
    return {"moe_speedup": speedup, "peak_rss_ratio": rss_ratio,
            "goal_met": speedup >= 10 and rss_ratio <= 1.0,
            "grouped_tokens_per_s": median(rate["grouped"]), "per_expert_tokens_per_s": median(rate["per_expert"]),
            "grouped_peak_rss_mib": median(rss["grouped"]) / 2**20,
            "per_expert_peak_rss_mib": median(rss["per_expert"]) / 2**20,
            "pair_ratios": [a / b for a, b in zip(rate["grouped"], rate["per_expert"])],
            # same model, data and seed: the two paths train the same run (losses equal to rounding)
            "first_losses": {k: v[0]["losses"][:3] for k, v in got.items()},
            "samples": rate, "peak_rss": rss, "reps": reps, "warmup_steps": warmup, "timed_steps": steps,
            "seq_len": seq, "micro_batch": batch, "compute": "fp32" if fp32 else "the recipe's", "model": MODEL}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fp32", action="store_true", help="compute in fp32 (default: as the recipe resolves it)")
    a = ap.parse_args()
    print(json.dumps(run(a.reps, a.warmup, a.steps, a.seq, a.batch, a.fp32), indent=1))
