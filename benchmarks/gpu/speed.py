"""The GPU proof's speed stages (benchmarks/gpu/stages.py registers them): the 8B recipe at 2 x 2048 on one GPU
in arms, beside the fastest peers on the same rows, LoRA (r16, alpha 32, every linear), paged 8-bit AdamW,
sequence length and micro-batch.

- `speed`: finetune's arms (ARMS: today's setting, `model.gradient_checkpointing: auto`, `train.compile`,
  `train.kernels: liger`, all of them together) and TRL's SFTTrainer (benchmarks/peers/trl_gpu.py; the `trl`
  stage's result when it ran in this work dir: the same model, rows and batch). An arm whose setting this
  checkout's recipe schema does not accept is reported "skipped: setting not available", so the stage runs
  before and after those settings land. The dry run skips the GPU-only settings with the reason.
- `speed_unsloth`: unsloth (benchmarks/peers/unsloth_gpu.py) in an interpreter of its own, whose path holds
  only unsloth's wheels (it needs transformers <= 5.17, trl <= 1.15, datasets < 5: the GPU image's
  transformers, not the kit's); see benchmarks/README.md, "The speed stage". Skipped on CPU (unsloth refuses
  to import without a GPU) and where its site is not installed.

Each arm records trained tokens/s (steady state: the first `warmup` steps excluded), peak allocated and
reserved memory during the steps, the loss curve, the gradient norms (a rate with zero gradients is no
result), the attention implementation the run used and the host time per step.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from benchmarks.common import ROOT, child_env, last_json_line, read_jsonl, steady_rate
from benchmarks.gpu.harness import must, phase_peaks, python_m, recipe, sh, train_and_read

# name -> the recipe settings (dotted keys) the arm changes from the 8B recipe as shipped
# in this order: the cheapest first (compile pays its compile time), so a stage cut short keeps the most
ARMS = {"today": {},
        "auto": {"model.gradient_checkpointing": "auto"},
        "kernels": {"train.kernels": "liger"},
        "compile": {"train.compile": True},
        "all": {"model.gradient_checkpointing": "auto", "train.compile": True, "train.kernels": "liger"}}
# settings the dry run leaves out (dropped from `all`; an arm left with nothing of its own is skipped), and why
DRY_LEFT_OUT = {"train.kernels": "GPU only: liger's Triton kernels need a CUDA GPU",
                # CI time: inductor's C++ build takes minutes on 2 cores even for the tiny shapes, and
                # train.compile's own tests run it on CPU (FINETUNE_SPEED_DRY_COMPILE=1 compiles here too)
                "train.compile": "not compiled in the dry run: inductor's CPU build takes minutes"}
UNSLOTH_SITE = "FINETUNE_UNSLOTH_SITE"  # where unsloth's wheels are installed (--target); default /tmp/usite
DRY_COMPILE = "FINETUNE_SPEED_DRY_COMPILE"  # set: the dry run compiles too (minutes on a small CPU)
ONLY = "FINETUNE_SPEED_ARMS"  # a comma-separated subset of ARMS (a GPU session short of time); default all


def arm_recipe(sh_: dict, work: Path, name: str, settings: dict) -> dict:
    rec = recipe(sh_["m8"], sh_["seq"], sh_["warmup"] + sh_["steps"], work / f"speed_{name}", held_out=False)
    for key, value in settings.items():
        section, field = key.split(".")
        rec.setdefault(section, {})[field] = value
    return rec


def unavailable(rec: dict, settings: dict) -> str | None:
    """Why this checkout's recipe schema refuses the arm's settings (None: it takes them). Any other refusal is
    the stage's own bug and raises."""
    from pydantic import ValidationError

    from finetune.recipe.schema import Recipe

    try:
        Recipe.model_validate(rec)
    except ValidationError as e:
        ours = [err for err in e.errors() if ".".join(map(str, err["loc"][:2])) in settings]
        if len(ours) < len(e.errors()):
            raise
        return "; ".join(f"{'.'.join(map(str, err['loc'][:2]))}: {err['msg']}" for err in ours)
    return None


def read_arm(run_dir: Path, rec: dict, sh_: dict) -> dict:
    """What one of our arms measured, from its run dir: rate, memory, curves, host time, attention."""
    from finetune.weights.load.resolve import resolve_attention

    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    timed = [r for r in steps if r["step"] > sh_["warmup"] and "host_s_per_step" in r]
    mem = phase_peaks(run_dir)
    rate = steady_rate(records, after_step=sh_["warmup"])
    norms = [r.get("grad_norm") for r in steps]
    return {"trained_tokens_per_s": round(rate["tokens_per_s"], 1), "s_per_step": round(rate["s_per_step"], 4),
            "timed_steps": rate["steps"], "steps_memory_gib": mem["phases"].get("steps", {}), "memory_kind": mem["kind"],
            "losses": [r["loss"] for r in steps], "grad_norms": norms,
            "gradients_ok": all(isinstance(g, float) and math.isfinite(g) and g > 0 for g in norms),
            "host_s_per_step": (round(sum(r["host_s_per_step"] for r in timed) / len(timed), 5) if timed else None),
            "attention": resolve_attention(rec["model"].get("attn_implementation", "sdpa"), quiet=True)}


