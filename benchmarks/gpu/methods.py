"""The GPU proof's stages for what users do after plain LoRA (benchmarks/gpu/stages.py registers them):

- `adapters`: DoRA (QDoRA) beside plain LoRA on the same 4-layer 8B-width model and batch, one process:
  tokens/s and memory side by side, each against the planner;
- `preference`: DPO and ORPO through the real loop on CUDA (the reference pass, chosen and rejected in one
  batch), then `finetune eval` for the held-out preference accuracy;
- `moe`: a Qwen3-30B-A3B-width model (its 128 experts, few layers) with the experts held 4-bit and LoRA on
  them (`lora.target_parameters: auto`): train, the planner beside the measured phases, eval on the GPU.

Each prints nothing of its own: stages.main writes the returned dict as the stage's result.
"""
from __future__ import annotations

import math
from pathlib import Path

from benchmarks.common import last_json_line
from benchmarks.gpu.harness import (estimate, finetune, must, plan_errors, plan_figures, recipe, sh, train_and_read,
                                    write_recipe)


def moe_name(dry: bool) -> str:
    if dry:
        return ("synthetic:Qwen/Qwen3-30B-A3B?layers=2&hidden=64&intermediate=64&heads=4&kv_heads=2&head_dim=16"
                "&vocab=2048&experts=16&experts_per_tok=2&moe_intermediate=32")
    # the real widths (hidden 2048, 128 experts of 768, 8 routed per token), 4 of its 48 layers
    return "synthetic:Qwen/Qwen3-30B-A3B?layers=4&device=cuda"


def _planned(res: dict, work: Path, name: str) -> dict:
    res["plan"] = plan_figures(estimate(work / f"{name}.yaml", work / "commands.log"))
    res["errors_pct"] = plan_errors(res["memory"], res["plan"])
    res["losses_finite"] = all(math.isfinite(x) for x in (res["first_loss"], res["last_loss"]))
    return res


def stage_adapters(work: Path, sh_: dict) -> dict:
    """LoRA and DoRA on the same model and rows: what DoRA costs in time and memory on this GPU."""
    out = {}
    steps = sh_["warmup"] + 4
    for name, lora in (("adapters_lora", {}), ("adapters_dora", {"use_dora": True})):
        rec = recipe(sh_["m8_short"], sh_["seq"], steps, work / name, held_out=False, lora=lora)
        out[name] = _planned(train_and_read(rec, work, name, sh_), work, name)
    lo, do = out["adapters_lora"], out["adapters_dora"]
    out["dora_over_lora"] = {
        "tokens_per_s": round(do["trained_tokens_per_s"] / lo["trained_tokens_per_s"], 3),
        "steps_peak": round(do["memory"]["phases"]["steps"][_peak_key(do)] / lo["memory"]["phases"]["steps"][_peak_key(lo)], 3)}
    return out


def _peak_key(res: dict) -> str:
    return "peak_allocated_gib" if res["memory"]["kind"] == "cuda" else "peak_rss_gib"


def stage_preference(work: Path, sh_: dict) -> dict:
    """DPO (reference = the base, an RPO term beside it) and ORPO on the builtin preference pairs, then eval."""
    out = {}
    log = work / "commands.log"
    for method, train in (("dpo", {"method": "dpo", "beta": 0.1, "dpo_sft_weight": 0.5}),
                          ("orpo", {"method": "orpo", "orpo_lambda": 1.0})):
        name = f"pref_{method}"
        rec = recipe(sh_["m8_short"], 64, 6, work / name, train={**train, "micro_batch_size": 8, "learning_rate": 1e-4})
        cap = sh_["pref_pairs"]  # the dry run's; a GPU reads them all (eval: 32 of the 200 held out)
        rec["data"] = {"sources": [_capped({"path": "builtin:tiny-preference"}, cap.get("train"))],
                       "eval_sources": [_capped({"path": "builtin:tiny-preference", "split": "eval"}, cap.get("eval"))],
                       "max_seq_len": 64}
        res = _planned(train_and_read(rec, work, name, {**sh_, "warmup": 1}), work, name)
        p = must(sh(finetune("eval", str(work / name), "--json", "--max-rows", str(cap.get("eval", 32))), log=log),
                 f"{name} eval")
        res["eval"] = last_json_line(p.stdout)
        out[name] = res
    return out


def _capped(source: dict, rows: int | None) -> dict:
    return {**source, "max_samples": rows} if rows else source


def stage_moe(work: Path, sh_: dict) -> dict:
    """4-bit experts with LoRA on them, one process: train, plan against measured, eval on the GPU."""
    name = "moe"
    model = moe_name(sh_["device"] == "cpu")
    seq = min(sh_["seq"], 1024)
    rec = recipe(model, seq, sh_["warmup"] + 4, work / name,
                 lora={"target_parameters": "auto", "dropout": 0.0})
    res = _planned(train_and_read(rec, work, name, sh_), work, name)
    p = must(sh(finetune("eval", str(work / name), "--json"), log=work / "commands.log"), "moe eval")
    res["eval"] = last_json_line(p.stdout)
    return res


STAGES = {"adapters": stage_adapters, "preference": stage_preference, "moe": stage_moe}
