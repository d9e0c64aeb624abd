"""The training loss, shared by the loop, `finetune eval` and the benchmarks: next-token cross-entropy
summed over the trained tokens, the output head run on trained positions only, under the SDPA kernel that
finetune.plan.attention's rule picks for the batch.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from finetune.data import encode
from finetune.plan.attention import uses_cpu_math_kernel
from finetune.train.device import to_device
from finetune.train.distributed import autocast


def token_loss_sum(model, batch: dict, device_type: str, train_spec) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over trained tokens, and their count.

    Summing (not averaging) per micro-batch lets the caller divide by the tokens of the whole optimizer
    step across all ranks, so micro-batch x accumulation x processes never changes the result.

    The output head runs only on the positions whose next token is trained (see `trained_rows_only`):
    prompt and padding positions never get logits, so neither their head matmul nor their fp32 upcast for
    the loss is paid. Callers run it, and its backward, inside `batch_kernels`."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != encode.IGNORE  # position t predicts token t + 1
    with trained_rows_only(model, keep), autocast(train_spec, device_type):
        logits = model(**inputs, use_cache=False).logits  # [trained tokens, vocab]
    targets = labels[:, 1:][keep[:, :-1]]
    if logits.dim() != 2 or logits.size(0) != targets.numel():
        raise RuntimeError(f"{type(extract_model_from_parallel(model)).__name__} computed its logits without "
                           "calling its output-embeddings module; finetune's loss needs that module")
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")  # fp32 loss under bf16 autocast
    return loss, targets.numel()


def trained_tokens(batch: dict) -> int:
    """How many tokens of `batch` are trained (the count `token_loss_sum` returns), without a forward."""
    return int((batch["labels"][:, 1:] != encode.IGNORE).sum())


@torch.no_grad()
def loss_totals(model, batches, device_type: str, train_spec, max_batches=None, device=None) -> tuple[float, int]:
    """(summed loss, trained tokens) of `model` over the first `max_batches` of `batches` (all when None
    or 0), each moved to `device` first unless it is None."""
    total = count = 0
    for i, b in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        if device is not None:
            b = to_device(b, device)
        with batch_kernels(b, device_type, train_spec):
            loss, n = token_loss_sum(model, b, device_type, train_spec)
        total, count = total + float(loss), count + n
    return total, count


@contextlib.contextmanager
def trained_rows_only(model, keep: torch.Tensor):
    """While active, the model's output head sees only the hidden states at `keep` ([B, T] bool):
    [B, T, hidden] becomes [N, hidden] and the model returns logits [N, vocab].

    Why: in instruction data most positions are prompt or padding, and the logits are the largest
    activation of a large-vocabulary model (Llama 3: 128k x 4 bytes per position in fp32). A forward
    pre-hook on the head keeps this inside the model's own forward, so FSDP's hooks (which gather the
    head's weights) run exactly as they do without it."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][keep], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def attention_kernels(device_type: str, mixed_precision: str, seq_len: int):
    """Context manager restricting SDPA to the kernel `uses_cpu_math_kernel` picks (a no-op otherwise)."""
    if uses_cpu_math_kernel(device_type, mixed_precision, seq_len):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def batch_kernels(batch: dict, device_type: str, train_spec):
    """The SDPA kernels for this batch (`attention_kernels`), to hold over its forward AND its backward:
    gradient checkpointing recomputes attention during backward, and the recomputation must save the same
    tensors as the forward did, so it must run the same kernel."""
    return attention_kernels(device_type, train_spec.mixed_precision, batch["input_ids"].size(1))
