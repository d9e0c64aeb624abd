"""The grouped path of 4-bit MoE experts (weights/experts/module.PackedExperts): every routed token of a layer
sorted by expert, and one grouped matrix multiply per projection (torch's public `F.grouped_mm`: one call over
jagged per-expert row groups, delimited by the cumulative counts on the device) instead of one small matmul,
one dequantization and one LoRA pair per expert. Each parameter's experts are dequantized together in one
bitsandbytes call (the per-expert runs are contiguous and block-aligned, so one QuantState over all of them
gives each expert's own bytes back), in forward and again in backward: the dequantized layer is the largest
transient and is never kept (plan/quantized.expert_workspace_bytes). LoRA on the experts (peft's factors,
expert_lora.py) is two more grouped matmuls; autograd's own grouped_mm backward gives A's and B's gradients.

No host read at all: the group ends are `cumsum(bincount)` on the device (the per-expert path reads the
counts once per layer). The per-expert loop stays as the reference and the fallback (`usable`).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# FINETUNE_MOE_EXPERTS=per_expert runs every layer through the per-expert loop: the reference the grouped path is
# tested against, and what the speed benchmarks compare it with (benchmarks/cpu/moe_speedup.py).
ENV = "FINETUNE_MOE_EXPERTS"


def usable(experts, x: torch.Tensor, factors: dict) -> bool:
    """Whether this call runs grouped; the per-expert loop runs instead where the reference was asked for,
    where torch has no public grouped_mm (before 2.10), where a weight's rows are not whole quantization
    blocks, or where an operand row is not a multiple of 16 bytes in the compute dtype (grouped GEMM's
    stride rule, on CPU as on CUDA). Whole-block rows: bitsandbytes 0.50's CPU dequantize_4bit indexes a
    row shorter than a block as if each row began a block, so one call over the stacked experts would not
    give back what the per-expert call gives (only tiny test widths have such rows)."""
    if os.environ.get(ENV, "grouped") == "per_expert" or not hasattr(F, "grouped_mm"):
        return False
    size = torch.empty((), dtype=compute_dtype(x)).element_size()
    widths = [w for (_, rows, cols) in experts.shapes.values() for w in (rows, cols)]
    widths += [lhs.shape[-1] for lhs, _, _ in factors.values()]  # the LoRA rank
    blocks = all(cols % experts.q["blocksize"] == 0 for (_, _, cols) in experts.shapes.values())
    return blocks and all(w * size % 16 == 0 for w in widths)


class Groups:
    """The routed rows (token, slot) sorted by expert, expert 0's first and each expert's in token order, and
    `offs`: each expert's group end (int32, on the device; grouped_mm's jagged boundaries)."""

    def __init__(self, top_k_index: torch.Tensor, experts: int):
        with torch.no_grad():
            slots, flat = top_k_index.size(-1), top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            self.offs = torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32)
            self.token, self.pos = order // slots, order % slots


def gmm(x: torch.Tensor, w: torch.Tensor, g: Groups) -> torch.Tensor:
    """Row group e of x ([N, K], sorted) times w[e] ([E, K, M]): [N, M], one grouped GEMM."""
    return F.grouped_mm(x, w, offs=g.offs)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def dequantized_all(experts, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every expert's weight of `name` ([E, out, in], `dtype`, default experts.dtype) in one bitsandbytes
    dequantize_4bit call. bitsandbytes writes the compute dtype itself, bit for bit what dequantizing to fp32
    and casting gives (it scales in fp32 and rounds once), so no fp32 copy of the layer is made and converted.
    With double quantization each expert's absmax is first restored as bitsandbytes' dequantize_blockwise
    does it (code2[byte] * its block's scale, then + the expert's offset), for all experts at once."""
    import bitsandbytes.functional as bf

    e, rows, cols = experts.shapes[name]
    absmax = getattr(experts, f"{name}_absmax")
    if experts.q["compress_statistics"]:
        blocks = absmax.shape[1]
        scale = getattr(experts, f"{name}_absmax2").repeat_interleave(256, dim=1)[:, :blocks]
        absmax = experts.code2[absmax.long()] * scale + getattr(experts, f"{name}_offset")[:, None]
    qs = bf.QuantState(absmax=absmax.reshape(-1), shape=torch.Size((e * rows, cols)), dtype=dtype or experts.dtype,
                       blocksize=experts.q["blocksize"], code=experts.code, quant_type=experts.q["quant_type"])
    return bf.dequantize_4bit(getattr(experts, name).reshape(-1, 1), qs).reshape(e, rows, cols)


class _GroupedDequantMM(torch.autograd.Function):
    """x @ Wₑᵀ for every expert's row group, W dequantized whole in forward and again in backward (the base
    is frozen: only the input's gradient is needed, and the dequantized layer is not kept for it)."""

    @staticmethod
    def forward(ctx, x, groups: Groups, experts, name: str):
        ctx.experts, ctx.name, ctx.dtype, ctx.groups = experts, name, x.dtype, groups
        dtype = compute_dtype(x)
        w = dequantized_all(experts, name, dtype)
        return gmm(x.to(dtype), w.transpose(1, 2), groups)

    @staticmethod
    def backward(ctx, grad):
        w = dequantized_all(ctx.experts, ctx.name, grad.dtype)
        return gmm(grad.contiguous(), w, ctx.groups).to(ctx.dtype), None, None, None


def _linear(experts, x, g: Groups, name: str, factors: dict):
    y = _GroupedDequantMM.apply(x, g, experts, name)
    if name in factors:  # peft's delta scale·B·A per expert: x·Aₑᵀ, then ·Bₑᵀ, each one grouped matmul
        lhs, rhs, scaling = factors[name]
        dtype = y.dtype
        xa = gmm(x.to(dtype), rhs.to(dtype).transpose(1, 2), g)
        # peft's B factor is a permuted view ([E, out, r] over B's [out, r·E]): grouped GEMM needs a unit stride
        y = y + gmm(xa, lhs.to(dtype).transpose(1, 2).contiguous(), g) * scaling
    return y


def forward(experts, hidden_states, top_k_index, top_k_weights, factors: dict):
    """As PackedExperts.forward (transformers' experts forward contract), grouped."""
    g = Groups(top_k_index, experts.num_experts)
    x = hidden_states[g.token]
    gate, up = _linear(experts, x, g, "gate_up_proj", factors).chunk(2, dim=-1)
    y = _linear(experts, (experts.act_fn(gate) * up).contiguous(), g, "down_proj", factors)
    y = y * top_k_weights[g.token, g.pos, None]
    return torch.zeros_like(hidden_states).index_add_(0, g.token, y.to(hidden_states.dtype))
