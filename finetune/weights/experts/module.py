"""MoE experts held 4-bit. transformers 5 fuses each layer's experts into two 3-D parameters
(`gate_up_proj` [E, 2i, h], `down_proj` [E, h, i]) that bitsandbytes' quantizer never reaches (it replaces
`nn.Linear` only). `PackedExperts` takes the place of the model's experts module (Qwen3MoeExperts,
MixtralExperts: same parameters, same forward contract) and keeps each parameter as the packed 4-bit bytes
of its experts one after another (expert e's bytes are one contiguous run, quantized alone: NF4 or FP4,
with double quantization when the recipe asks, by bitsandbytes' own quantize_4bit), stored (elements, 1)
in the storage dtype like every other 4-bit weight, so FSDP shards them the same way. The quantization
state of every expert is small and sits beside them as non-persistent buffers (every rank holds it whole).

The forward runs grouped (weights/experts/grouped.py: each parameter's experts dequantized in one call, one
grouped matmul per projection over the routed tokens sorted by expert, no host read). The per-expert loop
below is its reference and its fallback (grouped.usable says when): it groups the router's picks by expert
(one host read per layer: each expert's count) and dequantizes, one at a time, only the experts the router
picked for the batch. Either way backward dequantizes again instead of keeping the weights (as
bitsandbytes' 4-bit matmul does). LoRA on experts (peft's ParamWrapper, through expert_lora.py) is
added per picked expert as x·Aₑᵀ·Bₑᵀ·scale, the same W + scale·B·A peft applies to the dense tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_experts(module) -> bool:
    """transformers 5's fused experts module of an MoE family (MixtralExperts, Qwen3MoeExperts, ...)."""
    return type(module).__name__.endswith("Experts") and all(
        isinstance(getattr(module, n, None), torch.nn.Parameter) and getattr(module, n).dim() == 3
        for n in EXPERT_PARAMS)


