"""What the GPU proof's stages share: the shapes (real on a GPU, tiny for the dry run), the recipe they train,
running finetune's own commands as a user runs them, and reading a run's rate, memory and plan back.

stages.py and methods.py both import this module; neither imports the other's helpers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, child_env, last_json_line, read_jsonl, steady_rate
from benchmarks.gpu.warm import ENV as WARM_ENV

GIB = 2**30


def shapes(dry: bool) -> dict:
    """Model names, sequence length and step counts: the real ones on a GPU, tiny ones for the dry run."""
    if dry:
        # a small vocabulary too: on 2 CPU cores the 128k-row head would take most of the dry run's time
        small = "layers=2&hidden=256&intermediate=512&heads=4&kv_heads=2&vocab=2048"
        return {"m8": f"synthetic:meta-llama/Llama-3.1-8B-Instruct?{small}",
                "m8_short": f"synthetic:meta-llama/Llama-3.1-8B-Instruct?{small}&seed=1",
                "m70": "synthetic:meta-llama/Llama-3.1-70B-Instruct?layers=2&hidden=512&intermediate=1024&heads=8"
                       "&kv_heads=2&vocab=2048",
                "seq": 64, "warmup": 2, "steps": 4, "device": "cpu",
                # the preference stage's pairs, training and held out: its reference pass reads each once before
                # the first step (all 4000 + 200 took most of the dry run); 64 cover its 6 steps of 8 pairs
                "pref_pairs": {"train": 64, "eval": 8}}
    return {"m8": "synthetic:meta-llama/Llama-3.1-8B-Instruct?device=cuda",
            # FSDP and fp16 runs need the path, not the depth: the 8B's widths and vocabulary, 4 layers
            "m8_short": "synthetic:meta-llama/Llama-3.1-8B-Instruct?layers=4&device=cuda",
            "m70": "synthetic:meta-llama/Llama-3.1-70B-Instruct?layers=2&device=cuda",
            "seq": 2048, "warmup": 4, "steps": 8, "device": "cuda", "pref_pairs": {}}


def recipe(model: str, seq: int, steps: int, out: Path, held_out: bool = True, **sections) -> dict:
    """The 8B recipe's settings (recipes/llama3_8b_qlora.yaml) on synthetic tokens of exactly `seq` ids;
    without `held_out`, no eval rows at all (a run whose phases are load, wrap, steps, save, export)."""
    import yaml

    rec = yaml.safe_load((ROOT / "recipes" / "llama3_8b_qlora.yaml").read_text())
    rec["model"]["name"] = model
    # The stages measure what their kept runs measured: every layer checkpointed (the recipe's `auto` would
    # pick by the card's memory; a stage that wants it says so in `sections`).
    rec["model"]["gradient_checkpointing"] = True
    rows = 2 * steps + 8
    rec["data"] = {"sources": [{"path": f"synthetic:tokens?rows={rows}&min_len={seq}&max_len={seq}"}],
                   "eval_sources": [{"path": f"synthetic:tokens?rows=4&min_len={seq}&max_len={seq}",
                                     "split": "eval"}] if held_out else [],
                   "max_seq_len": seq}
    if not held_out:
        rec["data"]["eval_split"] = 0
    rec["train"].update({"gradient_accumulation_steps": 1, "max_steps": steps, "warmup_steps": 1,
                         "log_every": 1, "save_every": None, "eval_every": None, "epochs": 1})
    rec["output"] = {"dir": str(out), "progress_bar": False}
    for key, value in sections.items():
        rec.setdefault(key, {}).update(value)
    return rec


def write_recipe(rec: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


def sh(cmd: list[str], timeout: float = 900, log: Path | None = None, env_extra: dict | None = None
       ) -> subprocess.CompletedProcess:
    """Run a command of finetune's from the checkout; its output goes to `log` (appended) too."""
    env = {**child_env(), **(env_extra or {})}
    env.pop("PYTHONWARNINGS", None)  # the proof wants to see what a user sees
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}  ({time.perf_counter() - t0:.1f} s, exit {p.returncode})\n")
            f.write(p.stdout[-20000:] + p.stderr[-20000:] + "\n")
    return p


