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
    """Peak of the full-logits loss (today's transformers path): the logits in the compute dtype, their
    fp32 copy and the fp32 log-probabilities cross_entropy saves, then in backward the fp32 gradient of
    the log-probabilities beside them and its compute-dtype cast."""
    fp32 = tokens * vocab * 4
    half = tokens * vocab * compute_bytes if compute_bytes != 4 else 0
    return half + 3 * fp32 + half


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, compute_bytes: int, chunk_tokens: int = 0,
                       residual_bytes: int = 4) -> int:
    """Peak of train.loss's chunked head: one chunk's logits in the compute dtype beside their fp32 copy
    (turned in place into the softmax gradient), plus what lives across chunks: the selected hidden
    states, their gradient and the per-row log-sum-exp."""
    rows = min(tokens, chunk_rows(vocab, chunk_tokens))
    working = rows * vocab * (4 + (compute_bytes if compute_bytes != 4 else 0))
    return working + 2 * tokens * hidden * residual_bytes + tokens * 4
