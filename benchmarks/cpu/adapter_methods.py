"""The adapter methods side by side on the embedded default: plain LoRA, rsLoRA, LoRA+ and DoRA (QDoRA on
the 4-bit base), each trained by the real command on the same recipe, data and seed.

Per method: the held-out loss and exact match (`finetune eval RUN --json`, so the same scorer as every
run), trained tokens per second over the logged steps after the first (the loop's own `tokens_per_s`),
the wall time of the training command, and the peak RSS of the steps phase with its growth over the
loaded model (RUN_DIR/memory.json, largest rank). Every run is a fresh process: nothing is shared but
the data cache.

    python -m benchmarks.cpu.adapter_methods                    # 800 steps each, one process: the docs table
    python -m benchmarks.cpu.adapter_methods --steps 150 --fsdp # 2-process FSDP2 (recipes/tiny_cpu_fsdp.yaml)
    python -m benchmarks.cpu.adapter_methods --json             # the last stdout line is the rows as JSON

docs/adapter_methods.md holds the table this printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

# method -> recipe overrides. LoRA+'s ratio is 4, not the paper's 16: with the recipe's learning rate
# (2e-3, already high for this tiny model) B at 16x diverges.
METHODS = {
    "lora": [],
    "rslora": ["lora.use_rslora=true"],
    "loraplus": ["lora.loraplus_lr_ratio=4"],
    "dora": ["lora.use_dora=true"],
}


def _command(fsdp: bool) -> list[str]:
    if fsdp:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(common.ROOT / "configs" / "cpu_fsdp.yaml"), "--main_process_port", "0", "-m", "finetune",
                str(common.ROOT / "recipes" / "tiny_cpu_fsdp.yaml")]
    return [sys.executable, "-m", "finetune", str(common.ROOT / "recipes" / "tiny_cpu.yaml")]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(common.ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def train_one(name: str, run_dir: Path, steps: int | None, fsdp: bool) -> dict:
    """Train one method with the real command; its figures from the run dir and `finetune eval`."""
    # --steps keeps a tenth of them as warmup (tiny_cpu.yaml's own 20 at 200 steps), so short runs validate
    shorter = [f"train.max_steps={steps}", f"train.warmup_steps={max(1, steps // 10)}"] if steps else []
    overrides = METHODS[name] + [f"output.dir={run_dir}"] + shorter
    t0 = time.perf_counter()
    done = subprocess.run(_command(fsdp) + overrides, env=_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name}: training failed:\n{done.stderr[-3000:]}")
    scored = subprocess.run([sys.executable, "-m", "finetune", "eval", str(run_dir), "--json"], env=_env(),
                            capture_output=True, text=True, check=True)
    score = common.last_json_line(scored.stdout)
    records = common.read_jsonl(run_dir / "metrics.jsonl")
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 1]
    memory = json.loads((run_dir / "memory.json").read_text())
    steps_peak = max(rank["phases"]["steps"]["peak_rss"] for rank in memory["ranks"])
    loaded = max(rank["phases"]["forward"]["rss_after"] for rank in memory["ranks"])  # loaded, before the steps
    return {"method": name, "eval_loss": round(score["eval_loss"], 4), "exact_match": score["exact_match"],
            "tokens_per_s": round(sum(rates) / max(len(rates), 1), 1), "train_seconds": round(seconds, 1),
            "peak_rss_mib": round(steps_peak / 2**20, 1), "steps_growth_mib": round((steps_peak - loaded) / 2**20, 1),
            "load_average": common.load_average()}  # the machine's 1-minute load: others' work skews tokens/s


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each loss also relative to plain LoRA's."""
    base = next((r["eval_loss"] for r in rows if r["method"] == "lora"), None)
    lines = ["| method | eval loss | vs LoRA | exact match | tokens/s | train time (s) | peak RSS, steps (MiB) "
             "| growth over the loaded model (MiB) | load avg |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{100 * (r['eval_loss'] / base - 1):+.1f}%" if base else "-"
        lines.append(f"| {r['method']} | {r['eval_loss']:.4f} | {rel} | {r['exact_match']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['train_seconds']:.0f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['steps_growth_mib']:.0f} | {r['load_average']} |")
    return "\n".join(lines)


def run(steps: int | None = None, fsdp: bool = False, methods=None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="adapter_methods-") as tmp:
        for name in methods or METHODS:
            rows.append(train_one(name, Path(tmp) / name, steps, fsdp))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu.adapter_methods", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="train.max_steps for every method (default: the recipe's)")
    ap.add_argument("--fsdp", action="store_true", help="2-process FSDP2 with recipes/tiny_cpu_fsdp.yaml")
    ap.add_argument("--methods", help=f"comma-separated subset of: {', '.join(METHODS)}")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line last")
    a = ap.parse_args(argv)
    rows = run(a.steps, a.fsdp, a.methods.split(",") if a.methods else None)
    print(f"{'2-process FSDP2' if a.fsdp else 'one process'}, {a.steps or 'recipe'} steps, "
          f"{common.machine()['cpu']}, load {common.load_average()}, {common.now()}")
    print(table(rows))
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
