"""LoRA spec -> peft config; apply it; keep the trainable weights in the adapter dtype (fp32 by default)."""
from __future__ import annotations

import warnings

import torch

from finetune.recipe import LoraSpec
from finetune.util.dtypes import torch_dtype


def peft_config(spec: LoraSpec):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        bias=spec.bias,
        task_type="CAUSAL_LM",
    )


def apply_lora(model, spec: LoraSpec, seed: int):
    """Wrap the frozen base with fresh adapters. Seeded so adapter init is reproducible."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias, and transformers 5 then
        # prints a FutureWarning on every run that no user can act on; the value read is the same.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, peft_config(spec), autocast_adapter_dtype=False)
    # Master copies of the trainable weights stay in the adapter dtype (fp32 default): the optimizer updates
    # them exactly while autocast does the matmuls in bf16.
    dtype = torch_dtype(spec.dtype)
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def trainable_report(model) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "all_params": total,
            "trainable_pct": round(100 * trainable / max(total, 1), 3)}
