"""`train.compile: true` against eager on CPU, in one benchmark run: the same recipe, rows and steps, eager
then compiled (inductor, the real backend: C++ code generated and built with the machine's compiler), one
process or 2 FSDP2 processes. Reports the losses' largest difference over the steps (goal: <= 1e-4, fp32
compute), the steady trained tokens/s of each arm and their ratio (steps after `--warmup` only), the compiled
arm's step-1 seconds (the compile included) against the eager arm's, and the recompiles counted after step 1
(goal: 0).

    python -m benchmarks.cpu.compiled                         # the tiny recipe, one process, 50 steps
    python -m benchmarks.cpu.compiled --model 2gb --steps 50  # the 2 GB synthetic Llama (phase_rss's)
    python -m benchmarks.cpu.compiled --fsdp                  # 2 FSDP2 processes (gloo)
    python -m benchmarks.cpu.compiled --fsdp --fsdp-version 1 # 2 FSDP1 processes (use_orig_params)

The arms run one after the other on a machine other work may share: the ratio holds for the load both saw
(the load average before and after is recorded); run it on a quiet machine for figures to quote.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, child_env, load_average, read_jsonl, steady_rate
from benchmarks.cpu.phase_rss import MODEL

# fp32 compute and 32-bit Adam: the arms then differ by kernel rounding only, which 1e-4 bounds.
STRICT = {"mixed_precision": "no", "optimizer": "adamw_torch"}


def recipe(model: str, out: Path, steps: int, compile: bool, fsdp: bool, micro: int, seq: int,
           adam_epsilon: float | None = None, fsdp_version: int = 2) -> dict:
    rec = yaml.safe_load((ROOT / "recipes" / ("tiny_cpu_fsdp.yaml" if fsdp else "tiny_cpu.yaml")).read_text())
    if model != "tiny":
        rec["model"]["name"] = MODEL.format(layers=16) if model == "2gb" else model
    rec["model"]["gradient_checkpointing"] = False
    rec.setdefault("quantization", {})["compute_dtype"] = "float32"
    rec["data"].update({"max_seq_len": seq, "eval_sources": []})
    rec["train"].update({"max_steps": steps, "micro_batch_size": micro, "warmup_steps": 0, "log_every": 1,
                         "save_every": None, "eval_every": None, "compile": compile, **STRICT})
    if fsdp:
        rec.setdefault("fsdp", {})["version"] = fsdp_version
    if adam_epsilon is not None:
        rec["train"]["adam_epsilon"] = adam_epsilon
    rec["output"] = {"dir": str(out), "progress_bar": False}
    return rec


def run_arm(name: str, rec: dict, work: Path, fsdp: bool, cache: Path, fsdp_version: int = 2) -> dict:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file",
               str(ROOT / "configs" / "cpu_fsdp.yaml"), "--fsdp_version", str(fsdp_version), "--num_processes", "2", "-m", "finetune"] if fsdp
              else [sys.executable, "-m", "finetune"])
    env = child_env(1 if fsdp else None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # inductor's generated code and built .so files
    t0 = time.perf_counter()
    p = subprocess.run([*launch, str(path)], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed ({p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
    rows = [r for r in read_jsonl(Path(rec["output"]["dir"]) / "metrics.jsonl") if "loss" in r]
    said = re.search(r"compile: (\d+) of (\d+) decoder layers compiled \((\w+)\) into (\d+) graphs; step \d+ took "
                     r"([\d.]+) s", p.stdout + p.stderr)
    return {"losses": [r["loss"] for r in rows], "rows": rows, "wall_s": round(wall, 1),
            "step1_s": rows[0]["time"] if rows else None,
            "recompiles": [r["recompiles"] for r in rows] if rows and "recompiles" in rows[0] else None,
            "compiled": None if not said else {"layers": int(said[1]), "of": int(said[2]), "backend": said[3],
                                               "graphs": int(said[4]), "step1_s": float(said[5])}}


def run(model: str = "tiny", steps: int = 50, fsdp: bool = False, warmup: int = 5, micro: int = 4,
        seq: int = 64, adam_epsilon: float | None = None, inductor_cache: str | None = None,
        fsdp_version: int = 2) -> dict:
    if model == "2gb":
        from finetune.weights.built.synthetic import synthetic_dir

        synthetic_dir(MODEL.format(layers=16))  # built once, before either arm is timed
    work = Path(tempfile.mkdtemp(prefix="compiled-"))
    # A cache of its own unless told: compile_s is then what a first run pays (inductor reuses built code)
    cache = Path(inductor_cache) if inductor_cache else work / "inductor-cache"
    res = {"model": model, "steps": steps, "fsdp": fsdp and f"FSDP{fsdp_version}", "micro_batch": micro, "max_seq_len": seq,
           "adam_epsilon": adam_epsilon or 1e-8, "inductor_cache": "given" if inductor_cache else "new",
           "load_before": load_average()}
    try:
        for name, on in (("eager", False), ("compiled", True)):
            rec = recipe(model, work / name, steps, on, fsdp, micro, seq, adam_epsilon, fsdp_version)
            res[name] = run_arm(name, rec, work, fsdp, cache, fsdp_version)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = load_average()
    e, c = res["eager"], res["compiled"]
    diffs = [abs(a - b) for a, b in zip(e["losses"], c["losses"])]
    res["max_loss_diff"] = max(diffs)
    # Where they part: step 1's loss is the forward alone; later ones carry the optimizer's updates
    res["loss_diff_step1"] = diffs[0]
    res["first_step_over_1e-4"] = next((i + 1 for i, d in enumerate(diffs) if d > 1e-4), None)
    rate = {n: steady_rate(res[n].pop("rows"), warmup) for n in ("eager", "compiled")}
    res["tokens_per_s"] = {n: round(r["tokens_per_s"], 1) for n, r in rate.items()}
    res["tokens_per_s_ratio"] = round(rate["compiled"]["tokens_per_s"] / rate["eager"]["tokens_per_s"], 3)
    # What the compile added to step 1 (step 1 of each arm from the loop's start: same rows, same work)
    res["compile_s"] = round(c["step1_s"] - e["step1_s"], 1)
    res["recompiles_after_step1"] = max(c["recompiles"] or [0])
    res["goals"] = {"losses within 1e-4": res["max_loss_diff"] <= 1e-4, "no recompiles": res["recompiles_after_step1"] == 0}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu.compiled", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (builtin), 2gb (the 2 GB synthetic Llama), or a name")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the steady tokens/s")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="data.max_seq_len")
    ap.add_argument("--fsdp", action="store_true", help="2 FSDP processes instead of one")
    ap.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2, help="with --fsdp: FSDP2 or FSDP1")
    ap.add_argument("--adam-epsilon", type=float, default=None, help="train.adam_epsilon (default: the schema's)")
    ap.add_argument("--inductor-cache", default=None,
                    help="TORCHINDUCTOR_CACHE_DIR of both arms (default: a new one, so the compile is a first run's)")
    a = ap.parse_args(argv)
    res = run(a.model, a.steps, a.fsdp, a.warmup, a.micro_batch, a.seq, a.adam_epsilon, a.inductor_cache,
              a.fsdp_version)
    print(json.dumps({k: v for k, v in res.items() if k not in ("eager", "compiled")}
                     | {n: {k: v for k, v in res[n].items() if k != "losses"} for n in ("eager", "compiled")}))
    return 0 if all(res["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
