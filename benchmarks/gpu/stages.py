"""The stages of the GPU proof (benchmarks/gpu/proof.py runs each in its own process, under a time cap).

    python -m benchmarks.gpu.stages STAGE --work DIR [--dry-run]

Each stage prints its result as the last line of its output, one JSON object. On a GPU the stages use the
real shapes (a full-depth synthetic Llama 3.1 8B, a 70B-width model of few layers, micro-batch 2 x 2048); with
--dry-run the same code runs on tiny shapes on the CPU (gloo for the world-size-1 FSDP runs, one thread), so
the wiring, the files and the checks are proven before a GPU is used. Training, eval, generate and estimate go
through finetune's own commands (`python -m finetune ...`, torchrun for FSDP), as a user runs them; in the dry
run, through the proof's warm process when it has one (harness.python_m, benchmarks/gpu/warm.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, child_env, last_json_line, read_jsonl
from benchmarks.gpu import longctx, methods, speed
from benchmarks.gpu.harness import (GIB, built, estimate, finetune, must, phase_peaks, plan_errors, plan_figures,
                                    python_m, read_env, recipe, sh, shapes, torchrun, train_and_read, write_recipe)


# ----------------------------------------------------------------------------------------------- stages

def stage_env(work: Path, sh_: dict) -> dict:
    """GPU, driver, versions; bitsandbytes' library and kernels against CPU and dequantized references; paged
    memory; the measured bf16 matmul and copy ceilings."""
    import importlib.metadata as md

    import torch

    out: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "accelerate", "peft", "bitsandbytes", "trl", "datasets", "safetensors",
                "tokenizers", "pydantic"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    from packaging.version import Version

    from benchmarks.gpu.floors import check_floors

    out["floors"] = check_floors()
    out["transformers_ok"] = Version(out["transformers"] or "0") >= Version("5.23")
    dev = torch.device(sh_["device"])
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 2)
        out["capability"] = list(torch.cuda.get_device_capability(0))
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        out["nvidia_smi"] = q.stdout.strip()
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    lib = getattr(bnb.cextension, "lib", None)
    out["bnb_library"] = str(getattr(lib, "_name", None) or getattr(getattr(lib, "_lib", None), "_name", "?"))
    torch.manual_seed(0)
    w = torch.randn(1024, 1024, dtype=torch.bfloat16) * 0.02
    qc, sc = F.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True)
    qd, sd = F.quantize_4bit(w.to(dev), quant_type="nf4", blocksize=64, compress_statistics=True)
    same = (qd.cpu().view(torch.uint8) == qc.view(torch.uint8)).float().mean().item()
    out["quantize_4bit_bytes_equal_cpu"] = same
    x = torch.randn(8, 1024, dtype=torch.bfloat16, device=dev)
    ref = x.float() @ F.dequantize_4bit(qd, sd).float().t()
    got = bnb.matmul_4bit(x, qd.t(), quant_state=sd).float()
    out["matmul_4bit_rel_err"] = ((got - ref).norm() / ref.norm()).item()
    p = torch.nn.Parameter(torch.randn(4096, 4096, device=dev))
    try:
        opt = bnb.optim.PagedAdamW8bit([p], lr=1e-3) if dev.type == "cuda" else bnb.optim.AdamW8bit([p], lr=1e-3)
        p.grad = torch.randn_like(p)
        before = p.detach().clone()
        opt.step()
        out["paged_adamw_8bit"] = "works" if not torch.equal(before, p.detach()) else "no change"
    except Exception as e:  # record it: the recipe would fall back to adamw_8bit
        out["paged_adamw_8bit"] = f"failed: {type(e).__name__}: {e}"[:300]
    n = 8192 if dev.type == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    out["matmul_bf16_tflops"] = round(2 * n**3 / _timed(lambda: a @ b, dev) / 1e12, 1)
    big = torch.empty(2**30 if dev.type == "cuda" else 2**24, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    out["copy_gb_s"] = round(2 * big.numel() / _timed(lambda: dst.copy_(big), dev) / 1e9, 1)
    return out


def _timed(fn, dev, reps: int = 10) -> float:
    import torch

    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def stage_models(work: Path, sh_: dict) -> dict:
    """Build the 8B models into the cache (drawn on the GPU when there is one); the 70B-width one is built by
    its own stage, which may be skipped."""
    from finetune.weights.built.synthetic import synthetic_dir

    out = {}
    for key in ("m8", "m8_short"):
        t0 = time.perf_counter()
        d = synthetic_dir(sh_[key])
        size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        out[key] = {"name": sh_[key], "gib": round(size / GIB, 2), "seconds": round(time.perf_counter() - t0, 1)}
    return out


def stage_single(work: Path, sh_: dict) -> dict:
    """The 8B recipe at 2 x seq, one process: tokens/s, MFU, memory per phase beside the planner's."""
    from benchmarks import flops as F
    from benchmarks.gpu.measure import peak_tflops
    from finetune.plan.archs import resolve

    steps = sh_["warmup"] + sh_["steps"]
    rec = recipe(sh_["m8"], sh_["seq"], steps, work / "single", held_out=False)  # no eval in the timed run
    res = train_and_read(rec, work, "single", sh_)
    plan = estimate(work / "single.yaml", work / "commands.log")
    arch, _ = resolve(sh_["m8"])
    seq = sh_["seq"]
    flops = F.lora_step_flops(arch, 16, seq, checkpointing=False)["model"]
    # Every token of a synthetic row is trained and no row is padded: processed tokens = trained tokens.
    res["all_tokens_per_s"] = res["trained_tokens_per_s"]
    env = read_env(work)
    measured_peak = env.get("matmul_bf16_tflops")
    sheet = peak_tflops(env.get("gpu", "")) if env.get("gpu") else None
    res["mfu_vs_measured_matmul"] = (F.mfu(res["trained_tokens_per_s"], flops, measured_peak * 1e12)
                                     if measured_peak else None)
    res["mfu_vs_datasheet"] = F.mfu(res["trained_tokens_per_s"], flops, sheet * 1e12) if sheet else None
    res["flops_per_token"] = flops
    res["plan"] = plan_figures(plan)
    res["errors_pct"] = plan_errors(res["memory"], res["plan"])
    return res


