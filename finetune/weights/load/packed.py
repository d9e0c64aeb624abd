"""Each rank's part of a 4-bit weight under FSDP (1 or 2): the machine's reader quantizes the weight piece by
piece (quantize.piece_bounds) and sends every rank the packed bytes of its part as each piece is made. No
process holds the whole packed weight, nor more than one piece of the unquantized one: a rank receives only
what it keeps, and the reader keeps one piece beside its own part. The quantization state, which covers the
whole weight, is small and goes whole to every rank.

The packed bytes of a block-aligned piece are a contiguous run of the whole weight's packed bytes (the
first quantization level is independent per block), so a rank's span of packed elements is filled exactly
as cutting a plain load's packed weight would fill it (tests/integration/test_stream_load.py checks that
byte for byte). A pre-quantized checkpoint's packed bytes are a plain tensor: each rank's rows are read
and sent like any other.
"""
from __future__ import annotations

import torch

from finetune.weights.load.placement import comm_device
from finetune.weights.load.quantize import piece_bounds, quant_state, quantize_piece, read_pieces


def quantized_range(stream, entry, spans: dict) -> tuple[torch.Tensor, object]:  # stream: reader.Stream
    """(this rank's packed elements [start, stop) as a flat tensor, the weight's QuantState), where `spans`
    maps each global rank of this machine to its (start, stop) in packed elements (ranks that want nothing
    may be left out). Collective over the machine, in the same order on every rank."""
    from bitsandbytes.functional import QuantState

    pl, key = stream.placement, entry.key
    if stream.ckpt.prequantized:
        local = stream.plain_range(key, entry.q["quant_storage"], (entry.packed_elements(), 1), spans)
        stats = stream.ckpt.quant_stats(key) if pl.rank == pl.reader else None
    else:
        local, stats = _quantize_and_send(stream, entry, spans)
    if pl.world > 1:
        import torch.distributed as dist

        box = [stats]
        dist.broadcast_object_list(box, src=pl.reader, group=pl.group)
        stats = box[0]
    return local, QuantState.from_dict(dict(stats), device=pl.device)


def _quantize_and_send(stream, entry, spans: dict) -> tuple[torch.Tensor, dict | None]:
    """The reader quantizes piece by piece and sends each rank the part of every piece that falls in its
    span; the others receive theirs in place. Every rank walks the same pieces (piece_bounds)."""
    pl, q = stream.placement, entry.q
    comm, reading = comm_device(pl), pl.rank == pl.reader
    lo, hi = spans.get(pl.rank, (0, 0))
    local = torch.empty(max(0, hi - lo), dtype=q["quant_storage"], device=pl.device if reading else comm)
    pieces = read_pieces(stream.ckpt, entry, stream.dtype, pl.device) if reading else None
    total, absmax = entry.packed_elements(), []
    size = 2 * local.element_size()  # weight elements per packed element
    for start, stop in piece_bounds(entry)[1]:
        plo, phi = start // size, (stop // size if stop < entry.rows * entry.cols else total)
        if reading:
            packed, a = quantize_piece(next(pieces), q)
            packed = packed.view(-1)
            absmax.append(a)
        deliver(pl, spans, (plo, phi), packed if reading else None, local, lo)
        if reading:
            del packed
    if not reading:
        return local.to(pl.device), None
    shape = torch.Size((entry.rows, entry.cols))
    qs = quant_state(absmax, shape, stream.dtype, pl.device, q)
    return local, {k: v.cpu() if torch.is_tensor(v) else v for k, v in qs.as_dict(packed=True).items()}


def deliver(pl, spans: dict, piece_span: tuple[int, int], packed, local: torch.Tensor, lo: int) -> None:
    """One packed piece covering elements [plo, phi) of the weight: the reader (`packed` its bytes, None on
    the other ranks) copies its own part into `local` (which starts at element `lo`) and sends every other
    rank of the machine the part of the piece in that rank's span; those receive it in place."""
    import torch.distributed as dist

    plo, phi = piece_span
    comm, reading = comm_device(pl), pl.rank == pl.reader
    for r in range(pl.reader, pl.reader + pl.local_world):
        s, e = max(spans.get(r, (0, 0))[0], plo), min(spans.get(r, (0, 0))[1], phi)
        if e <= s:
            continue
        if reading and r == pl.rank:
            local[s - lo:e - lo].copy_(packed[s - plo:e - plo])
        elif reading:
            dist.send(packed[s - plo:e - plo].to(comm).contiguous().view(torch.uint8), dst=r)
        elif r == pl.rank:
            dist.recv(local[s - lo:e - lo].view(torch.uint8), src=pl.reader)
