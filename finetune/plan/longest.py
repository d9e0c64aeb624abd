"""`finetune estimate RECIPE --max-seq-len`: the longest data.max_seq_len a recipe trains at micro-batch 1
on a GPU of a given memory, by the memory plan's own fit check, with and without activation offloading
and the tiled MLP, and what stops it from going longer: the GPU's memory (the plan's largest term named)
or, with offloading, the host RAM that holds every layer's input.

Lengths are multiples of STEP tokens. The plan grows with the length, so a binary search over those
multiples finds the longest that fits; the answer is held to "fits at L, not at L + STEP" by a test.
"""
from __future__ import annotations

from dataclasses import replace

from finetune.plan.activations import activation_terms
from finetune.plan.estimate import Plan, Setup, build

STEP = 1024  # tokens: the answer's granularity (a whole number of the loss path's and attention's blocks)
MAX_TOKENS = 2**24  # 16M tokens: the search's ceiling (no GPU of today holds one layer input beyond it)


def at_length(s: Setup, tokens: int) -> Plan:
    """The plan at micro-batch 1 (one pair for preference methods, which forward both sides at once)."""
    return build(replace(s, seq_len=tokens, micro_batch=1 if s.method == "sft" else 2))


def short_of(p: Plan, host_memory: int | None) -> list[str]:
    """What a plan does not fit: "GPU" (its per-device total over the GPU's memory) and "host RAM" (its
    CPU peak per machine over host_memory, when given)."""
    out = []
    if p.gpu_bytes_per_device > p.setup.gpu_memory:
        out.append("GPU")
    if host_memory is not None and p.cpu_bytes_peak > host_memory:
        out.append("host RAM")
    return out


def longest(s: Setup, host_memory: int | None = None) -> int:
    """The longest multiple of STEP tokens whose plan fits (0: not even STEP fits)."""
    fits = lambda n: not short_of(at_length(s, n * STEP), host_memory)  # noqa: E731
    lo, hi = 0, 1
    while hi * STEP <= MAX_TOKENS and fits(hi):  # double until it does not fit: lo fits, hi does not
        lo, hi = hi, hi * 2
    if hi * STEP > MAX_TOKENS:
        return lo * STEP
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * STEP


def limit(s: Setup, tokens: int, host_memory: int | None) -> str:
    """Why `tokens + STEP` does not fit, in words: the resource and, for the GPU, its largest term."""
    over = at_length(s, tokens + STEP)
    why = short_of(over, host_memory)
    if not why:
        return f"the search's ceiling ({MAX_TOKENS} tokens)"
    words = []
    if "GPU" in why:
        term = max((k for k in over.breakdown if k != "framework_overhead"), key=over.breakdown.get)
        part = ""
        if term == "activations":  # which part of it: the held layer inputs or one layer's backward
            act = activation_terms(over.arch, over.setup)
            part = (f": layer inputs held {act['_held'] / 2**30:.1f} GiB, one layer's backward "
                    f"{act['_per_layer'] / 2**30:.1f} GiB")
        words.append(f"GPU memory (largest term: {term}, {over.breakdown[term] / 2**30:.1f} GiB{part})")
    if "host RAM" in why:
        words.append(f"host RAM ({max(over.cpu, key=over.cpu.get)}: {over.cpu_bytes_peak / 2**30:.1f} GiB)")
    return " and ".join(words)


def variants(s: Setup) -> list[tuple[str, Setup]]:
    """The recipe as written, then every combination of activation offloading (a GPU run's) and the
    tiled MLP (true: chunks of hidden_size tokens, unless the recipe sets its own)."""
    tile = s.tiled_mlp if s.tiled_mlp is not False else True
    offloads = (False, True) if s.device == "cuda" else (False,)
    out = [("recipe", s)]
    for off in offloads:
        for t in (False, tile):
            name = f"offloading {'on' if off else 'off'}, tiled MLP {'off' if t is False else 'on'}"
            out.append((name, replace(s, activation_offload=off, tiled_mlp=t)))
    return out


def table(s: Setup, host_memory: int | None = None) -> list[dict]:
    """One row per variant: the longest length, its plan's GPU and host figures, and what limits it."""
    rows = []
    for name, v in variants(s):
        n = longest(v, host_memory)
        p = at_length(v, max(n, STEP))
        rows.append({"variant": name, "max_seq_len": n, "gpu_bytes": p.gpu_bytes_per_device,
                     "host_bytes": p.cpu_bytes_peak, "limit": limit(v, n, host_memory),
                     "activation_offloading": v.activation_offload, "tiled_mlp": v.tiled_mlp})
    return rows


def render(s: Setup, rows: list[dict], host_memory: int | None) -> str:
    from finetune.util.units import fmt

    host = f"host RAM {fmt(host_memory)} per machine" if host_memory else "host RAM not checked (--host-memory)"
    lines = [f"longest data.max_seq_len at micro-batch 1 for {s.model} on {s.gpus} x {fmt(s.gpu_memory)} GPU, "
             f"{host} (multiples of {STEP} tokens):"]
    for r in rows:
        lines.append(f"  {r['variant']:<36} {r['max_seq_len']:>9,} tokens  GPU {fmt(r['gpu_bytes']):>10}  "
                     f"host {fmt(r['host_bytes']):>10}  limit: {r['limit']}")
    return "\n".join(lines)
