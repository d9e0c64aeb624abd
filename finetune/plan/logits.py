"""Bytes of the loss path: the output head and cross-entropy, full logits or chunked (train.loss).

Pure arithmetic on the vocabulary, hidden size and dtypes, shared by the planner and the training loss
(the automatic chunk size is defined here once, so the plan and the run agree on it).
"""
from __future__ import annotations

CHUNK_LOGITS_BYTES = 256 * 2**20  # one chunk's fp32 logits under the automatic chunk size


def chunk_rows(vocab: int, chunk_tokens: int = 0) -> int:
    """Positions per chunk: `chunk_tokens`, or 0 for as many as fit CHUNK_LOGITS_BYTES of fp32 logits."""
    return chunk_tokens if chunk_tokens > 0 else max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def full_logits_bytes(tokens: int, vocab: int, compute_bytes: int) -> int:
    """Peak of a full-logits loss, cross_entropy(logits.float()): it comes in backward, where the fp32
    log-probabilities cross_entropy saved, their incoming gradient and the gradient of the logits are
    alive together (the compute-dtype logits and their fp32 copy never overlap all three; measured on
    CPU by benchmarks/cpu/loss_memory.py). `compute_bytes` does not change it."""
    return 3 * tokens * vocab * 4


def transformers_loss_bytes(tokens: int, vocab: int) -> int:
    """Peak of transformers' own causal-LM loss as trainers called it (model(..., labels=...), the
    Trainer/TRL path up to transformers 4.44): the model's output keeps the logits upcast to fp32 while the
    loss runs `full_logits_bytes` on a shifted copy, so one more fp32 [tokens x vocab] is alive."""
    return 4 * tokens * vocab * 4


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, compute_bytes: int, chunk_tokens: int = 0,
                       residual_bytes: int = 4) -> int:
    """Peak of train.loss's chunked head: one chunk's logits in the compute dtype beside their fp32 copy
    (turned in place into the softmax gradient), plus what lives across chunks: the selected hidden
    states, their gradient and the per-row log-sum-exp."""
    rows = min(tokens, chunk_rows(vocab, chunk_tokens))
    working = rows * vocab * (4 + (compute_bytes if compute_bytes != 4 else 0))
    return working + 2 * tokens * hidden * residual_bytes + tokens * 4
