"""The first GPU run, prepared to the minute: every stage of benchmarks/gpu/stages.py in priority order, each in
its own process under a time cap, the whole under a deadline.

    python -m benchmarks.gpu.proof --out-dir DIR [--deadline 420] [--stages env,models,...] [--dry-run]

A stage whose estimate no longer fits in what is left of the deadline is skipped, and the summary says so.
After every stage DIR holds: results.json (every stage's result or error), RESULTS_GPU.md (the report),
log.txt (each stage's output), commands.log (every finetune command the stages ran, with its output) and
env.json (the environment stage's facts); at most 8 files in all,
so a device call brings all of it back. --dry-run runs the same stages on tiny shapes on the CPU (gloo for the
world-size-1 FSDP stages, one thread): the wiring, the skip logic and the files, proven before a GPU is used.
Its stages and commands fork from one warm process that imported the libraries once (benchmarks/gpu/warm.py),
but for the env and single stages, which start fresh interpreters as on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, child_env, commit, last_json_line, now

# name, what it proves, estimated seconds on a GPU, on the CPU dry run, and its cap on a GPU. The dry run's
# estimates are what its stages took on 2 busy cores (other work beside it), rounded up; models', the first
# stage to use the warm process, includes waiting for that process's imports.
STAGES = [
    ("env", "GPU, driver, versions, bitsandbytes' CUDA kernels against CPU/dequantized references, ceilings",
     45, 15, 120),
    ("models", "synthetic Llama 3.1 8B (full depth) and a 70B-width model, drawn on the GPU", 90, 10, 240),
    ("single", "the 8B recipe at 2 x 2048, one process: tokens/s, MFU, memory per phase vs plan", 120, 25, 300),
    ("fsdp2", "FSDP2 at world size 1 (NCCL): train, resume, eval, generate, packed-byte check", 150, 25, 300),
    ("fsdp1", "FSDP1 at world size 1 (NCCL): train, resume, eval, generate", 130, 25, 300),
    ("load70b", "70B-width model: memory after load and wrap vs the planner", 70, 10, 240),
    ("trl", "TRL SFTTrainer on the same 8B model and batch: ratios", 120, 10, 300),
    ("fp16", "fp16 with loss scaling, a stop between micro-batches", 60, 10, 180),
    ("fsdp2_trace", "FSDP2 world 1, 2 steps under torch's allocator trace: what is alive at the peak", 60, 10, 180),
    ("syncs", "host synchronisations per optimizer step (4 micro-batches), one process and FSDP2", 70, 25, 200),
    ("moe", "Qwen3-30B-A3B widths (128 experts, 4 layers), experts 4-bit with LoRA on them: train, plan, eval",
     100, 10, 240),
    ("moe_speed", "grouped 4-bit experts, Qwen3-30B-A3B at 48 layers, LoRA on attention and experts, 2 x 2048: "
     "tokens/s, peak vs plan; the per-expert loop on 4 layers beside it", 420, 75, 900),
    ("adapters", "DoRA beside LoRA on the 4-layer 8B-width model, one process: tokens/s and memory vs plan", 60, 10, 240),
    ("preference", "DPO and ORPO through the loop on the builtin pairs, then eval's preference accuracy", 130, 15, 240),
    # a call of its own on a GPU (`--stages speed --deadline 560`): five 8B runs, TRL's beside them
    ("speed", "8B at 2 x 2048: today, checkpointing auto, compile, liger kernels, all; TRL beside: tokens/s, "
     "memory, curves, host time", 360, 20, 570),
    ("speed_unsloth", "unsloth on the same 8B rows in its own interpreter path, beside the speed arms", 150, 5, 400),
    # 2 steps of the full-depth 8B at ~0.5M and ~0.25M tokens: attention alone is minutes a step on a GPU
    ("long_context", "the 8B at the planner's longest length (offloading + tiled MLP), card and 24 GiB: peak vs plan",
     1500, 15, 2400),
]
FILES = ("results.json", "RESULTS_GPU.md", "log.txt", "env.json", "commands.log")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.proof", description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="where the result files go (at most 8)")
    ap.add_argument("--deadline", type=float, default=420, help="seconds for all stages together (default 420)")
    ap.add_argument("--stages", help="comma-separated subset, in the order given (default: all, by priority)")
    ap.add_argument("--work", type=Path, help="scratch directory for run dirs (default: a temporary one)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: proves the wiring")
    a = ap.parse_args(argv)
    known = [s[0] for s in STAGES]
    a.order = known
    if a.stages:
        a.order = [s.strip() for s in a.stages.split(",") if s.strip()]
        unknown = [s for s in a.order if s not in known]
        if unknown:
            ap.error(f"unknown stage(s) {unknown}; known: {', '.join(known)}")
    if a.deadline <= 0:
        ap.error("--deadline must be positive")
    return a


def run_stage(name: str, work: Path, dry: bool, cap: float, log: Path, env_extra: dict | None = None) -> dict:
    from benchmarks.gpu.warm import ENV

    warm = ["-m", "benchmarks.gpu.warm"] if ENV in (env_extra or {}) else []  # the stage itself forks from it too
    cmd = [sys.executable, *warm, "-m", "benchmarks.gpu.stages", name, "--work", str(work)] + (["--dry-run"] if dry else [])
    t0 = time.perf_counter()
    # Its own session, so a stage stopped at its cap takes its children (training runs, torchrun) with it.
    p = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), **(env_extra or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=cap)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        code = None
    seconds = round(time.perf_counter() - t0, 1)
    with log.open("a") as f:
        f.write(f"\n===== stage {name}: {seconds} s, exit {code} =====\n{out[-30000:]}\n")
    if code is None:
        return {"status": "timed out", "seconds": seconds, "cap": cap}
    if code != 0:
        tail = "\n".join(out.strip().splitlines()[-12:])
        return {"status": "failed", "seconds": seconds, "exit": code, "tail": tail}
    try:
        return {"status": "ok", "seconds": seconds, "result": last_json_line(out)}
    except ValueError as e:
        return {"status": "failed", "seconds": seconds, "tail": str(e)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    log = a.out_dir / "log.txt"
    results_file = a.out_dir / "results.json"
    # A rerun of some stages keeps the earlier stages' results (the first call's file, brought back).
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    results.setdefault("stages", {})
    results["meta"] = {"date": now(), "commit": commit(), "dry_run": a.dry_run, "deadline_s": a.deadline,
                       "command": "python -m benchmarks.gpu.proof " + " ".join(argv or sys.argv[1:])}
    by_name = {s[0]: s for s in STAGES}
    start = time.perf_counter()
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="gpu-proof-")
    work = a.work or Path(tmp.name)
    if a.dry_run:
        os.environ["OMP_NUM_THREADS"] = "1"  # tiny shapes; see benchmarks/gpu/stages.py main
    warm = start_warm(work) if a.dry_run else None
    try:
        for name in a.order:
            _, what, est_gpu, est_dry, cap = by_name[name]
            left = a.deadline - (time.perf_counter() - start)
            est = est_dry if a.dry_run else est_gpu
            if est > left:
                res = {"status": "skipped", "why": f"estimate {est} s > {left:.0f} s left of the deadline"}
            else:
                res = run_stage(name, work, a.dry_run, min(cap, max(left, 1)), log, warm_env(warm, name))
            # Each stage says where and when it ran: results pages merge stages from several runs and cards.
            res.update(what=what, date=results["meta"]["date"], commit=results["meta"]["commit"],
                       device=device_of(results, a.out_dir))
            results["stages"][name] = res
            print(f"[gpu_proof] {name}: {res['status']} ({res.get('seconds', 0)} s)", flush=True)
            if name == "env" and res["status"] == "ok":
                (a.out_dir / "env.json").write_text(json.dumps(res["result"], indent=1))
            write_outputs(a.out_dir, results)
            if (work / "commands.log").exists():  # every finetune command the stages ran, with its output
                shutil.copyfile(work / "commands.log", a.out_dir / "commands.log")
    finally:
        stop_warm(warm)
        if tmp is not None:
            tmp.cleanup()
    print(summary(results), flush=True)
    return 0 if all(r["status"] == "ok" for r in results["stages"].values()) else 1


def start_warm(work: Path) -> tuple[subprocess.Popen, Path] | None:
    """The dry run's warm process (benchmarks/gpu/warm.py): it imports the libraries while the env stage runs,
    and every later command forks from it. None (every command then starts cold) if it does not come up."""
    from benchmarks.gpu.warm import ENV

    sock = Path(tempfile.mkdtemp(prefix="warm-")) / "sock"  # short: a socket's path holds at most 107 bytes
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)  # its forks start with its warning filters: the commands' own (harness.sh)
    env.pop(ENV, None)
    work.mkdir(parents=True, exist_ok=True)
    with (work / "warm.log").open("a") as log:  # what its imports print
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.warm", "serve", str(sock)], cwd=ROOT, env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.perf_counter() + 30
    while not sock.exists() and p.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.05)
    if not sock.exists():
        stop_warm((p, sock))
        return None
    return p, sock


COLD = ("env", "single")  # in the dry run too, these stages and their commands start fresh interpreters


def warm_env(warm, stage: str) -> dict:
    """A dry-run stage and its commands go through the warm process, but for COLD: env checks the libraries
    as a fresh interpreter loads them (while the warm process imports them beside it), and single's run and
    estimate start as a user's do, so what a fresh interpreter prints on import is in commands.log too."""
    from benchmarks.gpu.warm import ENV

    return {ENV: str(warm[1])} if warm and stage not in COLD else {}


def stop_warm(warm) -> None:
    if warm is None:
        return
    p, sock = warm
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(sock.parent, ignore_errors=True)


def device_of(results: dict, out: Path) -> str | None:
    """The GPU the env stage found, in this call or an earlier one whose env.json is in the out dir."""
    env = (results["stages"].get("env") or {}).get("result")
    if env is None and (out / "env.json").exists():
        env = json.loads((out / "env.json").read_text())
    return (env or {}).get("gpu")


def write_outputs(out: Path, results: dict) -> None:
    from benchmarks.gpu.report import report

    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "RESULTS_GPU.md").write_text(report(results))


def summary(results: dict) -> str:
    lines = ["", "stage     status      seconds  what"]
    for name, r in results["stages"].items():
        lines.append(f"{name:<9} {r['status']:<11} {r.get('seconds', '-')!s:>7}  {r['what']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