def stage_fsdp(work: Path, sh_: dict, version: int) -> dict:
    """FSDP at world size 1 through torchrun (NCCL on a GPU, gloo in the dry run): the sharded streaming load,
    train, save, resume, eval, generate; for FSDP2 the packed-byte and logits check against a whole load."""
    name = f"fsdp{version}"
    steps = 4
    rec = recipe(sh_["m8_short"], sh_["seq"], steps, work / name,
                 distributed={"strategy": "fsdp", "num_processes": 1}, fsdp={"version": version})
    rec["train"].update({"save_every": 2, "log_every": 1})
    if version == 1:  # FSDP1 flattens one dtype per unit: fp32 storage keeps the adapters fp32 (lora.dtype)
        rec["model"]["dtype"] = "float32"
    res = {}
    first = train_and_read(rec, work, name, {**sh_, "warmup": 1}, launcher=torchrun)
    res["train"] = {k: first[k] for k in ("seconds", "trained_tokens_per_s", "first_loss", "last_loss", "memory")}
    log = work / "commands.log"
    res["plan"] = plan_figures(estimate(work / f"{name}.yaml", log))
    res["errors_pct"] = plan_errors(first["memory"], res["plan"])
    # Resume: two more steps from the step-4 checkpoint; the run must say so and not re-run steps 1-4.
    rec["train"]["max_steps"] = steps + 2
    path = write_recipe(rec, work / f"{name}.yaml")
    p = must(sh(torchrun(str(path)), log=log), f"{name} resume")
    text = p.stdout + p.stderr
    steps_logged = [r["step"] for r in read_jsonl(work / name / "metrics.jsonl") if "loss" in r]
    res["resume"] = {"said_resume": f"from {work / name / 'checkpoints' / f'step-{steps}'}" in text,
                     "steps_after_resume": [s for s in steps_logged if s > steps],
                     "ok": f"(step {steps})" in text and steps_logged.count(1) == 1}
    p = must(sh(finetune("eval", str(work / name), "--json"), log=log), f"{name} eval")
    res["eval"] = last_json_line(p.stdout)
    p = must(sh(finetune("generate", str(work / name), "--prompt", "Hello", "--max-new-tokens", "8"), log=log),
             f"{name} generate")
    res["generate"] = {"ok": True, "output_tail": p.stdout.strip()[-200:]}
    res["attention_line"] = [ln for ln in text.splitlines() if "attention" in ln.lower()][:2]
    if version == 2:
        p = must(sh(torchrun(str(work / f"{name}.yaml"), module="benchmarks.gpu.bytecheck"), log=log), "bytecheck")
        res["bytecheck"] = last_json_line(p.stdout)
    return res


