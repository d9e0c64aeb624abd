"""The end of a run in a few lines a person reads: wall time, throughput, peak memory (RUN_DIR/memory.json),
first and last loss and the held-out figures (RUN_DIR/metrics.jsonl), where the adapter is, and the commands
that come next. Read from the run dir's own files, so it says what they say."""
from __future__ import annotations

import json
from pathlib import Path


def read_records(run_dir: Path) -> list[dict]:
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def measured_keys(mem: dict) -> tuple[str, ...]:
    """The peaks memory.json holds per phase: torch's allocator on a GPU, the RSS on CPU (its `kind`)."""
    return ("peak_allocated", "peak_reserved") if mem.get("kind") == "cuda" else ("peak_rss",)


def peak_memory(run_dir: Path) -> str | None:
    """The largest measured peak over ranks and phases, with its phase and the plan's figure."""
    try:
        mem = json.loads((run_dir / "memory.json").read_text())
    except (OSError, ValueError):
        return None
    key = measured_keys(mem)[0]
    peaks = [(v.get(key) or 0, phase) for r in mem.get("ranks", []) for phase, v in r.get("phases", {}).items()]
    if not peaks:
        return None
    peak, phase = max(peaks)
    what = "GPU memory allocated" if key == "peak_allocated" else "RSS"
    return f"peak memory: {peak / 2**30:.2f} GiB {what} per process (phase {phase}; RUN_DIR/memory.json has each phase)"


def _num(*values) -> bool:
    return all(isinstance(v, (int, float)) for v in values)


def summary(run_dir: Path, result: dict, wall_s: float) -> list[str]:
    records = read_records(run_dir)
    losses = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    rates = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), (int, float))]
    train_s = max((r.get("time", 0) for r in records), default=0)
    head = (f"stopped at step {result.get('step')}: re-run the same command to resume" if result.get("stopped")
            else f"finished: {result.get('step')} steps")
    lines = [f"{head}; {wall_s:.1f} s wall for this command, {train_s:.1f} s of training in all"
             + (f", {sum(rates) / len(rates):.0f} tokens/s" if rates else "")]
    if losses:
        (s0, l0), (s1, l1) = losses[0], losses[-1]
        lines.append(f"loss: {l0:.4g} at step {s0} -> {l1:.4g} at step {s1}")
    host = [(r["host_s_per_step"], r["s_per_step"]) for r in records if _num(r.get("host_s_per_step"), r.get("s_per_step"))]
    if host:  # on a GPU, host time near the wall time means the device waits on the host
        h, w = (sum(x) / len(host) for x in zip(*host))
        lines.append(f"host time: {1000 * h:.1f} ms of {1000 * w:.1f} ms a step on the training thread (Python, "
                     "launches, optimizer bookkeeping)")
    evals = {k: v for r in records for k, v in r.items() if k.startswith("eval_")}
    if evals:
        lines.append("held out: " + ", ".join(f"{k} {v:.4g}" for k, v in evals.items())
                     + " (the base model's figures: `finetune eval RUN_DIR`)")
    mem = peak_memory(run_dir)
    lines += [mem] if mem else []
    if (run_dir / "report.html").exists():
        lines.append(f"report: {run_dir / 'report.html'} (loss and learning-rate curves, memory per phase)")
    if result.get("stopped"):
        return lines
    adapter = run_dir / "adapter"
    lines += [f"adapter: {adapter}", "next:",
              f"  finetune eval {run_dir}              held-out loss and exact match, adapter against base",
              f"  finetune generate {run_dir} --prompt \"...\"",
              f"  finetune merge {run_dir}                  the adapter folded into the base (RUN_DIR/merged)",
              f"  finetune export {run_dir}                 GGUF for llama.cpp / Ollama"]
    return lines