def arm_plan(name: str, settings: dict, cpu: bool, only: list[str]) -> tuple[dict, str | None]:
    """(the settings the arm runs with here, why it is skipped or None). On CPU the dry run leaves out
    DRY_LEFT_OUT's settings; an arm left with none of its own, or with another arm's, is skipped."""
    if only and name not in only:
        return settings, f"not in {ONLY}"
    compiles = bool(os.environ.get(DRY_COMPILE))
    left_out = {k: why for k, why in DRY_LEFT_OUT.items() if cpu and not (k == "train.compile" and compiles)}
    kept = {k: v for k, v in settings.items() if k not in left_out}
    if kept == settings:
        return settings, None
    why = "; ".join(left_out[k] for k in settings if k not in kept)
    same = [n for n, other in ARMS.items() if n != name and other == kept]
    if not kept:
        return kept, why
    if same:
        return kept, f"{why} (the rest is arm {same[0]})"
    return kept, None


def stage_speed(work: Path, sh_: dict) -> dict:
    """finetune's arms, then TRL, then each arm's ratios to TRL."""
    out: dict = {"arms": {}}
    cpu = sh_["device"] == "cpu"
    only = [a for a in os.environ.get(ONLY, "").split(",") if a]
    for name, settings in ARMS.items():
        kept, skip = arm_plan(name, settings, cpu, only)
        if skip:
            out["arms"][name] = {"status": "skipped", "why": skip}
            continue
        rec = arm_recipe(sh_, work, name, kept)
        why = unavailable(rec, kept)
        if why:
            out["arms"][name] = {"status": "skipped", "why": f"setting not available: {why}"}
            continue
        train_and_read(rec, work, f"speed_{name}", sh_)
        res = {"status": "ok", "settings": kept, **read_arm(work / f"speed_{name}", rec, sh_)}
        if kept != settings:
            res["left_out"] = {k: DRY_LEFT_OUT[k] for k in settings if k not in kept}
        out["arms"][name] = res
        # each arm as it ends: a stage stopped at its cap still leaves the arms it finished in log.txt
        print(f"speed arm {name}: {json.dumps(res, default=str)}", flush=True)
    out["trl"] = trl_arm(work, sh_)
    out["over_trl"] = {name: ratios(a, out["trl"]) for name, a in out["arms"].items() if a["status"] == "ok"}
    return out


def trl_arm(work: Path, sh_: dict) -> dict:
    """TRL on the same model, rows and batch: the trl stage's run when it ran in this work dir, else its own."""
    earlier = work / "stage_trl.json"
    if earlier.exists():
        return {**json.loads(earlier.read_text())["trl"], "from": "the trl stage of this work dir"}
    p = must(sh(python_m("benchmarks.peers.trl_gpu", json.dumps({**sh_, "work": str(work)})),
                log=work / "commands.log"), "TRL arm")
    return last_json_line(p.stdout)


def ratios(ours: dict, peer: dict) -> dict:
    """Our arm over a peer: tokens/s, and peak allocated memory on a GPU (None on CPU: RSS is not comparable)."""
    mem = ours["steps_memory_gib"].get("peak_allocated_gib")
    return {"tokens_per_s": round(ours["trained_tokens_per_s"] / peer["tokens_per_s"], 3),
            "peak_allocated": (round(mem / peer["peak_allocated_gib"], 3)
                               if mem and peer.get("peak_allocated_gib") else None)}


def stage_speed_unsloth(work: Path, sh_: dict) -> dict:
    """unsloth on the same model and rows, in its own interpreter path; beside the speed stage's arms when
    that stage ran in this work dir."""
    site = Path(os.environ.get(UNSLOTH_SITE, "/tmp/usite"))
    if sh_["device"] == "cpu":
        return {"status": "skipped", "why": "GPU only: unsloth refuses to import without a CUDA GPU"}
    if not (site / "unsloth").is_dir():
        return {"status": "skipped", "why": f"unsloth is not installed in {site} ({UNSLOTH_SITE}): see "
                                            "benchmarks/README.md, the speed stage"}
    from finetune.util.synthetic_names import token_rows
    from finetune.weights.built.synthetic import synthetic_dir

    model_dir = synthetic_dir(sh_["m8"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    steps = sh_["warmup"] + sh_["steps"]
    opts = {"rows": 2 * steps + 8, "min_len": sh_["seq"], "max_len": sh_["seq"], "vocab": vocab, "seed": 0}
    rows = work / "unsloth_rows.json"  # the TRL arm's rows: its interpreter cannot import finetune
    rows.write_text(json.dumps(list(token_rows(opts, "train", vocab))))
    env = {**child_env(), "PYTHONPATH": str(site)}  # its own path only: not the kit's transformers, not finetune
    settings = {**sh_, "work": str(work), "model_dir": str(model_dir), "rows": str(rows)}
    p = must(sh([sys.executable, str(ROOT / "benchmarks" / "peers" / "unsloth_gpu.py"), json.dumps(settings)],
                log=work / "commands.log", env_extra=env), "unsloth arm")
    out = {"status": "ok", "unsloth": last_json_line(p.stdout)}
    speed = work / "stage_speed.json"
    if speed.exists():
        arms = json.loads(speed.read_text())["arms"]
        out["over_unsloth"] = {n: ratios(a, out["unsloth"]) for n, a in arms.items() if a["status"] == "ok"}
    return out


STAGES = {"speed": stage_speed, "speed_unsloth": stage_speed_unsloth}
