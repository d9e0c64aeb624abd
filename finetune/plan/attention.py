"""Which SDPA kernel a training or evaluation forward asks for: the rule, without torch.

The rule lives in the plan layer because the memory planner reads it too (the kernel decides which
tensors attention keeps for backward); finetune.train.loss.attention_kernels applies it with torch.
"""
from __future__ import annotations

# Longest batch (tokens) for which CPU training in bf16 uses SDPA's math kernel.
CPU_MATH_ATTENTION_MAX_LEN = 128


def cpu_math_kernel_possible(device_type: str, mixed_precision: str) -> bool:
    """Whether some batches of this run can take the math kernel (see uses_cpu_math_kernel)."""
    return device_type == "cpu" and mixed_precision == "bf16"


def uses_cpu_math_kernel(device_type: str, mixed_precision: str, seq_len: int) -> bool:
    """On CPU in bf16, torch's flash kernel pays a large fixed cost in its backward. Measured here (torch
    2.13, 2 cores, causal GQA attention, forward + backward): flash / math time 2.2 at 64 tokens, 2.1 at
    128, 0.87 at 256, 0.43 at 512 (batch x heads x head_dim from 16x4x64 to 1x32x128). So batches up to
    CPU_MATH_ATTENTION_MAX_LEN tokens take the math kernel, which keeps fp32 copies of q, k, v and the
    [B, H, T, T] probabilities for backward (at most 128 x 128 per head). CUDA, fp32 and longer batches
    keep torch's own choice."""
    return cpu_math_kernel_possible(device_type, mixed_precision) and seq_len <= CPU_MATH_ATTENTION_MAX_LEN

