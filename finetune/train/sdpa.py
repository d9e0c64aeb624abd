"""Which SDPA kernels training allows, checked once against the run's attention shape, and the run's record of
it (RUN_DIR/memory.json, "attention").

On CUDA, training allows only the SDPA kernels whose memory is linear in the length: flash, then
memory-efficient (finetune.train.loss.attention_kernels holds them over each batch's forward and backward).
Left to itself, torch falls back to its math kernel, silently, whenever those refuse an input, and the math
kernel keeps [batch x heads x T x T] probabilities: at 128K tokens and 32 heads, 2 TiB. If neither accepts
this run's attention (dtype, head size, GPU generation), training keeps torch's choice and says so in one line.

CPU keeps torch's choice: its CPU build runs a blockwise flash kernel (`_scaled_dot_product_flash_attention_for_cpu`,
no [T x T] matrix) for causal rows and boolean masks, fp32 and bf16 alike (checked with torch.profiler, torch
2.13); short bf16 batches take the math kernel on purpose (finetune.plan.attention).
"""
from __future__ import annotations

import torch

from finetune.plan.attention import CPU_MATH_ATTENTION_MAX_LEN, cpu_math_kernel_possible
from finetune.util.log import log

LINEAR = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")  # torch's own order of preference between the two
_state = {"linear": False}  # this process's run: whether CUDA batches run under LINEAR (set by attention_setup)


def linear_backends_on() -> bool:
    return _state["linear"]


def accepting(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> list[str]:
    """The LINEAR kernels that run a causal attention of this shape and dtype on `device`, each tried alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, heads, 64, head_dim, device=device, dtype=dtype)
    ok = []
    for name in LINEAR:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            ok.append(name)
        except RuntimeError:  # "No available kernel": this kernel refuses the shape, dtype or GPU
            pass
    return ok


def cuda_record(impl: str, ok: list[str]) -> dict:
    """The record of a CUDA SDPA run, given the LINEAR kernels that accept its attention; turns LINEAR on or off."""
    _state["linear"] = bool(ok)
    if not ok:
        log.warning("attention: neither SDPA's flash nor its memory-efficient kernel runs this model's attention "
                    "here; torch chooses, and its math kernel keeps [heads x T x T] probabilities (long rows: "
                    "model.attn_implementation: flash_attention_2)")
    return {"implementation": impl, "device": "cuda", "sdpa_backends_allowed": list(LINEAR) if ok else "torch's choice",
            "sdpa_backends_accepting": ok, "sdpa_backend_preferred": ok[0] if ok else None}


def attention_setup(model, device: torch.device, mixed_precision: str) -> dict:
    """Once per run, after the forward is set up: which attention runs, and on CUDA SDPA which kernels."""
    cfg = model.config
    impl = cfg._attn_implementation
    _state["linear"] = False
    if impl != "sdpa" or device.type != "cuda":
        rec = {"implementation": impl, "device": device.type}
        if impl == "sdpa":
            rec["sdpa_backends_allowed"] = "torch's choice (CPU: its blockwise flash kernel)"
            if cpu_math_kernel_possible(device.type, mixed_precision):
                rec["sdpa_math_up_to_tokens"] = CPU_MATH_ATTENTION_MAX_LEN
        return rec
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision,
                                                                  model.get_input_embeddings().weight.dtype)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cuda_record(impl, accepting(device, compute, heads, head_dim))
