"""bitsandbytes, configured in one place: the BitsAndBytesConfig a recipe's `quantization` section means (the
training load and the merge's NF4 reference both build theirs here), and the switch that keeps bitsandbytes'
4-bit layers in the layout they were loaded with.
"""
from __future__ import annotations

import torch

from finetune.recipe import QuantizationSpec
from finetune.util.dtypes import torch_dtype


def four_bit_config(quant_type: str, double_quant: bool, compute_dtype: torch.dtype, storage_dtype: torch.dtype):
    """A 4-bit transformers BitsAndBytesConfig."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        # The packed 4-bit bytes live in a tensor of this dtype. FSDP shards and gathers it like any other
        # parameter, so it must be the dtype of every other parameter (model.dtype) and never be cast.
        bnb_4bit_quant_storage=storage_dtype,
    )


def bnb_config(q: QuantizationSpec, model_dtype: str):
    """QuantizationSpec -> transformers BitsAndBytesConfig (None for mode: none)."""
    from transformers import BitsAndBytesConfig

    if q.mode == "none":
        return None
    if q.mode == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return four_bit_config(q.mode, q.double_quant, torch_dtype(q.compute_dtype),
                           torch_dtype(q.quant_storage or model_dtype))


def quantized_bytes_per_param(model) -> float:
    """Storage bytes per weight element of the quantized linear layers (about 0.5 for 4-bit)."""
    import bitsandbytes as bnb

    nbytes = n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight
            nbytes += w.numel() * w.element_size()
            n += m.in_features * m.out_features
    return nbytes / n if n else float("nan")


def disable_cpu_weight_repacking(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights in place during CPU inference; returns how many
    layers were switched.

    Linear4bit.forward on a CPU with AVX512-BF16, in eval mode without grad, replaces `weight.data` with
    a uint8 CPU-kernel layout and marks the shared quant_state as repacked. Under FSDP the replaced
    tensor is the gathered copy, which is freed after forward, while the flag stays: the next forward
    reads the original layout as repacked (measured: logits off by 1.7, training loss after an eval
    6.000 instead of 6.048, FSDP1 and FSDP2). In one process the weight stays repacked, its storage
    dtype changes, and backward then runs through an op without autograd support; and that kernel computes
    in bf16 whatever compute_dtype says (0.4% error on the tiny model against the dequantize-then-matmul
    path training takes, which merged weights reproduce). Training, eval and the merge's check need the
    layout the weights were loaded with.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n
