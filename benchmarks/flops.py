"""FLOP models of LoRA training (pure arithmetic on an `finetune.plan.archs.Arch`; no torch).

N counts the weights a token is multiplied by: every linear layer of every decoder layer (for MoE, the
experts a token is routed to) plus the output head. The embedding is a lookup, not a matmul.

- Full fine-tuning is the familiar 6N per token: forward 2N, backward 2N for input gradients and 2N for
  weight gradients.
- LoRA freezes the base: no weight gradients for it, so forward 2N + backward 2N = **4N**.
- With activation checkpointing each decoder layer's forward runs again during backward: **6N** (the head
  is not recomputed, so slightly under).
On top of those sit the adapters (L parameters: forward 2L, backward 2L input + 2L weight gradients) and
attention scores (per token and layer 4 x seq x heads x head_dim forward, twice that backward).
"""
from __future__ import annotations


def matmul_params(arch) -> int:
    """N: weights per token in matmuls (decoder linears + head), counting only routed experts."""
    per_layer = 0
    for lin in arch.linears():
        copies = min(lin.count, arch.experts_per_tok) if lin.count > 1 and arch.experts_per_tok else lin.count
        per_layer += lin.d_in * lin.d_out * copies
    return per_layer * arch.layers + arch.vocab * arch.hidden


def head_params(arch) -> int:
    return arch.vocab * arch.hidden


def lora_params(arch, r: int, targets="all-linear") -> int:
    """L: adapter weights a token passes through (peft's all-linear leaves the output head out)."""
    lins = [x for x in arch.linears() if targets == "all-linear" or x.name in targets]
    per_layer = 0
    for lin in lins:
        copies = min(lin.count, arch.experts_per_tok) if lin.count > 1 and arch.experts_per_tok else lin.count
        per_layer += r * (lin.d_in + lin.d_out) * copies
    return per_layer * arch.layers


def attention_fwd(arch, seq: int) -> int:
    """Scores and weighted sum, per token, all layers, full seq x seq square (what the kernels compute)."""
    return 4 * seq * arch.heads * arch.head_dim * arch.layers


def lora_step_flops(arch, r: int, seq: int, checkpointing: bool, targets="all-linear") -> dict[str, int]:
    """Per-token FLOPs of one LoRA training step: the 4N/6N rules and the fuller account."""
    n, lo, a = matmul_params(arch), lora_params(arch, r, targets), attention_fwd(arch, seq)
    full = 4 * n + 6 * lo + 3 * a
    if checkpointing:
        full += 2 * (n - head_params(arch)) + 2 * lo + a
    return {"N": n, "L": lo, "rule": (6 if checkpointing else 4) * n, "model": full}


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: useful FLOPs per second over the devices' peak."""
    return tokens_per_s * flops_per_token / (peak_flops * devices)