def stage_load70b(work: Path, sh_: dict) -> dict:
    """The 70B-width model (few layers): GPU memory after load and wrap (2 steps) against the planner."""
    from finetune.weights.built.synthetic import synthetic_dir

    t0 = time.perf_counter()
    synthetic_dir(sh_["m70"])  # built first, in this process: the run's load phase then holds the load alone
    built = round(time.perf_counter() - t0, 1)
    rec = recipe(sh_["m70"], min(sh_["seq"], 512), 2, work / "load70b", held_out=False)
    res = train_and_read(rec, work, "load70b", {**sh_, "warmup": 1})
    res["build_seconds"] = built
    plan = estimate(work / "load70b.yaml", work / "commands.log")
    res["plan"] = plan_figures(plan)
    res["errors_pct"] = plan_errors(res["memory"], res["plan"])
    return res


def stage_trl(work: Path, sh_: dict) -> dict:
    """TRL's SFTTrainer (peft + bitsandbytes) on the same 8B model, rows, batch, LoRA, optimizer and bf16."""
    p = must(sh(python_m("benchmarks.peers.trl_gpu", json.dumps({**sh_, "work": str(work)})),
                log=work / "commands.log"), "TRL arm")
    trl = last_json_line(p.stdout)
    single = work / "stage_single.json"
    ours = json.loads(single.read_text()) if single.exists() else None
    out = {"trl": trl}
    if ours:
        out["finetune_over_trl"] = {
            "tokens_per_s": round(ours["trained_tokens_per_s"] / trl["tokens_per_s"], 3),
            "peak_allocated": (round(ours["memory"]["phases"]["steps"]["peak_allocated_gib"] / trl["peak_allocated_gib"], 3)
                               if ours["memory"]["kind"] == "cuda" else None)}
    return out


