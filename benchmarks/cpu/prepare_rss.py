"""Peak RSS of `finetune data` (the data preparation every training run does) as the row count grows.

N tiny alpaca-like rows (an instruction and an output of a few words, seeded and varied) are written to a
JSONL file, with a recipe based on recipes/tiny_cpu.yaml that trains on them (1% held out). A fresh
interpreter runs `finetune data RECIPE` on a cold cache (an empty FINETUNE_CACHE) and reports its own peak
RSS (VmHWM), then once more on the warm cache (what the other ranks of a node and a second run see).

    python -m benchmarks.cpu.prepare_rss --rows 200000     # prints one JSON line; run() returns the figures
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("apple river stone cloud green quick seven north paper light music table window garden silver "
         "orange winter summer yellow bridge forest castle dragon pencil rocket planet ocean mirror").split()
VERBS = ("reverse", "sort", "repeat", "name the first of", "name the last of", "count", "shorten", "copy")


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    """n rows, streamed to disk (the parent stays small: its RSS is not the one measured)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = rng.choices(WORDS, k=rng.randint(2, 6))
            out = rng.choices(WORDS, k=rng.randint(1, 6))
            f.write(json.dumps({"instruction": f"{rng.choice(VERBS)}: {' '.join(words)}",
                                "output": " ".join(out)}) + "\n")


def write_recipe(path: Path, data: Path) -> None:
    path.write_text(f"""model:
  name: builtin:tiny-llama
quantization:
  mode: nf4
lora:
  r: 16
  alpha: 32
data:
  sources:
    - path: {data}
  eval_split: 0.01
  max_seq_len: 64
train:
  micro_batch_size: 16
  max_steps: 800
output:
  dir: {path.parent / "run"}
""")


def _child(recipe: str) -> None:
    """Runs in a fresh interpreter: `finetune data RECIPE` in-process, then its own peak RSS."""
    import contextlib
    import io

    from benchmarks.cpu.merge_rss import peak_rss
    from finetune.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["data", recipe, "--json"])
    if rc != 0:
        sys.exit(f"finetune data exited {rc}:\n{out.getvalue()[-2000:]}")
    stats = json.loads(out.getvalue().strip().splitlines()[-1])
    print(json.dumps({"peak_rss": peak_rss(), "rows": stats["rows"], "eval_rows": stats["eval_rows"]}))


def _measure(recipe: Path, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "FINETUNE_CACHE": str(cache),
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cpu.prepare_rss", "--child", str(recipe)],
                          capture_output=True, text=True, env=env, cwd=root, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"finetune data failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "seconds": round(time.time() - t0, 1)}


def run(rows: int = 200_000) -> dict:
    with tempfile.TemporaryDirectory(prefix="prepare-rss-") as tmp:
        tmp = Path(tmp)
        write_rows(tmp / "rows.jsonl", rows)
        write_recipe(tmp / "recipe.yaml", tmp / "rows.jsonl")
        cold = _measure(tmp / "recipe.yaml", tmp / "cache")
        warm = _measure(tmp / "recipe.yaml", tmp / "cache")
    gib = 1 << 30
    return {"rows_written": rows, "rows": cold["rows"], "eval_rows": cold["eval_rows"],
            "peak_rss_gib": round(cold["peak_rss"] / gib, 3), "cold_seconds": cold["seconds"],
            "warm_peak_rss_gib": round(warm["peak_rss"] / gib, 3), "warm_seconds": warm["seconds"]}


def table(res: dict) -> str:
    return "\n".join(["| rows | peak RSS, cold cache | wall | peak RSS, warm cache | wall |", "|---|---|---|---|---|",
                      f"| {res['rows_written']:,} | {res['peak_rss_gib']:.3f} GiB | {res['cold_seconds']} s | "
                      f"{res['warm_peak_rss_gib']:.3f} GiB | {res['warm_seconds']} s |"])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu.prepare_rss", description=__doc__.splitlines()[0])
        ap.add_argument("--rows", type=int, default=200_000, help="rows to prepare (default 200000)")
        res = run(ap.parse_args().rows)
        print(table(res))
        print(json.dumps(res))
