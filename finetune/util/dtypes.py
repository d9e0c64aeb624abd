"""Every spelling of a dtype the project meets, mapped to torch's, in one place.

Recipes say `float32` / `bfloat16` / `float16` (and `uint8` for 4-bit storage); mixed precision says
`bf16` / `fp16` / `no`; `merge --dtype` says `bf16` / `fp16` / `fp32`; safetensors headers say `BF16`, `F32`...
torch is imported when a function is called, so the torch-free layers can import the names.
"""
from __future__ import annotations

SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SAFETENSORS_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def torch_dtype(name: str):
    """torch dtype from a recipe name (`bfloat16`), a short name (`bf16`) or a safetensors code (`BF16`)."""
    import torch

    name = SHORT_NAMES.get(name, SAFETENSORS_NAMES.get(name, name))
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def autocast_dtype(mixed_precision: str):
    """The autocast dtype of `train.mixed_precision` (bf16 / fp16), None for `no`."""
    return None if mixed_precision == "no" else torch_dtype(mixed_precision)


def recipe_name(dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, as config.json and recipes write it."""
    return str(dtype).removeprefix("torch.")
