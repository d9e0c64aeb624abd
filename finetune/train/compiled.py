"""`train.compile: true`: each decoder layer compiled with torch.compile (regional compilation).

One compiled function, `_layer_forward`, serves every decoder layer: dynamo keys its cache on that
function's code and (torch >= 2.5 inlines built-in nn.Modules) treats each layer's parameters as graph
inputs, not constants, so the layers share one graph (two in practice: the first layer's input does not
require grad, the others' do) and compile time does not grow with depth. The layer's own class `forward`
runs inside it, with transformers' gradient checkpointing (torch.utils.checkpoint, which dynamo captures
and AOT autograd recomputes) and peft's adapters; bitsandbytes' 4-bit matmuls are registered torch
custom ops, which stay opaque calls in the graph. FSDP's hooks stay outside: the compiled function is the
layer's `forward` (an instance attribute), and Module.__call__ runs the hooks around it.

Never a silent eager run: the compile is `fullgraph=True`, so a graph break is an error at a layer's first
call, and that layer then runs eager with one line that says why. Forwards without gradients (held-out
evaluation, DPO's reference pass) run eager: a handful of batches would not repay an inference graph's
compile, and it keeps "no compile after step 1" exact. Shapes are dynamic from the start, so batches of
new lengths reuse the graphs; `recompiles()` counts graphs made after step 1 (the loop logs it, a test
holds it at zero).
"""
from __future__ import annotations

import os
import time

import torch

from finetune.util.log import log

# Tests only (tests/...): the C++ code generation of inductor takes minutes on a 2-core CI machine for
# graphs that aot_eager (the same dynamo capture and AOT autograd split, eager kernels) makes in seconds.
# docs/gpu_paths.md. Unset, every run (CPU or GPU) compiles with inductor.
BACKEND_ENV = "FINETUNE_COMPILE_BACKEND"


def backend() -> str:
    return os.environ.get(BACKEND_ENV) or "inductor"


def _layer_forward(layer, *args, **kwargs):
    # The class's forward looked up at call time: FSDP2 re-classes the layers it shards, and transformers'
    # checkpointing wrapper checkpoints only when it is the outermost class's forward.
    return type(layer).forward(layer, *args, **kwargs)