class PackedExperts(torch.nn.Module):
    """The experts of one MoE layer, 4-bit (see the module doc). `q`: blocksize, compress_statistics,
    quant_type, quant_storage (a 4-bit weight's quantization arguments, as the load plan has them)."""

    def __init__(self, experts: torch.nn.Module, q: dict, dtype: torch.dtype):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.q, self.dtype = dict(q), dtype  # dtype: what a dequantized expert comes out in
        self.shapes = {n: tuple(getattr(experts, n).shape) for n in EXPERT_PARAMS}
        import bitsandbytes.functional as bf

        self.register_buffer("code", bf.get_4bit_type(q["quant_type"], device="cpu"), persistent=False)
        if q["compress_statistics"]:
            self.register_buffer("code2", bf.create_dynamic_map().float(), persistent=False)
        for name, shape in self.shapes.items():
            data = torch.empty((0,), dtype=q["quant_storage"], device="meta")
            setattr(self, name, expert_parameter(data, shape))
            for stat, like in stat_shapes(shape, q).items():
                self.register_buffer(f"{name}_{stat}", torch.zeros(like[0], dtype=like[1]), persistent=False)

    def per_expert(self, name: str) -> int:
        """Storage elements of one expert's packed bytes."""
        _, rows, cols = self.shapes[name]
        return rows * cols // (2 * torch.empty((), dtype=self.q["quant_storage"]).element_size())

    def set_stats(self, name: str, stats: dict) -> None:
        """The quantization state of every expert of `name` (from stack_states), on this module's device."""
        for stat, value in stats.items():
            buf = getattr(self, f"{name}_{stat}")
            setattr(self, f"{name}_{stat}", value.to(buf.device, buf.dtype))

    def dequantized(self, name: str, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e's weight of `name` ([out, in], `dtype`, default self.dtype), by bitsandbytes'
        dequantize_4bit, which writes the compute dtype directly (equal to dequantizing and casting)."""
        import bitsandbytes.functional as bf

        m, (_, rows, cols) = self.per_expert(name), self.shapes[name]
        packed = getattr(self, name).reshape(-1)[e * m:(e + 1) * m].reshape(-1, 1)
        common = dict(shape=torch.Size((rows, cols)), dtype=dtype or self.dtype, blocksize=self.q["blocksize"],
                      code=self.code, quant_type=self.q["quant_type"])
        absmax = getattr(self, f"{name}_absmax")[e]
        if self.q["compress_statistics"]:
            state2 = bf.QuantState(absmax=getattr(self, f"{name}_absmax2")[e], code=self.code2, blocksize=256,
                                   dtype=torch.float32)
            qs = bf.QuantState(absmax=absmax, offset=getattr(self, f"{name}_offset")[e], state2=state2, **common)
        else:
            qs = bf.QuantState(absmax=absmax, **common)
        return bf.dequantize_4bit(packed, qs)

    def forward(self, hidden_states, top_k_index, top_k_weights, factors: dict | None = None):
        """As transformers' experts forward; `factors`: parameter name -> peft's (lhs [E, out, r],
        rhs [E, r, in], scaling) for the adapted ones."""
        from finetune.weights.experts import grouped

        factors = factors or {}
        if grouped.usable(self, hidden_states, factors):
            return grouped.forward(self, hidden_states, top_k_index, top_k_weights, factors)
        # the per-expert loop: the reference, and the fallback where grouped GEMM cannot run (grouped.usable)
        out = torch.zeros_like(hidden_states)
        all_token, all_pos, counts = route(top_k_index, self.num_experts)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            token, pos, start = all_token[start:start + n], all_pos[start:start + n], start + n
            x = hidden_states[token]
            gate, up = self._linear(x, "gate_up_proj", e, factors).chunk(2, dim=-1)
            y = self._linear(self.act_fn(gate) * up, "down_proj", e, factors)
            y = y * top_k_weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _linear(self, x, name: str, e: int, factors: dict):
        y = _DequantLinear.apply(x, self, name, e)
        if name in factors:
            lhs, rhs, scaling = factors[name]
            y = y + F.linear(F.linear(x, rhs[e]), lhs[e]) * scaling
        return y


def route(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The router's picks grouped by expert: (token, slot) of every pick, expert 0's first, each expert's in
    token order (torch.where's order), and how many each expert got. The counts are the one host read of
    the layer: picking each expert's rows with torch.where instead waits on the GPU once per expert (a
    4-layer, 128-expert model ran at 2.4 s per step on an H100 that way, benchmarks/RESULTS_GPU.md)."""
    with torch.no_grad():
        slots = top_k_index.size(-1)
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        counts = torch.bincount(top_k_index.reshape(-1), minlength=experts).tolist()
        return order // slots, order % slots, counts


class _DequantLinear(torch.autograd.Function):
    """x @ Wₑᵀ with Wₑ dequantized in forward and again in backward, never kept (the base is frozen: only
    the input's gradient is needed)."""

    @staticmethod
    def forward(ctx, x, experts: PackedExperts, name: str, e: int):
        ctx.experts, ctx.name, ctx.e, ctx.dtype = experts, name, e, x.dtype
        from finetune.weights.experts.grouped import compute_dtype

        dtype = compute_dtype(x)  # the grouped path's rule: autocast's dtype, else the input's
        return F.linear(x.to(dtype), experts.dequantized(name, e, dtype))

    @staticmethod
    def backward(ctx, grad):
        return (grad @ ctx.experts.dequantized(ctx.name, ctx.e, grad.dtype)).to(ctx.dtype), None, None, None


def expert_parameter(data: torch.Tensor, shape: tuple) -> torch.nn.Parameter:
    """A frozen parameter holding packed expert bytes. `ds_shape` is the logical [E, out, in] shape: peft's
    ParamWrapper sizes its adapters from it (the attribute peft reads for a parameter stored in another
    shape, as under DeepSpeed ZeRO-3), so the adapters match the dense experts'."""
    p = torch.nn.Parameter(data, requires_grad=False)
    p.ds_shape = torch.Size(shape)
    return p


def stat_shapes(shape: tuple, q: dict) -> dict:
    """Each quantization-state buffer of a parameter of `shape` [E, out, in]: name -> (shape, dtype)."""
    experts, rows, cols = shape
    blocks = -(-rows * cols // q["blocksize"])
    if not q["compress_statistics"]:
        return {"absmax": ((experts, blocks), torch.float32)}
    return {"absmax": ((experts, blocks), torch.uint8), "absmax2": ((experts, -(-blocks // 256)), torch.float32),
            "offset": ((experts,), torch.float32)}


def stack_states(states: list) -> dict:
    """The per-expert QuantStates of one parameter, stacked as PackedExperts keeps them."""
    out = {"absmax": torch.stack([s.absmax for s in states])}
    if states[0].nested:
        out["absmax2"] = torch.stack([s.state2.absmax for s in states])
        out["offset"] = torch.stack([s.offset.reshape(()) for s in states]).float()
    return out


def pack_experts(model, q: dict, dtype: torch.dtype) -> int:
    """Every fused experts module of `model` -> PackedExperts (the parameters unset: the loader fills them).
    Returns how many were replaced."""
    found = [(name, m) for name, m in model.named_modules() if is_experts(m)]
    for name, module in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedExperts(module, q, dtype))
    return len(found)
