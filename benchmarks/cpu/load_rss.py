"""Peak RSS while the 4-bit base loads: 1 process against 2 FSDP processes over gloo (FSDP2 and FSDP1).

A synthetic Llama (`synthetic:...`, 22 layers, hidden 2048, ~1.07B parameters: 2.1 GB in bf16) is built
once into the finetune cache. Each configuration runs in fresh processes (torchrun for 2) that import
everything, note their RSS, then do what a training run does before its first step: the streaming load,
LoRA (r=16, all linears) and `prepare` (FSDP wrapping, which is when FSDP ranks receive their shards).
Each process reports its peak RSS (VmHWM) over its RSS after imports, and the bytes of the model it then
holds (packed 4-bit weights, quantization state, other parameters: this rank's part).

Figures: growth per process; the 2-process / 1-process growth ratio (goal <= 0.6: each rank holds half);
the 1-process growth over the loaded model's bytes (goal <= 1.5: the bf16 weights are never all held);
and the planner's load phase (plan/loading.py, for a CPU run) against the measured growth of the reader.

    python -m benchmarks.cpu.load_rss            # prints the result; run() returns it
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ("synthetic:meta-llama/Meta-Llama-3-8B?layers={layers}&hidden=2048&intermediate=5632&heads=16"
         "&kv_heads=8&vocab=8192")
ROOT = Path(__file__).resolve().parents[2]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def held_bytes(model) -> int:
    """Bytes of the base this process holds: local parameter storage plus the 4-bit quantization state."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        if not p.requires_grad:
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and m.quant_state is not None:
            total += sum(v.numel() * v.element_size() for v in m.quant_state.as_dict(packed=True).values())
    return total


def worker(out: str, model_dir: str, version: int) -> None:
    """One process of one configuration (see the module doc); writes OUT/rank{R}.json."""
    # Every library first (the project imports them lazily): the baseline is the RSS after imports.
    import accelerate  # noqa: F401
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from finetune.recipe import DistributedSpec, FsdpSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec
    from finetune.train import parallel as D
    from finetune.weights.load.placement import placement_for
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_with_plan
    from finetune.weights.shard.fsdp import fill_shards
    from finetune.train.optim import build_optimizer

    base = _status_kib("VmRSS")
    train = TrainSpec(optimizer="adamw_torch")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    acc = D.make_accelerator(DistributedSpec(strategy="fsdp" if world > 1 else "single"),
                             FsdpSpec(version=version), train, "bfloat16")
    spec = ModelSpec(name=model_dir, dtype="bfloat16", gradient_checkpointing=False)
    # bf16 adapters: FSDP1 flattens one dtype per wrapped module (model.dtype here).
    model, plan = load_with_plan(spec, QuantizationSpec(), placement_for(acc), quiet=True)
    model = apply_lora(model, LoraSpec(dtype="bfloat16"), seed=0)
    model, _ = D.wrap(acc, model, build_optimizer(model.named_parameters(), train), plan)
    fill_shards(model, plan)
    result = {"rank": acc.process_index, "base_rss": base, "peak_rss": _status_kib("VmHWM"),
              "growth": _status_kib("VmHWM") - base, "held_bytes": held_bytes(model)}
    Path(out, f"rank{acc.process_index}.json").write_text(json.dumps(result))
    acc.wait_for_everyone()


def _launch(out: Path, model_dir: str, procs: int, version: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={procs}"]
    cmd = [*launcher, str(Path(__file__)), "--worker", str(out), model_dir, str(version)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]


def planned(name: str, procs: int, version: int) -> int:
    """The planner's load-phase bytes of the reader (rank 0), for this CPU run."""
    from dataclasses import replace

    from finetune.plan import estimate as E
    from finetune.plan import loading as load
    from finetune.plan.archs import resolve

    arch = resolve(name)[0]
    s = E.Setup(model=name, gpus=procs, strategy="fsdp" if procs > 1 else "single", fsdp_version=version,
                model_dtype="bfloat16", quant_storage="bfloat16", lora_dtype="bfloat16", lora_targets="all-linear",
                device="cpu")
    s = replace(s, lora_r=16)
    shard = procs if procs > 1 else 1
    return load.process_bytes(arch, s, E.weight_terms(arch, s), shard, E.DTYPE_BYTES, reader=True)


def run(layers: int = 22) -> dict:
    from finetune.weights.load.resolve import resolve_name

    name = MODEL.format(layers=layers)
    model_dir = resolve_name(name)  # built once into the finetune cache
    bf16 = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    out: dict = {"model": name, "checkpoint_bytes": bf16, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, procs, version in (("1 process", 1, 2), ("FSDP2 x2", 2, 2), ("FSDP1 x2", 2, 1)):
            d = Path(tmp) / label.replace(" ", "_")
            d.mkdir()
            ranks = _launch(d, model_dir, procs, version)
            out["runs"][label] = {"ranks": ranks, "planned_reader": planned(name, procs, version)}
    one = out["runs"]["1 process"]["ranks"][0]
    out["single_growth"] = one["growth"]
    out["single_growth_over_model"] = one["growth"] / one["held_bytes"]
    for label in ("FSDP2 x2", "FSDP1 x2"):
        worst = max(r["growth"] for r in out["runs"][label]["ranks"])
        out[f"{label} ratio"] = worst / one["growth"]
    out["ratio_2_over_1"] = max(out["FSDP2 x2 ratio"], out["FSDP1 x2 ratio"])
    out["plan_error"] = max(abs(run["planned_reader"] / run["ranks"][0]["growth"] - 1)
                            for run in out["runs"].values())
    return out


def table(r: dict) -> str:
    mib = 2**20
    lines = [f"Model `{r['model']}` ({r['checkpoint_bytes'] / 1e9:.2f} GB in bf16).", "",
             "| run | rank | peak growth | model bytes held | planned (reader) |", "|---|---|---|---|---|"]
    for label, run_ in r["runs"].items():
        for x in run_["ranks"]:
            plan = f"{run_['planned_reader'] / mib:.0f} MiB" if x["rank"] == 0 else ""
            lines.append(f"| {label} | {x['rank']} | {x['growth'] / mib:.0f} MiB | {x['held_bytes'] / mib:.0f} MiB "
                         f"| {plan} |")
    lines += ["", f"2 processes / 1 process, worst rank: FSDP2 {r['FSDP2 x2 ratio']:.3f}, FSDP1 "
              f"{r['FSDP1 x2 ratio']:.3f} (goal <= 0.6); 1 process growth / model bytes "
              f"{r['single_growth_over_model']:.3f} (goal <= 1.5); planner error (reader) {r['plan_error']:.3f} "
              "(goal <= 0.15)."]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        result = run()
        print(table(result))
        print(json.dumps(result, default=str))