def must(p: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{tail}")
    return p


def python_m(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS`; in the dry run, through its warm process (benchmarks/gpu/warm.py), which has
    imported the libraries once, when the proof started one."""
    if os.environ.get(WARM_ENV):
        return [sys.executable, "-m", "benchmarks.gpu.warm", "-m", module, *args]
    return [sys.executable, "-m", module, *args]


def finetune(*args: str) -> list[str]:
    return python_m("finetune", *args)


def torchrun(*args: str, module: str = "finetune") -> list[str]:
    # --standalone: a free port of its own, so stages (or two proofs on one machine) never collide
    return python_m("torch.distributed.run", "--standalone", "--nproc_per_node", "1", *python_m(module, *args)[1:])


def estimate(rec_path: Path, log: Path) -> dict:
    p = must(sh(finetune("estimate", str(rec_path), "--json"), log=log), "finetune estimate")
    return last_json_line(p.stdout)


def phase_peaks(run_dir: Path) -> dict:
    """memory.json's figures per phase, the largest rank's, in GiB."""
    mem = json.loads((run_dir / "memory.json").read_text())
    out = {}
    for rank in mem["ranks"]:
        for name, ph in rank["phases"].items():
            keys = ("peak_allocated", "peak_reserved") if mem["kind"] == "cuda" else ("peak_rss",)
            cur = out.setdefault(name, {})
            for k in keys:
                cur[k + "_gib"] = max(cur.get(k + "_gib", 0.0), (ph.get(k) or 0) / GIB)
    return {"kind": mem["kind"], "phases": out}


def err(measured: float, planned: float) -> float:
    return round(100 * (measured - planned) / planned, 1) if planned else float("nan")


def built(model: str, log: Path) -> None:
    """A synthetic model is built in a process of its own before a run uses it: drawn inside the run, its
    weights' blocks would stay in the run's allocator and its load phase's figures."""
    from finetune.util import synthetic_names

    if synthetic_names.is_synthetic(model) and not (synthetic_names.cache_dir(model) / ".complete").exists():
        must(sh([sys.executable, "-c", f"from finetune.weights.built.synthetic import synthetic_dir; synthetic_dir({model!r})"],
                log=log), f"building {model}")


def train_and_read(rec: dict, work: Path, name: str, sh_: dict, launcher=finetune, env_extra: dict | None = None
                   ) -> dict:
    run = work / name
    path = write_recipe(rec, work / f"{name}.yaml")
    log = work / "commands.log"
    built(rec["model"]["name"], log)
    t0 = time.perf_counter()
    must(sh(launcher(str(path)), log=log, env_extra=env_extra), f"training {name}")
    records = read_jsonl(run / "metrics.jsonl")
    rate = steady_rate(records, after_step=sh_["warmup"])
    return {"run": str(run), "recipe": str(path), "seconds": round(time.perf_counter() - t0, 1),
            "trained_tokens_per_s": round(rate["tokens_per_s"], 1), "s_per_step": round(rate["s_per_step"], 3),
            "timed_steps": rate["steps"], "first_loss": records[0].get("loss"),
            "last_loss": [r for r in records if "loss" in r][-1]["loss"], "memory": phase_peaks(run)}


def plan_figures(plan: dict) -> dict:
    """`finetune estimate --json`'s GPU figures in GiB; the loading one without the CUDA context and NCCL
    buffers, which torch's counters do not see (the plan adds them to what torch reserves)."""
    outside = sum(plan["overhead"].get(k, 0) for k in ("cuda_context", "nccl"))
    return {"allocated_gib": plan["gpu_bytes_allocated"] / GIB, "reserved_gib": plan["gpu_bytes_reserved"] / GIB,
            "loading_gib": (plan["gpu_bytes_loading"] - outside) / GIB, "total_gib": plan["gpu_bytes_per_device"] / GIB,
            "cpu_loading_gib": plan["cpu_bytes"]["loading"] / GIB}


def plan_errors(memory: dict, plan: dict) -> dict:
    ph = memory["phases"]
    if memory["kind"] != "cuda":
        return {}
    out = {}
    if "steps" in ph:
        out["steps_allocated"] = err(ph["steps"]["peak_allocated_gib"], plan["allocated_gib"])
        out["steps_reserved"] = err(ph["steps"]["peak_reserved_gib"], plan["reserved_gib"])
    if "load" in ph:
        from finetune.train.keepers.memory import LOAD_PHASES

        # Under FSDP the load leaves placeholders and the shards are filled after the wrap: the planner's load
        # phase spans them all (memory.LOAD_PHASES).
        loaded = max(ph[k]["peak_reserved_gib"] for k in LOAD_PHASES if k in ph)
        out["load_reserved_vs_loading_plan"] = err(loaded, plan["loading_gib"])
    return out


def read_env(work: Path) -> dict:
    f = work / "stage_env.json"
    return json.loads(f.read_text()) if f.exists() else {}
