"""4-bit quantization as transformers' loader quantizes (bitsandbytes' quantize_4bit), piece by piece, so
neither the reader nor the kernel's temporaries ever hold a whole unquantized weight."""
from __future__ import annotations

import torch

from finetune.util.libc import trim_heap

QUANT_CHUNK = 2**18  # elements quantized at once: a multiple of every block size and storage width


def quantize(weight: torch.Tensor, q: dict) -> tuple[torch.Tensor, object]:
    """Quantize one weight exactly as transformers' loader does (Params4bit(...).to(device), that is
    bitsandbytes.functional.quantize_4bit), with the weight's block size, double quantization (`q`: the load plan's entry.q), type and
    storage dtype, but QUANT_CHUNK elements at a time.

    Why not one call: bitsandbytes' kernel works on the whole tensor at once, and on CPU its reference
    kernel holds about 13 bytes of temporaries per element (a float32 copy, int32 codes, ...): 150 MB for
    one 2048 x 5632 weight, more than the packed model of a small run. The first quantization level is
    independent per block of `blocksize` elements, so the same kernel over block-aligned pieces gives the
    same packed bytes and absmax; the second level (double quantization: the absmax minus its mean,
    quantized in blocks of 256) runs once on the whole absmax, as bitsandbytes runs it. The result equals
    quantize_4bit's byte for byte (tests/unit/test_stream_quantize.py)."""
    flat = weight.reshape(-1)
    pieces = (flat[start:start + QUANT_CHUNK] for start in range(0, flat.numel(), QUANT_CHUNK))
    return quantize_pieces(pieces, weight.shape, weight.dtype, weight.device, q)


def quantize_from(ckpt, entry, dtype: torch.dtype, device) -> tuple[torch.Tensor, object]:
    """`quantize` of the checkpoint's weight `entry.key`, read piece by piece (read_pieces), so the reader never
    holds the whole unquantized weight either."""
    pieces = read_pieces(ckpt, entry, dtype, device)
    return quantize_pieces(pieces, torch.Size((entry.rows, entry.cols)), dtype, device, entry.q)


def piece_bounds(entry) -> tuple[bool, list[tuple[int, int]]]:
    """(by rows, the [start, stop) flat element ranges) of the pieces a 4-bit weight is quantized in: blocks
    of whole rows of about QUANT_CHUNK elements, read alone. A block must be a whole number of quantization
    blocks for the result to equal quantize_4bit's; when the row length does not allow it (no real
    model's), QUANT_CHUNK elements at a time of the weight read whole. Every rank can compute them."""
    rows, cols = entry.rows, entry.cols
    step = max(1, QUANT_CHUNK // cols)
    if (step * cols) % entry.q["blocksize"]:
        n = rows * cols
        return False, [(a, min(a + QUANT_CHUNK, n)) for a in range(0, n, QUANT_CHUNK)]
    return True, [(s * cols, min(s + step, rows) * cols) for s in range(0, rows, step)]


def read_pieces(ckpt, entry, dtype: torch.dtype, device):
    """The pieces of `piece_bounds`, read, cast and flattened, one at a time."""
    by_rows, bounds = piece_bounds(entry)
    key, cols = entry.key, entry.cols
    if by_rows:
        for a, b in bounds:
            yield ckpt.read_rows(key, a // cols, b // cols).to(device, dtype).reshape(-1)
        return
    flat = ckpt.read(key).to(device, dtype).reshape(-1)
    for a, b in bounds:
        yield flat[a:b]


def quantize_pieces(pieces, shape: torch.Size, dtype: torch.dtype, device, q: dict) -> tuple[torch.Tensor, object]:
    """quantize_4bit of the weight whose flat elements are the concatenation of `pieces`, each (but the
    last) a whole number of quantization blocks."""
    packed, absmax = [], []
    for piece in pieces:
        p, a = quantize_piece(piece, q)
        packed.append(p)
        absmax.append(a)
        del piece, p, a
    return torch.cat(packed), quant_state(absmax, shape, dtype, device, q)


def quantize_piece(piece: torch.Tensor, q: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, absmax) of one block-aligned piece: bitsandbytes' first quantization level alone."""
    # bitsandbytes' registered op, by its schema's argument names: a changed schema fails here, loudly
    p, a = torch.ops.bitsandbytes.quantize_4bit.default(A=piece, blocksize=q["blocksize"], quant_type=q["quant_type"],
                                                        quant_storage=q["quant_storage"])
    trim_heap()  # the kernel's ~13 bytes/element of temporaries (see quantize), freed but kept by malloc
    return p, a


def quant_state(absmax: list, shape: torch.Size, dtype: torch.dtype, device, q: dict):
    """The QuantState of a weight from its pieces' absmax: the second level (double quantization: the absmax
    minus its mean, in blocks of 256) runs once on the whole absmax, as bitsandbytes runs it."""
    import bitsandbytes.functional as F

    absmax = torch.cat(absmax)
    code = F.get_4bit_type(q["quant_type"], device=device)
    common = dict(shape=shape, dtype=dtype, blocksize=q["blocksize"], code=code, quant_type=q["quant_type"])
    if not q["compress_statistics"]:
        return F.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    return F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)
