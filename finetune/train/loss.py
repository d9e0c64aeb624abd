"""The training loss, shared by the loop, `finetune eval` and the benchmarks: next-token cross-entropy
summed over the trained tokens, the output head run on trained positions only and in chunks, under the
SDPA kernel that finetune.plan.attention's rule picks for the batch.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from finetune.data import encode
from finetune.plan.attention import uses_cpu_math_kernel
from finetune.plan.logits import chunk_rows
from finetune.train import balance, lean, sdpa, tiled
from finetune.train.offload import setup_offload
from finetune.data.transfer import to_device
from finetune.train.precision import autocast

# Config fields of models whose forward changes the logits after the output head (Gemma 2 soft-capping,
# Cohere's logit scale, Granite's divisor): the head's result is not the logits there, so those models
# take the full-logits path.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def setup_forward(model, activation_offloading: bool, tiled_mlp=False, compiled=None):
    """Once, at setup, on the wrapped model: the memory-lean norms and MLPs go in (lean.apply; not inside
    the layers of `compiled`, finetune.train.compiled's), then the tiled MLPs of `model.tiled_mlp` around them
    (tiled.apply), and the activation-offloading context is made (offload.setup_offload; None when off or
    without CUDA), to be handed to every `token_loss_sum`. The loss itself changes no module."""
    base = unwrapped(model)
    lean.apply(base, compiled.inner_modules() if compiled is not None else frozenset())
    cfg = getattr(base, "config", None)
    tiled.apply(base, tiled_mlp, getattr(getattr(cfg, "text_config", None) or cfg, "hidden_size", 0))
    return setup_offload(model, activation_offloading)


def device_batch(batch: dict, device) -> dict:
    """`batch` ready for `token_loss_sum` on `device`, with everything that depends on the labels' values
    worked out on the host first, so that a training step never waits for the GPU (one read per optimizer
    step): `rows`, the flat indices of the positions whose next token is trained (position t of
    row b is b * T + t), and `targets`, those next tokens. A boolean mask applied on the device would be a
    wait (its result's size is data-dependent). On a GPU the tensors go through pinned memory,
    asynchronously. (transformers' mask builder still reads the attention mask, or without one the
    positions, on the device once per forward to choose SDPA's causal fast path: measured on an H200.)"""
    labels = batch["labels"].cpu()  # already there for the loop's batches (built on the host)
    trained = labels[:, 1:] != encode.IGNORE  # position t predicts token t + 1
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = trained
    host = {**batch, "rows": keep.reshape(-1).nonzero().squeeze(1), "targets": labels[:, 1:][trained]}
    return to_device(host, device) if device is not None else host


def token_loss_sum(model, batch: dict, device_type: str, train_spec, offload=None, aux: list | None = None
                   ) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over trained tokens, and their count.

    Summing (not averaging) per micro-batch lets the caller divide by the tokens of the whole optimizer
    step across all ranks, so micro-batch x accumulation x processes never changes the result.

    The output head runs only on the positions whose next token is trained, in chunks of rows whose
    logits are recomputed in backward (`chunked_head_loss`): [tokens x vocab] logits never exist at once.
    With `offload` (model.activation_offloading on CUDA: offload.setup_offload's context, made once at
    setup) the forward runs under it. Nothing here changes the model: the memory-lean modules are put in
    once, at setup (lean.apply). Callers run it, and its backward, inside `batch_kernels`. `aux`: see
    `token_losses`."""
    return token_losses(model, batch, device_type, train_spec, offload, reduction="sum", aux=aux)


def token_losses(model, batch: dict, device_type: str, train_spec, offload=None, reduction: str = "none",
                 aux: list | None = None):
    """(the cross-entropy of every trained token, in row-major order of the batch's trained positions, [N];
    or with reduction "sum" their sum, as `token_loss_sum` returns it; and N). Preference losses sum the
    per-token values per sequence (finetune.train.preference). Only input_ids, attention_mask and
    position_ids of the batch reach the model. With a list `aux` (an MoE run training the router's balance
    loss) the forward also computes the model's own load-balancing loss, appended to `aux` (finetune.train.balance);
    without it the forward is asked nothing more."""
    if "rows" not in batch:  # a caller that did not use device_batch: the same result, worked out here
        batch = device_batch(batch, batch["labels"].device)
    rows, targets = batch["rows"], batch["targets"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    base = unwrapped(model)
    offloading = offload() if offload is not None else contextlib.nullcontext()
    if aux is not None:
        inputs["output_router_logits"] = True  # the model returns its balance loss (no labels: not added to any loss)
    if chunkable(base):
        with head_computes_loss(base, rows, targets, train_spec.loss_chunk_tokens, reduction) as called, \
                autocast(train_spec, device_type), offloading:
            out = model(**inputs, use_cache=False)
            loss = out.logits  # the head returned the loss
        _check_head_called(base, called)
        _keep_aux(out, aux)
        return loss, targets.numel()
    with trained_rows_only(model, rows), autocast(train_spec, device_type), offloading:
        out = model(**inputs, use_cache=False)
        logits = out.logits  # [trained tokens, vocab]
    _keep_aux(out, aux)
    if logits.dim() != 2 or logits.size(0) != targets.numel():
        _check_head_called(base, [])
    loss = F.cross_entropy(logits.float(), targets, reduction=reduction)  # fp32 loss under bf16 autocast
    return loss, targets.numel()


def _keep_aux(output, aux: list | None) -> None:
    if aux is not None:
        aux.append(balance.read_aux(output).float())


_UNWRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unwrapped(model):
    """accelerate's `extract_model_from_parallel`, worked out once per model: at accelerate 1.15 each call
    walks every module (`has_compiled_regions`), ~1% of the tiny CPU recipe's step when done per
    micro-batch. Both sides are weak references: the cache keeps no model alive (the unwrapped model is
    often the model itself)."""
    ref = _UNWRAPPED.get(model)
    base = ref() if ref is not None else None
    if base is None:
        base = extract_model_from_parallel(model)
        _UNWRAPPED[model] = weakref.ref(base)
    return base


def _check_head_called(base, called: list):
    if not called:
        raise RuntimeError(f"{type(base).__name__} computed its logits without calling its output-embeddings "
                           "module; finetune's loss needs that module")


def chunkable(base) -> bool:
    """Whether the output head's result is the model's logits, unchanged (see LOGIT_POSTPROCESSING), and
    the head is a plain linear layer the chunked loss can run itself."""
    cfg = getattr(base, "config", None)
    if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        return False
    head = base.get_output_embeddings()
    # A plain Linear's forward, whatever the class: FSDP2 re-classes the head it shards (FSDPLinear, a
    # subclass with Linear's forward), and an exact type check sent every FSDP2 run to the full-logits path
    # (measured on an H200: 1.96 GiB of fp32 logits and as much again in backward at 2 x 2048).
    return isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward


@contextlib.contextmanager
def head_computes_loss(base, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, reduction: str = "sum"):
    """While active, the model's output head returns the summed cross-entropy of the hidden states at
    the flat positions `rows` (device_batch's) against `targets` instead of logits, computed chunk by chunk
    (with reduction "none", each position's cross-entropy, [N]).

    The head module is still *called* by the model's own forward (only its `forward` is swapped for the
    instance): FSDP's hooks around the root (or around the head, if it is wrapped alone) gather its weight
    before the call, and the loss is part of the wrapped module's output, so FSDP's pre-backward hook
    re-gathers the weight before the chunks are recomputed in backward. Yields a list that is non-empty
    once the head has run."""
    head = base.get_output_embeddings()
    called: list = []

    def forward(hidden):
        called.append(True)
        size = chunk_tokens or chunk_rows(head.out_features)
        per_token = chunked_token_losses(trained_rows(hidden, rows), head.weight, head.bias, targets, size)
        return per_token if reduction == "none" else per_token.sum()

    head.forward = forward
    try:
        yield called
    finally:
        del head.forward  # the class's forward again


def chunked_head_loss(hidden, weight, bias, targets, rows: int) -> torch.Tensor:
    """sum_i CE(hidden[i] @ weight.T + bias, targets[i]) over [N, h] `hidden`, `rows` rows at a time
    (`chunked_token_losses`, summed)."""
    return chunked_token_losses(hidden, weight, bias, targets, rows).sum()


def chunked_token_losses(hidden, weight, bias, targets, rows: int) -> torch.Tensor:
    """[N]: CE(hidden[i] @ weight.T + bias, targets[i]) of each row of [N, h] `hidden`, `rows` rows at a time.

    The matmul runs in the compute dtype (autocast's when it is on, else the inputs'), each chunk's
    log-sum-exp in fp32, as the full-logits loss does. Nothing but the per-row log-sum-exp is saved
    beyond the inputs: backward recomputes each chunk's logits."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.result_type(hidden, weight)
    return _ChunkedHeadCE.apply(hidden, weight, bias, targets, max(1, int(rows)), dtype)


def _chunk_logits(x, w, bias, dtype):
    out = x.to(dtype) @ w.t()
    return out if bias is None else out + bias.to(dtype)


class _ChunkedHeadCE(torch.autograd.Function):
    """Chunked output head + cross-entropy with recomputation in backward. Peak working memory: one
    chunk's logits in the compute dtype, its fp32 copy (turned in place into the softmax gradient) and
    that gradient cast back to the compute dtype: rows x vocab x (compute bytes + 4) at most, 4 in fp32
    (finetune.plan.logits.chunked_loss_bytes plans it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # a no-op when the head is already stored in the compute dtype
            lse = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
            per_token = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.size(0), rows):
                logits = _chunk_logits(hidden[s:s + rows], w, bias, dtype).float()
                picked = logits.gather(1, targets[s:s + rows, None]).squeeze(1)
                # log-sum-exp in place (torch.logsumexp would allocate two more chunk-sized buffers)
                top = logits.amax(dim=-1, keepdim=True)
                chunk_lse = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
                lse[s:s + rows] = chunk_lse
                per_token[s:s + rows] = chunk_lse - picked
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.rows, ctx.dtype = rows, dtype
        return per_token

    @staticmethod
    def backward(ctx, grad_per_token):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        rows, dtype = ctx.rows, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.size(0), rows):
                x = hidden[s:s + rows]
                # softmax - one_hot(target), scaled by the incoming gradient, built in place in fp32
                g = _chunk_logits(x, w, bias, dtype).float().sub_(lse[s:s + rows, None]).exp_()
                idx = targets[s:s + rows, None]
                g.scatter_add_(1, idx, torch.full(idx.shape, -1.0, dtype=g.dtype, device=g.device))
                g.mul_(grad_per_token[s:s + rows, None])
                g_c = g.to(dtype)
                del g
                if need_h:
                    grad_h[s:s + rows] = g_c @ w
                if need_w:
                    grad_w += g_c.t().float() @ x.float()
                if need_b:
                    grad_b += g_c.float().sum(0)
                del g_c  # before the next chunk's logits exist
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None)


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
        b = device_batch(b, device)
        with batch_kernels(b, device_type, train_spec):
            loss, n = token_loss_sum(model, b, device_type, train_spec)
        total, count = total + float(loss), count + n
    return total, count


@contextlib.contextmanager
def trained_rows_only(model, rows: torch.Tensor):
    """While active, the model's output head sees only the hidden states at `rows` (device_batch's):
    [B, T, hidden] becomes [N, hidden] and the model returns logits [N, vocab].

    Why: in instruction data most positions are prompt or padding, and the logits are the largest
    activation of a large-vocabulary model (Llama 3: 128k x 4 bytes per position in fp32). A forward
    pre-hook on the head keeps this inside the model's own forward, so FSDP's hooks (which gather the
    head's weights) run exactly as they do without it."""
    head = unwrapped(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: (trained_rows(args[0], rows), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def trained_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, T, h] hidden states -> [N, h] at the flat positions `rows` (device_batch's): an index gather,
    which the GPU runs without telling the host a size."""
    return hidden.reshape(-1, hidden.size(-1)).index_select(0, rows)


def attention_kernels(device_type: str, mixed_precision: str, seq_len: int):
    """Context manager restricting SDPA to the kernel `uses_cpu_math_kernel` picks, or on CUDA to the
    memory-linear kernels that finetune.train.sdpa found to accept the run (a no-op otherwise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if uses_cpu_math_kernel(device_type, mixed_precision, seq_len):
        return sdpa_kernel(SDPBackend.MATH)
    if device_type == "cuda" and sdpa.linear_backends_on():
        return sdpa_kernel([getattr(SDPBackend, name) for name in sdpa.LINEAR])
    return contextlib.nullcontext()


def batch_kernels(batch: dict, device_type: str, train_spec):
    """The SDPA kernels for this batch (`attention_kernels`), to hold over its forward AND its backward:
    gradient checkpointing recomputes attention during backward, and the recomputation must save the same
    tensors as the forward did, so it must run the same kernel."""
    return attention_kernels(device_type, train_spec.mixed_precision, batch["input_ids"].size(1))
