"""The GPU proof's stages for what users do after plain LoRA (benchmarks/gpu/stages.py registers them):

- `adapters`: DoRA (QDoRA) beside plain LoRA on the same 4-layer 8B-width model and batch, one process:
  tokens/s and memory side by side, each against the planner;
- `preference`: DPO and ORPO through the real loop on CUDA (the reference pass, chosen and rejected in one
  batch), then `finetune eval` for the held-out preference accuracy;
- `moe`: a Qwen3-30B-A3B-width model (its 128 experts, few layers) with the experts held 4-bit and LoRA on
  them (`lora.target_parameters: auto`): train, the planner beside the measured phases, eval on the GPU;
- `moe_speed`: the grouped 4-bit experts (finetune/weights/experts/grouped.py) at Qwen3-30B-A3B's full depth,
  LoRA on attention and experts, 2 x 2048: tokens/s and peak against the plan, and the per-expert loop on 4
  layers beside it, compared per layer.

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


def moe_speed_names(dry: bool) -> tuple[str, str]:
    """(the grouped run's model, the per-expert run's): Qwen3-30B-A3B's widths at full depth (48 layers) and
    4 of them; the dry run's tiny stand-in has rows of whole 64-element blocks, so it runs grouped too."""
    if dry:
        tiny = ("synthetic:Qwen/Qwen3-30B-A3B?layers=2&hidden=64&intermediate=64&heads=4&kv_heads=2&head_dim=16"
                "&vocab=2048&experts=32&experts_per_tok=4&moe_intermediate=64")
        return tiny, tiny
    return "synthetic:Qwen/Qwen3-30B-A3B?device=cuda", "synthetic:Qwen/Qwen3-30B-A3B?layers=4&device=cuda"


def stage_moe_speed(work: Path, sh_: dict) -> dict:
    """Grouped 4-bit experts at full depth, LoRA on attention and experts, 2 x seq: tokens/s and peak against
    the plan; the per-expert loop (FINETUNE_MOE_EXPERTS=per_expert) on 4 layers beside it, compared per layer.
    The goal: >= 2,600 trained tokens/s, <= 20 GiB peak allocated, planned within 10%."""
    full, short = moe_speed_names(sh_["device"] == "cpu")
    lora = {"target_parameters": "auto", "dropout": 0.0}
    steps, out = sh_["warmup"] + (2 if sh_["device"] == "cpu" else 4), {}
    for name, model, env in (("moe_speed", full, None),
                             ("moe_speed_per_expert", short, {"FINETUNE_MOE_EXPERTS": "per_expert"})):
        rec = recipe(model, sh_["seq"], steps, work / name, held_out=False, lora=lora,
                     train={"micro_batch_size": 2})
        out[name] = _planned(train_and_read(rec, work, name, sh_, env_extra=env), work, name)
    g, p = out["moe_speed"], out["moe_speed_per_expert"]
    layers = {"moe_speed": _layers(full), "moe_speed_per_expert": _layers(short)}
    # seconds per step per decoder layer: the two runs differ in depth, not in what one layer does
    per_layer = {k: out[k]["s_per_step"] / layers[k] for k in out}
    steps_peak = g["memory"]["phases"].get("steps", {}).get(_peak_key(g))
    out["grouped_over_per_expert_per_layer"] = round(per_layer["moe_speed_per_expert"] / per_layer["moe_speed"], 2)
    out["goal"] = {"tokens_per_s": g["trained_tokens_per_s"], "tokens_per_s_goal": 2600,
                   "steps_peak_gib": steps_peak, "peak_goal_gib": 20,
                   "steps_plan_error_pct": g["errors_pct"].get("steps_allocated"), "plan_error_goal_pct": 10,
                   "met": (sh_["device"] == "cuda" and g["trained_tokens_per_s"] >= 2600 and steps_peak is not None
                           and steps_peak <= 20 and abs(g["errors_pct"].get("steps_allocated", 100)) <= 10)}
    return out


def _layers(model: str) -> int:
    from finetune.util import synthetic_names

    base, overrides, _ = synthetic_names.parse(model, "model.name")
    return int(overrides.get("num_hidden_layers", 48))  # Qwen3-30B-A3B has 48


STAGES = {"adapters": stage_adapters, "preference": stage_preference, "moe": stage_moe, "moe_speed": stage_moe_speed}
