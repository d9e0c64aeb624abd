"""Long context on CPU: the tiled MLP (model.tiled_mlp) against the untiled one at 16,384 tokens.

The setting: a synthetic Llama whose MLP is 3.5x its width (Llama 3 8B's ratio, 14336 / 4096), so the MLP's
intermediates are most of what one layer keeps for backward; 4-bit NF4 base, LoRA r16 on every linear,
gradient checkpointing, fp32 compute (precision "no"), one sequence of 16,384 tokens (no padding, no
packing: causal SDPA, no mask). Each arm runs in a fresh process: the model loads as training loads it
(finetune.weights.load.model, finetune.train.lora), the forward is set up as training sets it up
(finetune.train.loss.setup_forward: lean modules, tiled MLPs), then STEPS optimizer steps of the training
loss (finetune.train.loss.token_loss_sum) and torch AdamW on the adapters. The peak resident set (VmHWM) is
reset just before the steps (/proc/self/clear_refs), so the figure is the steps' own peak; the planner's
CPU figure for the steps (finetune estimate --device cpu: the `training` phase) stands beside it.

    python -m benchmarks.cpu.long_context [--layers 2 --hidden 512 --tokens 16384]   # table + one JSON line
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import ROOT, child_env

GIB = 2**30
STEPS = 2


def model_name(layers: int, hidden: int) -> str:
    inter = hidden * 7 // 2  # 3.5 x hidden: Llama 3 8B's MLP ratio
    return (f"synthetic:meta-llama/Llama-3.2-1B?layers={layers}&hidden={hidden}&intermediate={inter}"
            f"&heads={hidden // 64}&kv_heads={max(1, hidden // 256)}&vocab=384")


def recipe(name: str, tokens: int, tiled) -> object:
    from finetune import recipe as R

    return R.from_dict({"model": {"name": name, "gradient_checkpointing": True, "tiled_mlp": tiled},
                        "lora": {"r": 16, "dropout": 0.0}, "data": {"max_seq_len": tokens},
                        "train": {"mixed_precision": "no", "micro_batch_size": 1}}, "long_context")


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def arm(name: str, tokens: int, tiled) -> dict:
    """One arm in this process: load, set up, STEPS steps; the steps' peak RSS and the plan's."""
    import torch

    from finetune.plan.estimate import build, from_recipe
    from finetune.train.lora import apply_lora
    from finetune.train.loss import setup_forward, token_loss_sum
    from finetune.weights.load.model import load_model

    r = recipe(name, tokens, tiled)
    model = load_model(r.model, r.quantization, quiet=True)
    model = apply_lora(model, r.lora, seed=0)
    model.train()
    setup_forward(model, False, r.model.tiled_mlp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 384, (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on is the steps'
    losses, start = [], time.perf_counter()
    for _ in range(STEPS):
        loss, _n = token_loss_sum(model, batch, "cpu", r.train)
        (loss / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / tokens)
    seconds = (time.perf_counter() - start) / STEPS
    plan = build(__import__("dataclasses").replace(from_recipe(r), device="cpu"))
    return {"tiled_mlp": tiled, "peak_rss": _rss("VmHWM"), "rss_before_steps": before, "losses": losses,
            "seconds_per_step": round(seconds, 1), "planned_steps": plan.cpu["training"],
            "planned_activations": plan.breakdown["activations"] + plan.breakdown["logits_loss"]}


def run(layers: int = 2, hidden: int = 512, tokens: int = 16384) -> dict:
    name = model_name(layers, hidden)
    out = {"model": name, "tokens": tokens}
    for key, tiled in (("untiled", False), ("tiled", True)):  # one after the other: the same machine load
        code = f"import json; from benchmarks.cpu.long_context import arm; print(json.dumps(arm({name!r}, {tokens}, {tiled})))"
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{key} failed:\n{p.stderr[-3000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
        res["plan_error"] = round((res["planned_steps"] - res["peak_rss"]) / res["peak_rss"], 3)
        out[key] = res
    u, t = out["untiled"], out["tiled"]
    out["peak_reduction"] = round(1 - t["peak_rss"] / u["peak_rss"], 3)
    out["growth_reduction"] = round(1 - (t["peak_rss"] - t["rss_before_steps"]) / (u["peak_rss"] - u["rss_before_steps"]), 3)
    out["time_ratio"] = round(t["seconds_per_step"] / u["seconds_per_step"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args(argv)
    res = run(a.layers, a.hidden, a.tokens)
    for key in ("untiled", "tiled"):
        r = res[key]
        print(f"{key:<8} peak RSS {r['peak_rss'] / GIB:6.2f} GiB (before steps {r['rss_before_steps'] / GIB:.2f})  "
              f"planned {r['planned_steps'] / GIB:6.2f} GiB ({r['plan_error']:+.1%})  {r['seconds_per_step']} s/step  "
              f"losses {r['losses']}")
    print(f"tiled peak {res['peak_reduction']:.1%} below untiled (steps' growth {res['growth_reduction']:.1%}); "
          f"time tiled / untiled {res['time_ratio']}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
