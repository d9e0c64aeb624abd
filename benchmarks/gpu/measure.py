"""Run a real recipe for N steps on a GPU machine; record tokens/s, MFU and peak memory per GPU next to
published figures.

    python -m benchmarks.gpu.measure recipes/llama3_8b_qlora.yaml [key=value ...] [--steps 60] [--warmup 10]
    accelerate launch -m benchmarks.gpu.measure recipes/llama3_70b_qlora.yaml --steps 30      # several GPUs

It trains with finetune's own loop (`finetune.train.loop.train`), reads steady-state throughput from the run's
metrics.jsonl (the first `--warmup` steps excluded), takes each GPU's peak allocated and reserved memory from
torch, and writes a markdown report (default benchmarks/RESULTS_GPU_BENCH.md; RESULTS_GPU.md is the GPU proof's) beside a table of published runs.
It needs CUDA; without it it stops with exit code 2 before loading anything.

MFU counts model FLOPs per processed (non-padding) token of LoRA training, without recomputation:
4N (frozen base: forward 2N, input gradients 2N) + 6L (adapters) + attention; HFU adds what activation
checkpointing recomputes (benchmarks/flops.py). Peak is the GPU's dense bf16 tensor throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from benchmarks import flops as F
from benchmarks.common import commit, now, read_jsonl, steady_rate, versions
from finetune.util.errors import RecipeError, RunError

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "RESULTS_GPU_BENCH.md"
GIB = 2**30
# Published single-run figures to put ours next to. Compare like with like: same model, method, GPU,
# sequence length and batch; tokens/s definitions differ between projects (trained vs all tokens).
PUBLISHED = [
    {"source": "torchtune", "model": "Llama 3.1 8B", "method": "QLoRA", "gpus": "1x RTX 4090",
     "peak_memory_gib": 7.4, "tokens_per_s_per_gpu": 2413},
]
# Dense bf16 tensor-core peak, TFLOPS (vendor datasheets; with FP32 accumulation for GeForce cards).
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1,
                    "L4": 121.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.measure", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides, as for training")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps timed after the warm-up (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="steps run before timing starts (default 10)")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU (default: from its name)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report to write")
    ap.add_argument("--run-dir", type=Path, help="keep the run here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    a = ap.parse_args(argv)
    problems = [f"unexpected argument '{o}': overrides are key=value" for o in a.overrides if "=" not in o]
    if a.steps < 1:
        problems.append(f"--steps must be at least 1, got {a.steps}")
    if a.warmup < 1:
        problems.append(f"--warmup must be at least 1, got {a.warmup}")
    if a.peak_tflops is not None and a.peak_tflops <= 0:
        problems.append(f"--peak-tflops must be positive, got {a.peak_tflops}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and a.run_dir is None:
        # Every rank must write to the same run dir; a temporary one would differ per process.
        problems.append("--run-dir is required when launched on several processes (a directory all ranks share)")
    if problems:
        raise RecipeError(problems)
    a.steps = -(-a.steps // a.warmup) * a.warmup  # whole logging windows of `warmup` steps
    return a


def bench_overrides(a: argparse.Namespace, run_dir: Path) -> list[str]:
    """The user's overrides, then ours: a fixed number of steps, logs every `warmup` steps, no evaluation
    and no checkpoints in the timed part, a fresh run dir. The learning-rate warm-up is cut to the warm-up
    steps so a short run passes validation (the schedule does not change the speed)."""
    return [*a.overrides, f"train.max_steps={a.warmup + a.steps}", f"train.log_every={a.warmup}",
            f"train.warmup_steps={a.warmup}",
            "train.eval_every=null", "train.save_every=null", "train.resume=false", "output.progress_bar=false",
            f"output.dir={run_dir}"]


def peak_tflops(gpu_name: str, override: float | None = None) -> float | None:
    if override:
        return override
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100", "L40S" before "L4"
        if re.search(rf"(^|\W){re.escape(key)}($|\W)", gpu_name, flags=re.I):
            return PEAK_BF16_TFLOPS[key]
    return None


def gpu_available() -> bool:
    """CUDA present? Looks for NVIDIA device nodes first so a machine without them answers at once."""
    import glob

    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    import torch

    return torch.cuda.is_available()


def summarize(records: list[dict], peaks: list[dict], *, warmup: int, world: int, arch, lora_r: int,
              lora_targets, seq: int, checkpointing: bool, tokens_per_trained: float, gpu_name: str,
              tflops: float | None) -> dict:
    """Steady throughput, MFU and per-GPU memory from the run's metrics records and each rank's peaks."""
    rate = steady_rate(records, after_step=warmup)
    per_gpu = rate["tokens_per_s"] / world  # the loop logs trained tokens of all ranks together
    processed = per_gpu * tokens_per_trained
    model = F.lora_step_flops(arch, lora_r, seq, checkpointing=False, targets=lora_targets)["model"]
    hardware = F.lora_step_flops(arch, lora_r, seq, checkpointing=checkpointing, targets=lora_targets)["model"]
    out = {"gpu": gpu_name, "gpus": world, "tokens_per_s": rate["tokens_per_s"], "tokens_per_s_per_gpu": per_gpu,
           "processed_tokens_per_s_per_gpu": processed, "s_per_step": rate["s_per_step"],
           "timed_steps": rate["steps"], "warmup_steps": warmup,
           "peak_allocated_gib": [p["allocated"] / GIB for p in peaks],
           "peak_reserved_gib": [p["reserved"] / GIB for p in peaks],
           "flops_per_token_model": model, "flops_per_token_hardware": hardware, "peak_tflops": tflops,
           "mfu": None, "hfu": None}
    if tflops:
        out["mfu"] = F.mfu(processed, model, tflops * 1e12)
        out["hfu"] = F.mfu(processed, hardware, tflops * 1e12)
    return out


def _gib(xs) -> str:
    return f"{max(xs):.2f} GiB" if xs else "n/a"


def report(result: dict) -> str:
    """RESULTS_GPU_BENCH.md: our run, then the published rows, with the settings that make them comparable."""
    r = result
    mfu = "n/a (unknown GPU: pass --peak-tflops)" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    hfu = "" if r.get("hfu") is None else f" (HFU {100 * r['hfu']:.1f}%)"
    lines = ["# GPU benchmark", "",
             f"`{r['command']}` on {r['date']}, commit `{r['commit']}`; {r['gpus']}x {r['gpu']}.", "",
             "| run | model | method | GPUs | peak memory per GPU (allocated / reserved) | trained tokens/s per GPU "
             "| MFU |", "|---|---|---|---|---|---|---|",
             f"| finetune ({r['recipe']}) | {r['model']} | {r['method']} | {r['gpus']}x {r['gpu']} | "
             f"{_gib(r['peak_allocated_gib'])} / {_gib(r['peak_reserved_gib'])} | "
             f"{r['tokens_per_s_per_gpu']:,.0f} | {mfu}{hfu} |"]
    for p in PUBLISHED:
        lines.append(f"| {p['source']} (published) | {p['model']} | {p['method']} | {p['gpus']} | "
                     f"{p['peak_memory_gib']} GiB | {p['tokens_per_s_per_gpu']:,} | - |")
    lines += ["", f"Settings: sequence length {r['seq_len']}, micro-batch {r['micro_batch']}, gradient "
              f"accumulation {r['grad_accum']}, packing {r['packing']}, activation checkpointing "
              f"{r['checkpointing']}; {r['warmup_steps']} warm-up steps, then {r['timed_steps']} timed steps "
              f"({r['s_per_step']:.3f} s each).", "",
              f"Throughput counts trained tokens (those in the loss); processed tokens per GPU: "
              f"{r['processed_tokens_per_s_per_gpu']:,.0f}/s. MFU = processed tokens/s x "
              f"{r['flops_per_token_model']:.4g} model FLOPs per token (LoRA: 4N + adapters + attention, no "
              f"recomputation) / peak {r['peak_tflops'] or 'unknown'} TFLOPS per GPU; HFU counts the "
              f"{r['flops_per_token_hardware']:.4g} FLOPs actually run, recomputation included.", "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def _peaks(torch) -> list[dict]:
    """Every rank's peak memory, gathered on all ranks (one entry when not distributed)."""
    mine = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        return got
    return [mine]


