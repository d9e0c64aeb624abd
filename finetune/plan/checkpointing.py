"""`model.gradient_checkpointing` against memory: how many decoder layers recompute in backward, and the one
line that says so (training, `validate` and `estimate` print the same words).

`auto` takes the fewest checkpointed layers whose planned step peak fits the budget: one device's memory (a
GPU's; on a CPU run the RAM one process can have), or `model.max_memory_gib` where that is lower. The figure
compared already carries the plan's usual headroom (on a GPU the allocator slack and the CUDA context:
estimate.build), so nothing more is taken off. Checkpointing one more layer trades its saved tensors for its
input (plan.activations), so the peak falls as layers are added and the fewest that fit is found by bisection.
An integer is planned as given; true and false keep their meaning (all layers, none).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.plan import estimate as E
from finetune.plan.activations import checkpointed_layers
from finetune.plan.archs import Arch, resolve
from finetune.util.units import GiB


@dataclass(frozen=True)
class Choice:
    setting: object  # the recipe's value: True, False, a layer count or "auto"
    layers: int  # decoder layers checkpointed: the first ones (train.lora.enable_checkpointing)
    total: int  # decoder layers of the model
    planned: int  # bytes per device at the steps' peak with this choice (peak_bytes)
    budget: int | None  # what it was planned against
    flops_saved: float  # share of a step's FLOPs saved against checkpointing every layer

    def line(self) -> str:
        """`gradient checkpointing: auto -> 12 of 32 layers (plan 61.8 of 79.1 GiB; 11% fewer FLOPs a step
        than all 32)`."""
        head = "auto -> " if self.setting == "auto" else ""
        mem = f"plan {self.planned / GiB:.1f}" + (f" of {self.budget / GiB:.1f} GiB" if self.budget else " GiB")
        notes = [mem]
        if self.setting == "auto" and not self.budget:
            notes.append("no memory to plan against: give --gpu-memory or model.max_memory_gib")
        elif self.budget and self.planned > self.budget:
            notes.append("does not fit even so")
        if self.layers < self.total:
            notes.append(f"{100 * self.flops_saved:.0f}% fewer FLOPs a step than all {self.total}")
        return f"gradient checkpointing: {head}{self.layers} of {self.total} layers ({'; '.join(notes)})"


def budget(device_memory: int | None, cap_gib: float | None) -> int | None:
    """The bytes `auto` plans against: the device's memory, or the recipe's cap (model.max_memory_gib) below it."""
    caps = [b for b in (device_memory, int(cap_gib * GiB) if cap_gib else None) if b]
    return min(caps) if caps else None


def peak_bytes(p: E.Plan) -> int:
    """The figure a budget holds: a GPU's planned bytes (slack and context included), or on a CPU run one
    process's planned RAM while it trains (what its peak RSS measures: train.keepers.memory.planned)."""
    if p.setup.device == "cuda":
        return p.gpu_bytes_per_device
    return p.cpu["training"] // p.setup.per_machine


def layer_forward_flops(arch: Arch, seq: int) -> int:
    """Per token, one decoder layer's forward: its linears (routed experts only) and attention's scores and
    weighted sum over `seq` positions (as benchmarks/flops.py counts them)."""
    lin = sum(x.d_in * x.d_out * (min(x.count, arch.experts_per_tok) if x.count > 1 and arch.experts_per_tok
                                  else x.count) for x in arch.linears())
    return 2 * lin + 4 * seq * arch.heads * arch.head_dim


def flops_saved(arch: Arch, seq: int, k: int) -> float:
    """Share of a step with every layer checkpointed that checkpointing only `k` saves. Without recompute a
    frozen-base step is a forward and a backward of twice its FLOPs (input gradients only; the adapters
    are a rounding error); each checkpointed layer adds one forward of itself."""
    layer, head = layer_forward_flops(arch, seq), 2 * arch.vocab * arch.hidden
    all_checkpointed = 3 * (arch.layers * layer + head) + arch.layers * layer
    return (arch.layers - k) * layer / all_checkpointed


def fit(s: E.Setup, arch: Arch | None = None, source: str = "", budget_bytes: int | None = None,
        offset: int = 0) -> tuple[E.Plan, Choice]:
    """The plan of `s` with its checkpointing resolved, and the choice. `auto` without a budget plans every
    layer (the safe default), and says so. `offset`: bytes added to every planned peak (a CPU run whose
    process started above or below the plan's constant: train.recompute.resolve)."""
    if arch is None:
        arch, source = resolve(s.model)
    plans: dict[int, E.Plan] = {}

    def plan(k: int) -> E.Plan:
        if k not in plans:
            plans[k] = E.build(replace(s, checkpointing=k), arch, source)
        return plans[k]

    if s.checkpointing == "auto" and budget_bytes:
        lo, hi = 0, arch.layers
        if peak_bytes(plan(hi)) + offset <= budget_bytes:  # else nothing fits: every layer, and the line says so
            while lo < hi:  # the fewest k whose peak fits
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if peak_bytes(plan(mid)) + offset <= budget_bytes else (mid + 1, hi)
        k = hi
        p = plan(k)
    else:
        k = checkpointed_layers(arch, s)
        p = E.build(s, arch, source)
    saved = flops_saved(arch, s.seq_len, k)
    return p, Choice(s.checkpointing, k, arch.layers, peak_bytes(p) + offset, budget_bytes, saved)