def _dynamic_lengths(args, kwargs) -> None:
    """The sequence length marked dynamic on every tensor input of a layer call (hidden states [B, T, h],
    the mask's T dimensions, RoPE's cos/sin [B, T, d], positions [B, T]): batches of another length then
    reuse the graph instead of compiling one more. Only these dimensions: the weights never change shape, so
    theirs stay static (`dynamic=True` would make them symbolic too). The price, measured on the tiny model
    (aot_eager, a loaded 2-core machine): a dynamic-length graph took 134 s to make against 38 s for a static
    one, and a static one recompiles (66 s) at the first batch of another length."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    length = hidden.size(1)
    stack = [*args, *kwargs.values()]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
            # Dim 0 is the batch (fixed micro-batches). A [B, T, features] tensor's last dimension is a width
            # (hidden size, head_dim) even when it equals T: marking it would make a weight's shape dynamic.
            for d in (1,) if x.dim() == 3 else range(1, x.dim()):
                if x.size(d) == length:
                    torch._dynamo.mark_dynamic(x, d)


def _causal_mask_for_none(layer, args, kwargs) -> None:
    """An unpadded batch reaches the layers with `attention_mask=None` (transformers' SDPA mask builder skips the
    mask and asks SDPA for `is_causal`), a padded one with a boolean [B, 1, T, T] mask: two kinds of input, so
    the first unpadded batch after padded ones made new graphs (measured: 2 at step 36 of a 50-step FSDP2 run).
    Under SDPA the None is replaced by the causal mask the builder would have made (the same boolean, contiguous
    [B, 1, T, T]; every key up to the query's position), so every batch reaches the same graphs."""
    if kwargs.get("attention_mask", 0) is not None or getattr(
            getattr(layer, "self_attn", None), "config", None) is None:
        return
    attn = layer.self_attn
    if getattr(attn.config, "_attn_implementation", None) != "sdpa" or not getattr(attn, "is_causal", True):
        return
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.size(1) < 2:
        return
    b, t = hidden.size(0), hidden.size(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
    kwargs["attention_mask"] = causal.expand(b, 1, t, t).contiguous()


def _four_bit_linears(layer) -> list:
    from bitsandbytes.nn import Linear4bit

    return [m for m in layer.modules() if isinstance(m, Linear4bit)]


def _restore_quant_states(linears: list) -> None:
    """Under FSDP2 a layer's 4-bit weight is, once gathered, a plain tensor without its quantization state,
    which bitsandbytes' Linear4bit.forward re-wraps as a Params4bit on every call: a tensor mutation dynamo
    refuses ("Failed to mutate tensor data attribute", measured: every layer fell back to eager). Done here,
    eagerly, after FSDP's pre-forward hook gathered the weights and before the compiled forward, the same
    bitsandbytes call finds nothing left to do inside the graph. One process: a no-op (the state is there)."""
    if linears:
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

        for m in linears:
            fix_4bit_weight_quant_state_from_module(m)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' GradientCheckpointingLayer modules (what its checkpointing
    acts on), outermost first, each once."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def graphs_made() -> int:
    """Graphs dynamo has made in this process (a recompile makes one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledLayers:
    """The decoder layers of a model with `_layer_forward` compiled as their forward (see the module doc)."""

    def __init__(self, model: torch.nn.Module, backend_name: str | None = None):
        self.backend = backend_name or backend()
        self.layers = decoder_layers(model)
        if not self.layers:
            from finetune.util.errors import RecipeError

            raise RecipeError([f"train.compile: {type(model).__name__} has no transformers decoder layers "
                               "(GradientCheckpointingLayer) to compile. Fix: train.compile: false"])
        self.fn = torch.compile(_layer_forward, backend=self.backend, fullgraph=True)
        self.eager: dict[int, str] = {}  # layer index -> why it runs eager
        self.called: set[int] = set()
        self.start = graphs_made()
        self.after_step1: int | None = None
        self.step1_s: float | None = None
        self._t0 = time.perf_counter()
        self.four_bit = [_four_bit_linears(layer) for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.forward = self._forward(i, layer)

    def inner_modules(self) -> set[int]:
        """ids of every module inside a compiled layer (the lean modules stay out of them: their autograd
        Function's backward calls torch.autograd.grad, a graph break; AOT autograd's partitioner decides
        what a compiled layer saves and recomputes instead)."""
        return {id(m) for layer in self.layers for m in layer.modules()}

    def _forward(self, i: int, layer):
        def forward(*args, **kwargs):
            if i in self.eager or not (layer.training and torch.is_grad_enabled()):
                return _layer_forward(layer, *args, **kwargs)
            _causal_mask_for_none(layer, args, kwargs)
            _dynamic_lengths(args, kwargs)
            _restore_quant_states(self.four_bit[i])
            if i in self.called:
                return self.fn(layer, *args, **kwargs)
            if not self.called:
                self._t0 = time.perf_counter()  # the first compiled call: step 1's forward begins
            self.called.add(i)
            try:
                return self.fn(layer, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a layer that cannot compile runs eager, and says so
                reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                self.eager[i] = f"{type(e).__name__}: {reason}"
                log.warning(f"compile: decoder layer {i} ({type(layer).__name__}) runs eager, it did not "
                            f"compile: {self.eager[i]}")
                return _layer_forward(layer, *args, **kwargs)

        return forward

    def step_done(self, step: int) -> None:
        """After each optimizer step: step 1 made the graphs; say what was compiled, once."""
        if self.after_step1 is None:
            self.after_step1, self.step1_s = graphs_made(), time.perf_counter() - self._t0
            compiled = len(self.layers) - len(self.eager)
            log.info(f"compile: {compiled} of {len(self.layers)} decoder layers compiled ({self.backend}) into "
                     f"{self.after_step1 - self.start} graphs; step {step} took {self.step1_s:.1f} s from its "
                     "first forward, the compile included")

    def recompiles(self) -> int:
        """Graphs made after step 1 (0 before step 1 ends)."""
        return 0 if self.after_step1 is None else graphs_made() - self.after_step1


def compile_layers(model, enabled: bool) -> CompiledLayers | None:
    """`train.compile`: the unwrapped model's decoder layers compiled in place (after the wrap: FSDP2 has
    re-classed them), or None when off."""
    return CompiledLayers(model) if enabled else None
