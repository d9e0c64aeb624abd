"""Peak RSS per phase of a whole run on CPU: one process against 2 FSDP processes (FSDP2 and FSDP1) over gloo.

The setting: a synthetic bf16 Llama of 2 GB (16 layers, hidden 2048), the shipped CPU recipes
(`recipes/tiny_cpu.yaml` for one process; `recipes/tiny_cpu_fsdp.yaml` under `accelerate launch --config_file
configs/cpu_fsdp.yaml` for two), 2 steps at micro-batch 2 and the end-of-run eval. Every run writes
RUN_DIR/memory.json (finetune.train.keepers.memory): per rank, the RSS when the run began (after imports) and
each phase's peak RSS. A phase's growth is its peak less that start.

Figures: per phase, the growth of the one process and of the larger FSDP rank; over the whole run, the one
process's growth less the larger rank's, as a multiple of the model's packed 4-bit bytes (the goal:
at least 0.4; each rank should hold half of the packed weights in every phase); and the planner's CPU
figure per process beside each measured phase (memory.json's `plan`).

    python -m benchmarks.cpu.phase_rss [--layers 16]       # prints a table and one JSON line
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
from pathlib import Path

import yaml

from benchmarks.common import ROOT, child_env

GIB = 2**30
MODEL = ("synthetic:meta-llama/Llama-3.2-1B?layers={layers}&hidden=2048&intermediate=8192&heads=32&kv_heads=8"
         "&vocab=128256")


def recipe(base: str, model: str, out: Path, eval_batches: int = 2) -> dict:
    rec = yaml.safe_load((ROOT / "recipes" / base).read_text())
    rec["model"]["name"] = model
    rec["train"].update({"max_steps": 2, "micro_batch_size": 2, "warmup_steps": 1, "log_every": 1,
                         "save_every": None, "eval_every": None})
    rec.setdefault("eval", {})["max_batches"] = eval_batches
    rec["output"] = {"dir": str(out), "progress_bar": False}
    return rec


def run_one(name: str, rec: dict, work: Path, launch: list[str], threads: int | None = None) -> dict:
    p = start(name, rec, work, launch, threads)
    try:
        return finish(name, rec, p)
    finally:
        stop(p)


def start(name: str, rec: dict, work: Path, launch: list[str], threads: int | None = None) -> subprocess.Popen:
    """The run launched, its output to work/NAME.log; in a session of its own, so a failed sibling's cleanup
    takes its launcher's processes too."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    with (work / f"{name}.log").open("w") as log:
        return subprocess.Popen([*launch, str(path)], cwd=ROOT, env=child_env(threads), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish(name: str, rec: dict, p: subprocess.Popen) -> dict:
    try:
        code = p.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        stop(p)
        raise RuntimeError(f"{name} did not end within an hour") from None
    if code != 0:
        out = (Path(p.args[-1]).with_suffix(".log")).read_text()
        raise RuntimeError(f"{name} failed (exit {code}):\n{out[-3000:]}")
    mem = json.loads((Path(rec["output"]["dir"]) / "memory.json").read_text())
    growth, peak = {}, {}
    for rank in mem["ranks"]:
        for phase, v in rank["phases"].items():
            growth.setdefault(phase, []).append(round((v["peak_rss"] - rank["start_rss"]) / GIB, 3))
            peak.setdefault(phase, []).append(round(v["peak_rss"] / GIB, 3))
    return {"growth_gib": growth, "peak_gib": peak, "start_gib": [round(r["start_rss"] / GIB, 3) for r in mem["ranks"]],
            "plan_gib": {k: round(v / GIB, 3) for k, v in (mem.get("plan") or {}).items()}}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def plan_errors(res: dict) -> dict:
    """Per run and planned phase: (planned - measured) / measured, measured the largest rank's peak RSS. The
    plan's load covers the whole streaming load, which under FSDP ends in the shard fill (memory.LOAD_PHASES)."""
    from finetune.train.keepers.memory import LOAD_PHASES

    out = {}
    for name in res["runs"]:
        peak, plan = res[name]["peak_gib"], res[name]["plan_gib"]
        for phase, planned in plan.items():
            measured = max(max(peak[p]) for p in ({"load": LOAD_PHASES}.get(phase, (phase,))) if p in peak)
            out[f"{name} {phase}"] = round((planned - measured) / measured, 3)
    return out


def packed_bytes(model: str) -> int:
    from finetune.plan.archs import resolve
    from finetune.plan.estimate import Setup, weight_terms

    arch, _ = resolve(model)
    w = weight_terms(arch, Setup(model=model, quant_storage="uint8", model_dtype="bfloat16"))
    return w["base_4bit"]


def run(layers: int = 16, only: list[str] | None = None, model: str | None = None, threads: int | None = None,
        together: bool = False, eval_batches: int = 2) -> dict:
    """`threads`: OMP_NUM_THREADS of every run (default: torch's own for the one process; accelerate gives each
    of 2 FSDP processes one thread on 2 cores). `together`: the runs side by side, not one after another."""
    model = model or MODEL.format(layers=layers)
    from finetune.weights.built.synthetic import synthetic_dir

    if model.startswith("synthetic:"):
        synthetic_dir(model)  # built once, before any run measures itself
    work = Path(tempfile.mkdtemp(prefix="phase_rss-"))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "configs" / "cpu_fsdp.yaml")]
    v1 = work / "cpu_fsdp1.yaml"  # the launcher must agree with the recipe's fsdp.version
    v1.write_text((ROOT / "configs" / "cpu_fsdp.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    accelerate1 = [*accelerate[:-1], str(v1)]
    runs = {"single": ("tiny_cpu.yaml", {}, [sys.executable, "-m", "finetune"]),
            "fsdp2": ("tiny_cpu_fsdp.yaml", {"fsdp": {"version": 2}}, [*accelerate, "-m", "finetune"]),
            "fsdp1": ("tiny_cpu_fsdp.yaml", {"fsdp": {"version": 1}}, [*accelerate1, "-m", "finetune"])}
    chosen = only or list(runs)
    res = {"model": model, "packed_4bit_gib": round(packed_bytes(model) / GIB, 3), "runs": chosen}
    try:
        _runs(res, chosen, runs, model, work, threads, together, eval_batches)
    finally:  # the run dirs (adapters, checkpoints: 0.3 GB on the 2 GB model) are not needed once measured
        shutil.rmtree(work, ignore_errors=True)
    whole = {n: max(max(g) for g in res[n]["growth_gib"].values()) for n in chosen}
    if "single" in whole:
        for n in ("fsdp2", "fsdp1"):
            if n in whole:
                res[f"{n}_saving_over_packed"] = round((whole["single"] - whole[n]) / res["packed_4bit_gib"], 3)
    res["whole_run_growth_gib"] = whole
    res["plan_error"] = plan_errors(res)
    return res


def _runs(res: dict, chosen: list[str], runs: dict, model: str, work: Path, threads: int | None, together: bool,
          eval_batches: int) -> None:
    recs = {}
    for name in chosen:
        base, sections, launch = runs[name]
        rec = recipe(base, model, work / name, eval_batches)
        for k, v in sections.items():
            rec.setdefault(k, {}).update(v)
        recs[name] = rec
    if not together:
        for name in chosen:
            res[name] = run_one(name, recs[name], work, runs[name][2], threads)
        return
    # RSS is each process's own, so the runs may share the machine: under FSDP one rank quantizes while the
    # other waits, and the one process's load fills that core. Each launcher gets a port of its own.
    procs = {}
    try:
        for name in chosen:
            launch = runs[name][2]
            if "--config_file" in launch:  # accelerate's: its static rendezvous would take port 29500 for both
                at = launch.index("--config_file") + 2
                launch = [*launch[:at], "--main_process_port", str(free_port()), *launch[at:]]
            procs[name] = start(name, recs[name], work, launch, threads)
        for name in chosen:
            res[name] = finish(name, recs[name], procs[name])
    finally:
        for p in procs.values():
            stop(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu.phase_rss")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--only", help="comma-separated subset of single,fsdp2,fsdp1")
    ap.add_argument("--model", help="another model (default: the 2 GB synthetic Llama of --layers layers)")
    a = ap.parse_args(argv)
    res = run(a.layers, a.only.split(",") if a.only else None, a.model)
    print(table(res))
    print(json.dumps(res))
    return 0


def table(res: dict) -> str:
    from finetune.train.keepers.memory import PHASES

    chosen = res["runs"]
    phases = [p for p in PHASES
              if any(p in res[n]["growth_gib"] for n in chosen)]
    lines = ["| phase | " + " | ".join(f"{n} growth (max rank) | {n} plan" for n in chosen) + " |",
             "|---" * (1 + 2 * len(chosen)) + "|"]
    for ph in phases:
        cells = []
        for n in chosen:
            g = res[n]["growth_gib"].get(ph)
            cells += [f"{max(g):.2f}" if g else "-", f"{res[n]['plan_gib'].get(ph, float('nan')):.2f}"]
        lines.append(f"| {ph} | " + " | ".join(cells) + " |")
    whole = res["whole_run_growth_gib"]
    lines += ["", "Whole run, largest rank: " + ", ".join(f"{n} {whole[n]:.2f} GiB" for n in chosen)
              + f"; packed 4-bit weights {res['packed_4bit_gib']:.3f} GiB"]
    if res.get("plan_error"):  # results recorded before the plan covered CPU runs have none
        lines.append("- planned CPU RAM against the largest rank's peak: " + ", ".join(
            f"{k} {100 * v:+.0f}%" for k, v in res["plan_error"].items()))
    for n in ("fsdp2", "fsdp1"):
        if f"{n}_saving_over_packed" in res:
            lines.append(f"- {n}: one process's growth less the larger rank's = **{res[f'{n}_saving_over_packed']:.2f}x** "
                         "the packed bytes (goal >= 0.4)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
