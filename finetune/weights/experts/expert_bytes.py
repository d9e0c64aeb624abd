"""The packed 4-bit bytes of fused MoE experts (weights/experts/module.py), streamed: the machine's reader reads one
expert at a time (the hub's per-expert weights, stacked as transformers stacks them: reader.Checkpoint)
and quantizes it alone with bitsandbytes' quantize_4bit (quantize.quantize: block-aligned pieces, same
bytes), so no process holds more than one expert's unquantized weight. Whole: every rank gets every
expert's bytes; under FSDP each rank receives only the span of packed elements it keeps (expert e's bytes
are the run [e·m, (e+1)·m) of the parameter), as the reader makes them. The quantization state of all
experts is small and goes whole to every rank.
"""
from __future__ import annotations

import torch

from finetune.weights.experts.module import expert_parameter, stack_states
from finetune.weights.load.packed import deliver
from finetune.weights.load.placement import comm_device
from finetune.weights.load.quantize import quantize


def _quantized_expert(stream, entry, e: int) -> tuple[torch.Tensor, object]:
    """(flat packed bytes, QuantState) of expert e of `entry`, on the reader."""
    w = stream.ckpt.read_rows(entry.key, e, e + 1)[0].to(stream.placement.device, stream.dtype)
    packed, qs = quantize(w, entry.q)
    return packed.reshape(-1), qs


def _cpu(stats: dict) -> dict:
    return {k: v.cpu() for k, v in stats.items()}


def whole_experts(stream, entry) -> torch.nn.Parameter:
    """Every expert's packed bytes on every rank of the machine; the module gets the quantization state."""
    def make():
        packs, states = zip(*(_quantized_expert(stream, entry, e) for e in range(entry.experts)))
        return torch.cat(packs).reshape(-1, 1), _cpu(stack_states(list(states)))

    packed, stats = stream.share(make)
    entry.module.set_stats(entry.name, stats)
    return expert_parameter(packed, entry.shape)


def expert_range(stream, entry, spans: dict) -> torch.Tensor:
    """This rank's packed elements [start, stop) of `entry` (flat), where `spans` maps each global rank of the
    machine to its (start, stop); the module gets every expert's quantization state. Collective over the
    machine, in the same order on every rank."""
    import torch.distributed as dist

    pl = stream.placement
    reading, comm = pl.rank == pl.reader, comm_device(pl)
    lo, hi = spans.get(pl.rank, (0, 0))
    local = torch.empty(max(0, hi - lo), dtype=entry.q["quant_storage"], device=pl.device if reading else comm)
    m, states = entry.packed_elements() // entry.experts, []
    for e in range(entry.experts):
        plo, phi = e * m, (e + 1) * m
        if reading:
            packed, qs = _quantized_expert(stream, entry, e)
            states.append(qs)
        deliver(pl, spans, (plo, phi), packed if reading else None, local, lo)
    box = [_cpu(stack_states(states)) if reading else None]
    if pl.world > 1:
        dist.broadcast_object_list(box, src=pl.reader, group=pl.group)
    entry.module.set_stats(entry.name, box[0])
    return local.to(pl.device)