def stage_fp16(work: Path, sh_: dict) -> dict:
    """fp16 with loss scaling through the real loop, then a stop (SIGTERM) between micro-batches and resume."""
    import signal

    rec = recipe(sh_["m8_short"], sh_["seq"], 40, work / "fp16",
                 train={"mixed_precision": "fp16", "gradient_accumulation_steps": 2, "save_every": 1000})
    rec["quantization"]["compute_dtype"] = "float16"
    rec["model"]["dtype"] = "float32"  # fp16 trains on fp32 storage and master weights (validate says why)
    path = write_recipe(rec, work / "fp16.yaml")
    env = child_env()
    proc = subprocess.Popen(finetune(str(path)), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = work / "fp16" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:  # stop once two steps are logged
        if metrics.exists() and sum(1 for _ in metrics.open()) >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    text, _ = proc.communicate(timeout=600)
    with (work / "commands.log").open("a") as f:
        f.write(f"$ fp16 run, SIGTERM after two logged steps (exit {proc.returncode})\n{text[-20000:]}\n")
    records = read_jsonl(metrics)
    losses = [r["loss"] for r in records if "loss" in r]
    import math

    return {"exit": proc.returncode, "stopped_line": next((ln for ln in text.splitlines() if "stopped by signal" in ln), None),
            "steps_logged": len(losses), "losses_finite": all(math.isfinite(x) for x in losses),
            "skipped_steps": [r.get("skipped_steps") for r in records if "skipped_steps" in r][-1:],
            "checkpoints": sorted(p.name for p in (work / "fp16" / "checkpoints").glob("step-*"))}


def stage_fsdp2_trace(work: Path, sh_: dict) -> dict:
    """Where FSDP2's step peak comes from: the fsdp2 stage's model and batch for 2 steps, with torch's allocator
    trace (FINETUNE_MEMORY_TRACE, GPU only): the allocations alive at the peak, by the line that made them."""
    rec = recipe(sh_["m8_short"], sh_["seq"], 2, work / "fsdp2_trace", held_out=False,
                 distributed={"strategy": "fsdp", "num_processes": 1}, fsdp={"version": 2})
    path = write_recipe(rec, work / "fsdp2_trace.yaml")
    trace = work / "trace"
    must(sh(torchrun(str(path)), log=work / "commands.log", env_extra={"FINETUNE_MEMORY_TRACE": str(trace)}),
         "fsdp2 traced run")
    f = trace / "memory_trace_rank0.json"
    return {"memory": phase_peaks(work / "fsdp2_trace"),
            "trace": json.loads(f.read_text()) if f.exists() else "no trace (recorded on CUDA only)"}


def stage_syncs(work: Path, sh_: dict) -> dict:
    """Host synchronisations per optimizer step (benchmarks/gpu/syncs.py) at 4 micro-batches a step: one
    process, and FSDP2 at world size 1 through torchrun. The loop's contract: at most one per step."""
    out = {}
    seq = min(sh_["seq"], 512)
    for name, sections, launch in (
            ("syncs_single", {}, lambda *a: python_m("benchmarks.gpu.syncs", *a)),
            ("syncs_fsdp2", {"distributed": {"strategy": "fsdp", "num_processes": 1}, "fsdp": {"version": 2}},
             lambda *a: torchrun(*a, module="benchmarks.gpu.syncs"))):
        rec = recipe(sh_["m8_short"], seq, 4, work / name, held_out=False, **sections)
        rec["train"]["gradient_accumulation_steps"] = 4
        rec["data"]["sources"] = [{"path": f"synthetic:tokens?rows=40&min_len={seq}&max_len={seq}"}]
        path = write_recipe(rec, work / f"{name}.yaml")
        res_file = work / f"{name}.json"
        must(sh(launch(str(path), str(res_file)), log=work / "commands.log"), name)
        out[name] = json.loads(res_file.read_text())
    # Which operation of a backward waits (torch reports autograd's waits without their lines): one run
    # stopped at its 6th backward, under the debug mode's error setting and anomaly mode.
    res_file = work / "syncs_probe.json"
    rec = recipe(sh_["m8_short"], seq, 4, work / "syncs_probe", held_out=False)
    rec["train"]["gradient_accumulation_steps"] = 4
    rec["data"]["sources"] = [{"path": f"synthetic:tokens?rows=40&min_len={seq}&max_len={seq}"}]
    path = write_recipe(rec, work / "syncs_probe.yaml")
    must(sh(python_m("benchmarks.gpu.syncs", str(path), str(res_file), "--probe-backward"),
            log=work / "commands.log"), "syncs probe")
    out["probe"] = json.loads(res_file.read_text()).get("backward_probe")
    return out


STAGES = {"env": stage_env, "models": stage_models, "single": stage_single,
          "fsdp2": lambda w, s: stage_fsdp(w, s, 2), "fsdp1": lambda w, s: stage_fsdp(w, s, 1),
          "load70b": stage_load70b, "trl": stage_trl, "fp16": stage_fp16, "fsdp2_trace": stage_fsdp2_trace,
          "syncs": stage_syncs, **methods.STAGES, **speed.STAGES, **longctx.STAGES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.stages")
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        # Tiny shapes gain nothing from a second thread, and on a busy machine (CI, 2 cores) torch's threads
        # wait on each other: a step took 5 s on 2 threads beside other work and 0.1 s on one. The stage's own
        # torch and every command it starts (they inherit the environment) run on one thread.
        os.environ["OMP_NUM_THREADS"] = "1"
    res = STAGES[a.stage](a.work, shapes(a.dry_run))
    (a.work / f"stage_{a.stage}.json").write_text(json.dumps(res, default=str, indent=1))
    print(json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
