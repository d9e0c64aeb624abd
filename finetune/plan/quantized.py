"""Bytes of 4-bit weights in the memory plan: bitsandbytes' packed codes and quantization constants of one
tensor, and the MoE experts (held 4-bit per expert by weights/experts/module.py whenever the base is 4-bit)."""
from __future__ import annotations

from finetune.plan.activations import DTYPE_BYTES, MP_BYTES
from finetune.plan.archs import Arch


def packed_4bit_bytes(numel: int, storage: str) -> int:
    # bitsandbytes packs two 4-bit codes per byte into a tensor of `storage` dtype: ((n + 1) // (2 * size), 1).
    size = DTYPE_BYTES[storage]
    return ((numel + 1) // (2 * size)) * size


def quant_constant_bytes(numel: int, double_quant: bool, blocksize: int = 64) -> int:
    """Blockwise absmax of one 4-bit tensor. Double quantization stores each absmax as one byte, with an
    fp32 scale per 256 absmax values and one fp32 offset (0.127 instead of 0.5 bits per parameter)."""
    blocks = -(-numel // blocksize)
    code = 16 * 4  # the 16-entry NF4/FP4 code table each quant state carries
    if not double_quant:
        return blocks * 4 + code
    return blocks + (-(-blocks // 256)) * 4 + 4 + code


def experts_4bit(s) -> bool:
    """MoE experts are held 4-bit (weights/experts/module.py) whenever the base is: a 4-bit recipe whose
    checkpoint is quantized as it loads."""
    return s.quant in ("nf4", "fp4")


def expert_weight_bytes(arch: Arch, s) -> tuple[int, int]:
    """(packed bytes, quantization-state bytes) of every MoE expert. 4-bit: each expert is quantized alone,
    its own absmax (and double-quantization scale and offset); one code table (and with double
    quantization one second-level table) per layer's experts module. Otherwise the fused 3-D parameters
    in the model dtype."""
    params = arch.expert_params()
    if not params:  # a dense model: no experts module, no code tables for one
        return 0, 0
    if not experts_4bit(s):
        return sum(x.d_in * x.d_out * x.count for x in params) * arch.layers * DTYPE_BYTES[s.model_dtype], 0
    packed = sum(packed_4bit_bytes(x.d_in * x.d_out, s.quant_storage) * x.count for x in params)
    code = 16 * 4
    consts = sum((quant_constant_bytes(x.d_in * x.d_out, s.double_quant) - code) * x.count for x in params)
    consts += code + (256 * 4 if s.double_quant else 0)
    return packed * arch.layers, consts * arch.layers


def expert_workspace_bytes(arch: Arch, s) -> int:
    """4-bit experts run grouped (weights/experts/grouped.py): each parameter's experts are dequantized
    together, in forward and again in backward (never kept), one parameter at a time: the largest stacked
    parameter [E, out, in] in the compute dtype, which bitsandbytes writes directly (autocast's dtype, or
    the model dtype without autocast). (The per-expert fallback needs one expert of it.)"""
    if not arch.experts or not experts_4bit(s):
        return 0
    width = DTYPE_BYTES[s.model_dtype] if s.mixed_precision == "no" else MP_BYTES[s.mixed_precision]
    return max(x.d_in * x.d_out * x.count for x in arch.expert_params()) * width
