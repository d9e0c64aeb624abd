"""Tiled MLP (recipe: model.tiled_mlp): each decoder layer's gated MLP runs over the tokens in chunks, in
the forward pass and again in its backward, so its [tokens x intermediate] activations (gate, up, the
activation's output and their gradients) exist for one chunk at a time. At long context they are most of
what one layer needs for backward: Llama 3 8B keeps 3 x 14336 values per token there against 4096 in
each checkpointed layer input.

The forward keeps only the MLP's input; the backward recomputes each chunk with autograd on (the MLP's
own forward, LoRA and 4-bit dequantization included), takes the chunk's gradients with respect to its
input and to the MLP's trained parameters, and sums the parameters' over chunks. The random state is
replayed, so dropout draws the forward's masks again. MLPs are per token, so the result is the untiled
one; gradients differ only in the order the chunks' contributions are summed.

The trained parameters are inputs of the autograd Function (not accumulated into `.grad` by hand), so
they reach FSDP's and the optimizer's hooks as any other gradient does. Same idea as ALST's TiledMLP
(arXiv 2506.13996) and TRL's tiled MLP.
"""
from __future__ import annotations

import torch

from finetune.util.errors import RecipeError

GATED = ("gate_proj", "up_proj", "down_proj", "act_fn")


class _Tiled(torch.autograd.Function):
    """fn over `x`'s tokens in chunks of `chunk`, keeping only `x`; `params` are fn's trained parameters."""

    @staticmethod
    def forward(ctx, fn, chunk, x, *params):
        dev = x.device
        ctx.fn, ctx.chunk, ctx.params = fn, chunk, params
        ctx.amp = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.rng = _rng_state(dev)
        ctx.save_for_backward(x)
        flat, out = x.reshape(-1, x.shape[-1]), None
        with torch.no_grad():
            for start in range(0, flat.shape[0], chunk):
                y = fn(flat[start:start + chunk])
                if out is None:  # written in place: a list of chunks and their cat would hold the output twice
                    out = y.new_empty(flat.shape[0], y.shape[-1])
                out[start:start + y.shape[0]] = y
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        want = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        gx = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        gp = [None] * len(want)
        dev = x.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
            _set_rng_state(dev, ctx.rng)  # the forward's draws, in the forward's order (dropout masks)
            for start in range(0, flat.shape[0], ctx.chunk):
                piece = flat[start:start + ctx.chunk].detach().requires_grad_(gx is not None)
                with torch.enable_grad(), torch.autocast(dev.type, dtype=ctx.amp[1], enabled=ctx.amp[0]):
                    y = ctx.fn(piece)
                inputs = ([piece] if gx is not None else []) + want
                got = torch.autograd.grad(y, inputs, g[start:start + piece.shape[0]], allow_unused=True)
                if gx is not None:
                    gx[start:start + piece.shape[0]] = got[0]
                    got = got[1:]
                gp = [a if b is None else b if a is None else a + b for a, b in zip(gp, got)]
        grads = iter(gp)
        params = [next(grads) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, gx.view_as(x) if gx is not None else None, *params)


def _rng_state(dev: torch.device):
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def _set_rng_state(dev: torch.device, state) -> None:
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)


def chunk_tokens(tiled, hidden: int) -> int:
    """model.tiled_mlp as tokens per chunk: true means hidden_size tokens (a chunk's intermediates are then
    intermediate x hidden values, the size of one MLP weight, which each 4-bit matmul dequantizes anyway)."""
    return hidden if tiled is True else int(tiled)


def _tiled_forward(module, chunk: int):
    inner = module.forward  # the lean MLP's forward when finetune.train.lean put one in, else the stock one

    def forward(x):
        if x.shape[:-1].numel() <= chunk:  # one chunk: nothing to tile
            return inner(x)
        params = [p for p in module.parameters() if p.requires_grad]
        return _Tiled.apply(inner, chunk, x, *params)

    return forward


def refused(module) -> bool:
    """An MoE block (routed experts, router logits handed on): not tiled here."""
    return hasattr(module, "experts") and ("gate" in dict(module.named_children()) or hasattr(module, "router"))


def apply(model, tiled, hidden: int) -> int:
    """Tile every gated MLP of `model` (model.tiled_mlp; false: nothing). Runs after finetune.train.lean,
    whose MLP forward it then tiles. Returns how many MLPs are tiled; a model with MoE blocks, or with no
    gated MLP at all, is refused by name (exit 2)."""
    if tiled is False:
        return 0
    chunk = chunk_tokens(tiled, hidden)
    moe = sorted({type(m).__name__ for m in model.modules() if refused(m)})
    if moe:
        raise RecipeError([f"model.tiled_mlp: {', '.join(moe)} routes tokens to experts; the tiled MLP covers "
                           "gated Llama-form MLPs only. Set model.tiled_mlp: false for this model."])
    n = 0
    for m in model.modules():
        if all(hasattr(m, k) for k in GATED):
            if not getattr(m, "_finetune_tiled", False):  # once: a second call leaves it as it is
                m.forward = _tiled_forward(m, chunk)
                m._finetune_tiled = True
            n += 1
    if not n:
        raise RecipeError([f"model.tiled_mlp: {type(model).__name__} has no gated MLP (gate_proj, up_proj, "
                           "down_proj); set model.tiled_mlp: false for this model."])
    return n
