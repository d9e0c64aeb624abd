"""Memory-lean norms and MLP activations for Llama-style decoders (Llama, Mistral, Qwen 2): recompute,
in backward, what is cheap to recompute instead of keeping it for the whole backward pass.

- RMSNorm keeps an fp32 upcast of its input (4 bytes an element) for backward; here it keeps the input
  itself, which is the checkpointed layer input for the first norm of each layer (already held). An fp32
  input is its own upcast: the stock norm then keeps nothing more (but a rsqrt per row), so it runs as it
  is, with no recomputation to pay for (CPU runs in fp32, where this was ~6% of the tiny recipe's step).
- The gated MLP keeps the gate projection, the activation's output and the up projection; here it keeps
  the two projections and recomputes the activation.

Backward re-runs the module's own forward on the kept inputs under the forward's autocast state and
lets autograd differentiate it, so gradients are those of the stock modules, bit for bit. The planner
counts these layouts (finetune.plan.activations, Setup.lean_modules).
"""
from __future__ import annotations

import torch

NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP"}


class _Recompute(torch.autograd.Function):
    """fn(*inputs) keeping only `inputs` for backward, where fn runs again with grad enabled."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        dev = inputs[0].device.type
        ctx.fn, ctx.dev = fn, dev
        ctx.amp = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.enable_grad(), torch.autocast(ctx.dev, dtype=ctx.amp[1], enabled=ctx.amp[0]):
            out = ctx.fn(*inputs)
        wanted = [x for x in inputs if x.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else [])
        return (None, *[next(got) if x.requires_grad else None for x in inputs])


def _lean_norm(module):
    stock = type(module).forward.__get__(module)

    def forward(hidden_states):
        if hidden_states.dtype == torch.float32:  # its own fp32 upcast: stock keeps the same (see above)
            return stock(hidden_states)
        return _Recompute.apply(stock, hidden_states)

    return forward


def _lean_mlp(module):
    # The activation's own forward, not the module call: hooks that module trackers (FlopCounterMode,
    # memory trackers) put on every module call would otherwise fire inside backward's recomputation, where
    # torch refuses their gradient hooks on its leaf inputs.
    act = getattr(module.act_fn, "forward", module.act_fn)

    def act_mul(gate, up):
        return act(gate) * up

    return lambda x: module.down_proj(_Recompute.apply(act_mul, module.gate_proj(x), module.up_proj(x)))


def apply(model, skip: set[int] = frozenset()) -> int:
    """Swap the forward of every frozen Llama-style RMSNorm and every gated MLP of `model` (once; the
    class's forward stays untouched), but those whose id is in `skip` (modules inside compiled layers:
    finetune.train.compiled). Returns how many modules were swapped."""
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if "forward" in vars(m) or id(m) in skip:
            continue
        if name in NORMS and not m.weight.requires_grad:
            m.forward = _lean_norm(m)
        elif name in MLPS and all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            m.forward = _lean_mlp(m)
        else:
            continue
        n += 1
    return n
