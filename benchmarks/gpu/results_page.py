"""benchmarks/RESULTS_GPU.md, generated from the GPU proof runs kept beside it (RESULTS_GPU*.json).

    python -m benchmarks.gpu.results_page [--check]

The page opens with what a reader comes for: the newest 8B step per card, then the newest figure of every stage
(card, commit, date, measured beside planned, the command that reproduces it), then every run stage by stage.
How each session went, and what it fixed, is prose: benchmarks/journal/, linked at the end.
To add a run: put the proof's results.json beside the others as RESULTS_GPU_<CARD>.json (each stage carries its
device, date and commit: gpu/proof.py writes them), add it to SOURCES, rerun this module and commit both.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.gpu.proof import STAGES
from benchmarks.gpu.report import _section, kv

HERE = Path(__file__).resolve().parents[1]
PAGE = HERE / "RESULTS_GPU.md"
SOURCES = ("RESULTS_GPU.json", "RESULTS_GPU_H100.json")
CAPS = {name: cap for name, _, _, _, cap in STAGES}
# stages whose result holds several training runs, each a row of its own in the current state
SUB_RUNS = ("adapters", "preference")


def load_runs(sources=SOURCES, where: Path = HERE) -> list[dict]:
    """Every stage of every kept proof run, newest first. A `NAME_first_run` entry is an earlier run of NAME
    that a later one superseded: kept for the record, never the current figure."""
    runs = []
    for src in sources:
        data = json.loads((where / src).read_text())
        for name, st in data["stages"].items():
            stage = name.removesuffix("_first_run")
            runs.append({**st, "stage": stage, "superseded": stage != name, "source": src,
                         "card": (st.get("device") or "unknown card").removeprefix("NVIDIA "),
                         "plan_note": data.get("plan_note")})
    return sorted(runs, key=lambda r: r.get("date") or "", reverse=True)


# single's MFU divides by the ceilings the env stage measures in the same out dir
NEEDS = {"single": ("env",)}


def reproduce(stage: str) -> str:
    stages = [*NEEDS.get(stage, ()), stage]
    deadline = sum(CAPS.get(s, 300) for s in stages)
    return f"`python -m benchmarks.gpu_proof --out-dir OUT --stages {','.join(stages)} --deadline {deadline}`"


def _gib_pair(mem: dict) -> str:
    steps = mem["phases"]["steps"]
    return f"{steps['peak_allocated_gib']:.2f} / {steps['peak_reserved_gib']:.2f} GiB"


def _training(r: dict) -> tuple[str, str, str]:
    """measured, planned, error of one training run (single, load70b, moe, a method's run, an FSDP stage)."""
    train = r.get("train", r)
    measured = (f"{train['trained_tokens_per_s']:,.0f} tokens/s" + (f", {r['s_per_step']} s/step" if "s_per_step" in r
                                                                    else "") + f"; steps {_gib_pair(train['memory'])}")
    p, e = r.get("plan"), r.get("errors_pct") or {}
    planned = f"{p['allocated_gib']:.2f} / {p['reserved_gib']:.2f} GiB" if p else "-"
    error = (f"{e['steps_allocated']:+.1f}% / {e['steps_reserved']:+.1f}%" if "steps_allocated" in e else "-")
    return measured, planned, error


def figures(stage: str, r: dict) -> tuple[str, str, str]:
    """The current-state cells of one stage's result: measured, planned, error (planned beside measured)."""
    if "trained_tokens_per_s" in r.get("train", r):
        return _training(r)
    if stage == "env":
        return (f"bf16 matmul {r.get('matmul_bf16_tflops')} TFLOP/s, copy {kv(r.get('copy_gb_s'))} GB/s; torch "
                f"{r.get('torch')}, bitsandbytes {r.get('bitsandbytes')}", "-", "-")
    if stage == "models":
        return ", ".join(f"{k} {v['gib']} GiB" for k, v in r.items()), "-", "-"
    if stage == "trl":
        t, ratio = r["trl"], r.get("finetune_over_trl") or {}
        return (f"TRL {t['tokens_per_s']:,.0f} tokens/s, {t['peak_allocated_gib']:.2f} GiB allocated; finetune / TRL "
                f"{ratio.get('tokens_per_s')}x tokens/s, {ratio.get('peak_allocated')}x allocated", "-", "-")
    if stage == "speed":  # each arm's trained tokens/s (or why it was skipped), TRL's beside them
        arms = {n: a["trained_tokens_per_s"] if a["status"] == "ok" else "skipped" for n, a in r["arms"].items()}
        return f"tokens/s: {kv(arms)}; TRL {r['trl']['tokens_per_s']:,.0f}", "-", "-"
    if stage == "fp16":
        return (f"losses finite {r['losses_finite']}, skipped steps {kv(r['skipped_steps'])}, stopped at "
                f"{kv(r['checkpoints'])}", "-", "-")
    if stage == "fsdp2_trace" and isinstance(r.get("trace"), dict):
        return f"traced peak {r['trace']['peak_bytes_traced'] / 2**30:.2f} GiB; steps {_gib_pair(r['memory'])}", "-", "-"
    if stage == "syncs":
        waits = {k.removeprefix("syncs_"): v.get("steady_syncs_per_step") for k, v in r.items() if isinstance(v, dict)}
        return "host waits per optimizer step (steady): " + kv(waits), "-", "-"
    return kv(r), "-", "-"


def current_rows(runs: list[dict]) -> list[str]:
    """One row per stage (a row per training run for the stages that hold several): its newest run."""
    rows = ["| stage | card | commit | date | measured | planned | measured vs plan | reproduce |",
            "|---|---|---|---|---|---|---|---|"]
    for stage in CAPS:
        newest = next((r for r in runs if r["stage"] == stage and not r["superseded"] and r["status"] == "ok"), None)
        if newest is None:
            rows.append(f"| {stage} | - | - | - | not run on a GPU yet | | | {reproduce(stage)} |")
            continue
        res = newest["result"]
        parts = ([(k, v) for k, v in res.items() if isinstance(v, dict) and "memory" in v] if stage in SUB_RUNS
                 else [(stage, res)])
        for label, r in parts:
            measured, planned, error = figures(stage, r)
            rows.append(f"| {label} | {newest['card']} | `{newest['commit']}` | {newest['date']} | {measured} | "
                        f"{planned} | {error} | {reproduce(stage)} |")
    return rows


def headline(runs: list[dict]) -> list[str]:
    """The newest 8B step on each card: rate, time per step, the step's peak memory beside the plan."""
    out, seen = [], set()
    for r in runs:
        if r["stage"] != "single" or r["superseded"] or r["status"] != "ok" or r["card"] in seen:
            continue
        seen.add(r["card"])
        s = r["result"]
        steps, p = s["memory"]["phases"]["steps"], s["plan"]
        out.append(f"- **{r['card']}** (commit `{r['commit']}`, {r['date']}): **{s['trained_tokens_per_s']:,.0f} "
                   f"tokens/s**, **{s['s_per_step']} s per step**; the step peaks at **{steps['peak_allocated_gib']:.2f} "
                   f"GiB allocated** (plan {p['allocated_gib']:.2f}) and {steps['peak_reserved_gib']:.2f} GiB reserved "
                   f"(plan {p['reserved_gib']:.2f}); MFU {100 * s['mfu_vs_datasheet']:.1f}% of the datasheet peak.")
    return out


def detail(runs: list[dict]) -> list[str]:
    """Every run, stage by stage, newest first; each stage's heading once."""
    out = []
    for stage in CAPS:
        mine = [r for r in runs if r["stage"] == stage]
        if not mine:
            continue
        out += [f"### {stage}", "", mine[0]["what"].removeprefix("(").split(";")[0].rstrip(")"), ""]
        for r in mine:
            note = " (an earlier run: " + r["what"].strip("()") + ")" if r["superseded"] else ""
            out += [f"**{r['card']}**, {r['date']}, commit `{r['commit']}`{note}:", ""]
            if r["status"] != "ok":
                out += [f"{r['status']}: {r.get('why') or r.get('tail', '')}", ""]
                continue
            # a run's own sub-headings (adapters_lora, pref_dpo) repeat from run to run: labels, not headings
            out += [f"*{line[4:]}*" if line.startswith("### ") else line for line in _section(stage, r["result"], {})]
            out.append("")
    return out


def page(runs: list[dict] | None = None, journal: Path = HERE / "journal") -> str:
    runs = load_runs() if runs is None else runs
    notes = sorted({f"{r['source']}: {r['plan_note']}" for r in runs if r.get("plan_note")})
    entries = sorted(journal.glob("*.md"), reverse=True) if journal.is_dir() else []
    lines = ["# GPU results", "",
             "Generated by `python -m benchmarks.gpu.results_page` from the GPU proof runs kept beside this page "
             f"({', '.join(SOURCES)}); do not edit by hand. The runs use synthetic models with the real widths, so "
             "no download is needed; one stage takes one to five minutes of GPU time.", "",
             "## The 8B recipe, one GPU, micro-batch 2 x 2048 (newest per card)", "",
             *headline(runs), "",
             f"Reproduce on a GPU machine: {reproduce('single')} (docs/gpu_paths.md, \"Running the GPU proof\", "
             "has the whole call and the image it ran in).", "",
             "## Current state: the newest figure of every stage", "",
             "Memory is the training steps' peak, allocated / reserved by torch on the GPU; planned is `finetune "
             "estimate` for the same recipe at the run's commit.", "",
             *current_rows(runs), "",
             *[f"- {n}" for n in notes], "",
             "## Stage by stage", "", *detail(runs),
             "## Journal", "",
             "How each session went, what failed and what was fixed, newest first:", "",
             *[f"- [{e.stem}](journal/{e.name})" for e in entries]]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.results_page", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if benchmarks/RESULTS_GPU.md is not what the "
                    "kept runs generate (nothing is written)")
    a = ap.parse_args(argv)
    text = page()
    if a.check:
        same = PAGE.exists() and PAGE.read_text() == text
        print("benchmarks/RESULTS_GPU.md is " + ("up to date" if same else "stale: run python -m "
                                                  "benchmarks.gpu.results_page"))
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
