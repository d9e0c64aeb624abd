"""The frozen base model from the recipe's `model` and `quantization` sections (names, the tokenizer and the
attention kernel are resolved in resolve.py): the streaming loader for safetensors, transformers'
`from_pretrained` for what it cannot stream. Only LoRA adapters (train/lora.py) train.
"""
from __future__ import annotations

from pathlib import Path

import torch

from finetune.recipe import ModelSpec, QuantizationSpec
from finetune.util.dtypes import torch_dtype
from finetune.util.errors import RecipeError
from finetune.weights.bnb import bnb_config, disable_cpu_weight_repacking
from finetune.weights.load.loadplan import Source
from finetune.weights.load.resolve import check_weights_format, local_checkpoint, resolve_attention, resolve_name, text_decoder


def load_model(spec: ModelSpec, quant: QuantizationSpec, placement=None, quiet: bool = False):
    """The whole frozen base in this process (see load_with_plan), for `placement` (None: on the GPU when
    there is one, placement.default_placement). Under FSDP the fill needs the plan: use load_with_plan."""
    model, plan = load_with_plan(spec, quant, placement, quiet)
    if plan is not None:
        raise ValueError(f"load_model: a {plan.stream.placement.mode} placement leaves shards to fill; "
                         "use load_with_plan and hand its plan to fill_shards")
    return model


def load_with_plan(spec: ModelSpec, quant: QuantizationSpec, placement=None, quiet: bool = False):
    """(model, load plan): the frozen base quantized per `quant`, non-quantized parameters in `spec.dtype`,
    through the streaming loader (skeleton.py) for the placement (None: the whole model in this process, on
    the GPU when there is one), and the plan the shard fill takes after wrapping (None when every weight is
    already set, as for a whole model). `quiet` silences the attention fallback line (resolve_attention).

    Two kinds of base still go through transformers' `from_pretrained`, and only unsharded: int8
    (LLM.int8 weights cannot be sharded by FSDP at all) and pickle-only checkpoints the recipe allows
    (the streaming reader reads safetensors only)."""
    from finetune.util.libc import map_large_buffers
    from finetune.weights.load.placement import default_placement

    map_large_buffers()  # from here on, a freed weight or activation leaves the process (util.libc)
    placement = placement or default_placement()
    path = local_checkpoint(resolve_name(spec.name), spec)
    check_weights_format(path, spec.allow_pickle)
    attn = resolve_attention(spec.attn_implementation, quiet)
    if quant.mode == "int8" or not any(Path(path).glob("*.safetensors")):
        if placement.mode != "whole":
            raise RecipeError([f"model.name: {spec.name}: FSDP loads safetensors 4-bit (or unquantized) bases "
                               "shard by shard; int8 and pickle-only checkpoints load whole, without FSDP"])
        model, plan = _from_pretrained(path, spec, quant, attn), None
    else:
        from transformers import AutoConfig

        from finetune.weights.load.skeleton import load_base

        config = text_decoder(AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code), quiet)
        model, plan = load_base(Source(Path(path), config, torch_dtype(spec.dtype), bnb_config(quant, spec.dtype),
                                       placement, attn, spec.trust_remote_code))
    model.config.use_cache = False  # training never uses the KV cache; it would also break packing masks
    for p in model.parameters():
        p.requires_grad_(False)
    keep_buffers_fp32(model)
    # bitsandbytes repacks 4-bit weights in place on AVX512-BF16 CPUs during eval forwards, which corrupts
    # later training steps and every FSDP gather (see disable_cpu_weight_repacking); keep the trained layout.
    disable_cpu_weight_repacking(model)
    return model, plan


def _from_pretrained(path: str, spec: ModelSpec, quant: QuantizationSpec, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, revision=spec.revision, dtype=torch_dtype(spec.dtype), quantization_config=bnb_config(quant, spec.dtype),
        attn_implementation=attn, trust_remote_code=spec.trust_remote_code,
        use_safetensors=None if spec.allow_pickle else True)


def keep_buffers_fp32(model):
    """RoPE's inv_freq (and similar buffers) must stay fp32: in bf16 the rotary angles of late positions
    lose precision. Loading in a half dtype casts them; put them back."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(module, name, buf.float())  # nn.Module keeps it a buffer, persistence unchanged
