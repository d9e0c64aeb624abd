"""Shared by the benchmark rows: fresh processes, medians, steady-state throughput, machine facts.

Nothing here imports torch: the orchestrator stays small and every measurement happens in a child.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# What a training child imports anyway. The fork server imports it once, so each run pays for its model,
# data and steps but not for ~10 s of imports (which row 6 measures on its own).
PRELOAD = ["benchmarks._preload"]


def child_env(threads: int | None = None) -> dict:
    """Environment for exec'd children: this checkout first on the path, quiet libraries."""
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    # Benchmarks train models that are large for a CPU on purpose (the preflight would refuse them).
    env["FINETUNE_ALLOW_CPU"] = "1"
    # Nothing here downloads (synthetic and builtin models): offline from the start, as `finetune train` sets
    # it for itself, so a warm process (benchmarks/gpu/warm.py) imports the hub's library as its commands run.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def fork_context():
    """A forkserver context whose server has imported torch, transformers, peft, bitsandbytes, accelerate
    and finetune. Each task then runs in a new process forked from that clean server (not from the
    caller), so runs share no allocator state, caches or model objects with each other."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _call(conn, fn, args):
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # report any failure to the parent instead of dying silently
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
    finally:
        conn.close()


def in_fresh_process(ctx, fn, *args, timeout: float = 600):
    """fn(*args) in a new process of `ctx`; its return value (picklable), or RuntimeError with its error."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout:.0f} s")
        status, value = recv.recv()
    except EOFError:
        proc.join(5)
        status, value = "error", f"the child died (exit code {proc.exitcode})"
    finally:
        if proc.is_alive():
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(value)
    return value


def interleaved(ctx, fns: dict, reps: int, timeout: float = 600) -> dict[str, list]:
    """Run each named zero-argument task `reps` times, alternating A B, B A, A B, ... so slow drift of the
    machine (thermal, other load) falls on both sides equally. Returns name -> list of results."""
    names = list(fns)
    out: dict[str, list] = {n: [] for n in names}
    for i in range(reps):
        for name in (names if i % 2 == 0 else names[::-1]):
            fn, args = fns[name]
            out[name].append(in_fresh_process(ctx, fn, *args, timeout=timeout))
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def steady_rate(records: list[dict], after_step: int) -> dict:
    """Steady-state throughput from finetune's metrics.jsonl records.

    Each logged record carries `tokens_per_s` for the window since the previous log and `time` (seconds
    since the loop started). Windows that end after `after_step` are combined by their length, giving
    trained tokens per second over exactly those steps, and seconds per optimizer step."""
    rows = [r for r in records if "tokens_per_s" in r]
    tokens = seconds = steps = 0.0
    for prev, cur in zip(rows, rows[1:]):
        if prev["step"] < after_step:
            continue
        dt = cur["time"] - prev["time"]
        tokens += cur["tokens_per_s"] * dt
        seconds += dt
        steps += cur["step"] - prev["step"]
    if not steps:
        raise ValueError(f"no logged window after step {after_step} in {len(rows)} records")
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / steps, "steps": int(steps),
            "tokens": tokens, "seconds": seconds}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_json_line(text: str) -> dict:
    """The last line of a child's stdout that parses as a JSON object (libraries may print before it)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError("no JSON object in the child's output")


# ----------------------------------------------------------------------------------- machine facts

def versions() -> dict[str, str]:
    """Python and the library versions a run dir records (finetune.recipe.rundir.versions)."""
    from finetune.recipe.rundir import versions as library_versions

    return {"python": platform.python_version(),
            **{k: v for k, v in library_versions().items() if k not in ("finetune", "trl")}}


def _first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    mem = _first("/proc/meminfo", "MemTotal")
    return {"cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
            "os": f"{platform.system()} {platform.release()}", "threads": os.environ.get("OMP_NUM_THREADS")}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def commit() -> str:
    """HEAD of this checkout, with '+dirty' when tracked files (other than the results) differ."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()
             if not ln.endswith(("benchmarks/RESULTS.md", "benchmarks/RESULTS.json"))]
    return head + ("+dirty" if dirty else "")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def run_module(module: str, kwargs: dict, timeout: float, threads: int | None = None) -> dict:
    """Run `module.run(**kwargs)` in a fresh interpreter; its result dict, or {"error": ...}."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks._child", module, json.dumps(kwargs)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"error": f"exit {proc.returncode}", "stderr": tail, "seconds": seconds}
    try:
        result = last_json_line(proc.stdout)
    except ValueError as e:
        return {"error": str(e), "seconds": seconds}
    result.setdefault("seconds", seconds)
    return result


def resolved_precision(rec):
    """`rec` with the precision finetune's loop resolves on this machine (finetune.train.precision): every arm
    of a side-by-side row computes as finetune does."""
    import torch

    from finetune.train.precision import resolve_cpu_precision

    return resolve_cpu_precision(rec, on_cpu=not torch.cuda.is_available())[0]