def measure(a: argparse.Namespace, argv: list[str], run_dir: Path) -> dict | None:
    """Train on the GPU(s); the result dict on rank 0, None elsewhere."""
    import torch

    from finetune.data.prepare import prepare
    from finetune.plan.archs import resolve
    from finetune.recipe import load
    from finetune.train.loop import train
    from finetune.weights.load.resolve import load_tokenizer

    rec = load(a.recipe, bench_overrides(a, run_dir))
    torch.cuda.reset_peak_memory_stats()
    train(rec, run_dir)
    peaks = _peaks(torch)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    stats = prepare(rec.data, load_tokenizer(rec.model)).stats  # processed vs trained tokens
    seq = rec.data.max_seq_len if rec.data.packing else max(1, round(stats["tokens"] / stats["rows"]))
    arch, _ = resolve(rec.model.name)
    name = torch.cuda.get_device_name(0)
    res = summarize(read_jsonl(run_dir / "metrics.jsonl"), peaks, warmup=a.warmup, world=len(peaks), arch=arch,
                    lora_r=rec.lora.r, lora_targets=rec.lora.target_modules, seq=seq,
                    checkpointing=rec.model.gradient_checkpointing,
                    tokens_per_trained=stats["tokens"] / max(1, stats["trained_tokens"]), gpu_name=name,
                    tflops=peak_tflops(name, a.peak_tflops))
    return {**res, "command": " ".join(["python -m benchmarks.gpu.measure", *argv]), "date": now(), "commit": commit(),
            "recipe": a.recipe, "model": rec.model.name, "method": rec.quantization.mode.upper() + " + LoRA",
            "seq_len": rec.data.max_seq_len, "micro_batch": rec.train.micro_batch_size,
            "grad_accum": rec.train.gradient_accumulation_steps, "packing": rec.data.packing,
            "checkpointing": rec.model.gradient_checkpointing, "versions": versions()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse_args(argv)
        from finetune.recipe import load

        load(a.recipe, bench_overrides(a, Path("runs/gpu-bench")))  # bad recipe or overrides: exit 2 now
        if not gpu_available():
            raise RecipeError(["benchmarks.gpu.measure needs a CUDA GPU and this machine has none; run it on a GPU "
                               "machine (python -m benchmarks measures what the CPU can)"])
    except RecipeError as e:
        print(e.render(), file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="finetune-gpu-bench-") as tmp:
            result = measure(a, argv, a.run_dir or Path(tmp))
    except RecipeError as e:  # e.g. the run dir already holds checkpoints
        print(e.render(), file=sys.stderr)
        return 2
    except RunError as e:  # the training itself stopped (diverged, run dir in use, GPU unusable): finetune's exit 3
        print(e.render(), file=sys.stderr)
        return 3
    if result is None:
        return 0
    a.out.write_text(report(result))
    print(report(result))
    if a.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
