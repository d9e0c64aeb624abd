"""Preference tuning on CPU, end to end: does DPO (and ORPO) teach the tiny model to prefer the right answer?

1. SFT: the embedded default (recipes/tiny_cpu.yaml), or an existing run dir given with --sft.
2. DPO from that SFT adapter (recipes/tiny_cpu_dpo.yaml, `lora.init_adapter` = the SFT run's adapter; the
   reference policy is the SFT adapter).
3. ORPO from the base (recipes/tiny_cpu_orpo.yaml).
4. `finetune eval --json` of each on the 200 held-out pairs of builtin:tiny-preference (prompts no training row
   has): preference accuracy (pairs whose chosen answer gets the higher summed log-prob), the mean log-prob
   margin, and greedy exact match of the chosen answer on 50 prompts; DPO's starting policy is its start_*
   figures, ORPO's its base_* figures.

Goals: DPO raises held-out preference accuracy from the SFT adapter's to at least 0.9 and does not lower
exact match; ORPO raises it from the base's to at least 0.9.

    python -m benchmarks.cpu.preference [--out DIR] [--sft RUN_DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOAL = 0.9


def cli(args: list[str]) -> str:
    t0 = time.perf_counter()
    # One torch thread per run unless told otherwise: on a small shared machine torch's default (a thread per
    # core) slowed these runs about tenfold whenever another process was busy (measured on 2 cores).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "finetune", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"finetune {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    print(f"  finetune {' '.join(args[:2])} ... {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return p.stdout


def evaluate(run_dir: Path) -> dict:
    return json.loads(cli(["eval", str(run_dir), "--json"]).strip().splitlines()[-1])


def train(recipe: str, out: Path, *overrides: str) -> Path:
    cli([f"recipes/{recipe}", f"output.dir={out}", "output.progress_bar=false", *overrides])
    return out


def run(out: Path, sft: Path | None = None) -> dict:
    sft = sft or train("tiny_cpu.yaml", out / "sft")
    dpo = train("tiny_cpu_dpo.yaml", out / "dpo", f"lora.init_adapter={sft / 'adapter'}")
    orpo = train("tiny_cpu_orpo.yaml", out / "orpo")
    d, o = evaluate(dpo), evaluate(orpo)
    res = {
        "dpo": {"start_accuracy": d["start_preference_accuracy"], "accuracy": d["preference_accuracy"],
                "start_margin": d["start_preference_margin"], "margin": d["preference_margin"],
                "start_exact_match": d["start_exact_match"], "exact_match": d["exact_match"]},
        "orpo": {"base_accuracy": o["base_preference_accuracy"], "accuracy": o["preference_accuracy"],
                 "base_margin": o["base_preference_margin"], "margin": o["preference_margin"],
                 "base_exact_match": o["base_exact_match"], "exact_match": o["exact_match"]},
    }
    r = res["dpo"]
    res["goals"] = {"dpo_accuracy": r["accuracy"] >= GOAL and r["accuracy"] > r["start_accuracy"],
                    "dpo_exact_match_kept": r["exact_match"] >= r["start_exact_match"],
                    "orpo_accuracy": res["orpo"]["accuracy"] >= GOAL > res["orpo"]["base_accuracy"]}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu.preference", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_preference")
    ap.add_argument("--sft", type=Path, help="an existing SFT run dir of recipes/tiny_cpu.yaml (skips step 1)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    a = ap.parse_args(argv)
    res = run(a.out, a.sft)
    for method in ("dpo", "orpo"):
        print(f"{method}: " + ", ".join(f"{k} {v:.3f}" for k, v in res[method].items()))
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in res["goals"].items()))
    if a.json:
        print(json.dumps(res))
    return 0 if all(res["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
