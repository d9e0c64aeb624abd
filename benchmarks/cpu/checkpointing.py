"""Row 5: what activation (gradient) checkpointing costs on the tiny QLoRA recipe.

- Step time with it on and off: finetune's real loop (as in row 1), fresh forked runs alternating on/off.
- FLOPs per token of one training step, counted by torch's FlopCounterMode, against the 4N (LoRA) and 6N
  (LoRA + recomputation) rules of benchmarks/flops.py. Two details make the count complete: bitsandbytes'
  4-bit matmul is a custom op (`bitsandbytes::gemm_4bit`) whose inside the counter cannot see, so it gets a
  FLOP formula here (2 x rows x out x in, like any matmul); and attention runs `eager` for the count because
  FlopCounterMode has no formula for the CPU SDPA kernel (eager computes the same full score matrix).
  The counting batch is the recipe's micro-batch of random ids with every position trained.
"""
from __future__ import annotations

import math

from benchmarks.common import TINY_RECIPE, fork_context, in_fresh_process, interleaved, median
from benchmarks.cpu.throughput import finetune_run, round_steps


def _register_bnb_formula():
    import torch
    from torch.utils.flop_counter import register_flop_formula

    op = torch.ops.bitsandbytes.gemm_4bit

    @register_flop_formula(op)
    def _gemm_4bit(a_shape, b_shape, shape_b, *args, out_shape=None, **kwargs) -> int:
        # A [..., in] @ W[out, in]^T, W packed in 4 bits: the arithmetic of an ordinary matmul.
        return 2 * math.prod(a_shape[:-1]) * shape_b[0] * shape_b[1]


def count_flops(checkpointing: bool) -> dict:
    """FLOPs of one forward + backward of finetune's model and loss, split by op."""
    import bitsandbytes  # noqa: F401  (defines the op the formula is for)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from finetune import recipe as recipe_mod
    from finetune.train.lora import apply_lora
    from finetune.train.loss import token_loss_sum
    from finetune.train.lora import enable_checkpointing
    from finetune.weights.load.model import load_model

    _register_bnb_formula()
    rec = recipe_mod.load(TINY_RECIPE, ["model.attn_implementation=eager",
                                        f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    model = load_model(rec.model, rec.quantization, quiet=True)
    enable_checkpointing(model, rec.model)
    model = apply_lora(model, rec.lora, seed=rec.train.seed)
    model.train()
    batch, seq = rec.train.micro_batch_size, rec.data.max_seq_len
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = token_loss_sum(model, {"input_ids": ids, "labels": ids.clone()}, "cpu", rec.train)
        loss.backward()
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts()["Global"].items()}
    return {"total": int(counter.get_total_flops()), "by_op": by_op, "tokens": batch * seq, "seq": seq,
            "r": rec.lora.r}


def flop_rows(counted: dict) -> dict:
    from benchmarks.flops import lora_step_flops
    from finetune.plan.archs import resolve

    arch, _ = resolve("builtin:tiny-llama")
    out = {}
    for mode, c in counted.items():
        m = lora_step_flops(arch, c["r"], c["seq"], checkpointing=(mode == "on"))
        per_token = c["total"] / c["tokens"]
        out[mode] = {"flops_per_token": per_token, "rule": m["rule"], "rule_name": "6N" if mode == "on" else "4N",
                     "vs_rule": per_token / m["rule"], "model": m["model"], "vs_model": per_token / m["model"],
                     "N": m["N"], "L": m["L"], "by_op_per_token": {k: v / c["tokens"] for k, v in c["by_op"].items()}}
    return out


def run(reps: int = 5, warmup: int = 5, steps: int = 10) -> dict:
    steps = round_steps(warmup, steps)
    ctx = fork_context()
    got = interleaved(ctx, {"off": (finetune_run, (["model.gradient_checkpointing=false"], warmup, steps)),
                            "on": (finetune_run, (["model.gradient_checkpointing=true"], warmup, steps))}, reps)
    step = {k: median([r["s_per_step"] for r in v]) for k, v in got.items()}
    counted = {mode: in_fresh_process(ctx, count_flops, mode == "on") for mode in ("off", "on")}
    flops = flop_rows(counted)
    return {"step_time_ratio": step["on"] / step["off"], "s_per_step": step,
            "samples": {k: [r["s_per_step"] for r in v] for k, v in got.items()},
            "flops": flops, "flops_ratio": flops["on"]["flops_per_token"] / flops["off"]["flops_per_token"],
            "reps": reps, "warmup_steps": warmup, "timed_steps": steps}


if __name__ == "__main__":
    import json

    print(json.dumps(run(reps=1, steps=5), indent=1))
