"""Tensors of a safetensors file, or rows of one, read into memory this process owns.

Why not safe_open's `get_tensor` / `get_slice`: at safetensors 0.8 both return views of a private map of the
file, not copies. A parameter built on such a view keeps the map for the whole run. Its pages are not
resident until something touches them, so a load looks smaller than it is (measured on the 1-process
load: its RSS growth was 64 MiB short of the bytes it held, the embedding and the head, which the first
forward then pulls in), and a file rewritten under a running job (the cache is shared) changes or faults
its weights. A positioned read copies once, through the page cache, which no process's RSS counts.

The format is the documented one: 8 bytes (little-endian length N), N bytes of JSON header giving each
tensor's dtype, shape and [begin, end) byte offsets from the end of the header, then the data, row-major.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
          "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def header(path: Path) -> tuple[int, dict]:
    """(where the data starts, {key: {"dtype", "shape", "data_offsets"}}) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return 8 + n, entries


def read_rows(path: Path, head: tuple[int, dict], key: str, start: int | None = None,
              stop: int | None = None) -> torch.Tensor:
    """Tensor `key` of the file (`head` is its `header`), or its rows [start, stop) along dim 0, as a new
    CPU tensor."""
    base, entries = head
    entry = entries[key]
    shape, (lo, hi) = list(entry["shape"]), entry["data_offsets"]
    if shape and start is not None:
        row = (hi - lo) // shape[0] if shape[0] else 0
        lo, hi = lo + start * row, lo + stop * row
        shape[0] = stop - start
    out = torch.empty(hi - lo, dtype=torch.uint8)
    view, done = memoryview(out.numpy()), 0
    with open(path, "rb", buffering=0) as f:
        while done < hi - lo:  # one pread may return less than asked (Linux caps one call near 2 GiB)
            got = os.preadv(f.fileno(), [view[done:]], base + lo + done)
            if got <= 0:
                raise OSError(f"{path}: the file ends inside tensor '{key}'")
            done += got
    return out.view(DTYPES[entry["dtype"]]).reshape(shape)
