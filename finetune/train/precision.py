"""The compute precision of a run: the recipe's bf16/fp16 made fp32 where the CPU has no native bf16
(`resolve_cpu_precision`, before anything reads the precision), and the autocast every forward runs under.

Parameters keep their stored dtype (DESIGN.md: nothing is cast down): only the matmuls run in the low-precision
type under autocast, so fp32 master weights and fp32 buffers are preserved.
"""
from __future__ import annotations

import contextlib

import torch

from finetune.recipe import TrainSpec
from finetune.train.machine import cpu_bf16_is_native
from finetune.util.dtypes import autocast_dtype


@contextlib.contextmanager
def autocast(train: TrainSpec, device_type: str):
    """Autocast for a forward pass on `device_type` ("cuda", "cpu"): bf16/fp16 from `train.mixed_precision`;
    "no": nothing."""
    dtype = autocast_dtype(train.mixed_precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield


def resolve_cpu_precision(recipe, on_cpu: bool, native_bf16: bool | None = None):
    """(recipe, note): on a CPU without native bf16, the defaults `train.mixed_precision: bf16` and
    `quantization.compute_dtype: bfloat16` become fp32 compute (`no`, `float32`), since bf16 there costs 10x
    the time and saves nothing (model.dtype float32 keeps every stored weight in fp32 already). Values the
    recipe sets itself are kept, and a bf16 base (model.dtype bfloat16) is left alone: its weights would meet
    fp32 activations. `note` says what was done (or why bf16 will be slow), None when nothing applies."""
    t, q = recipe.train, recipe.quantization
    if not on_cpu or (cpu_bf16_is_native() if native_bf16 is None else native_bf16):
        return recipe, None
    uses_bf16 = t.mixed_precision == "bf16" or (q.mode in ("nf4", "fp4") and q.compute_dtype == "bfloat16")
    if not uses_bf16:
        return recipe, None
    slow = ("this CPU has no native bf16 matrix multiply (no AVX512/AMX: torch falls back to a scalar kernel, "
            "about 10x slower than fp32)")
    asked_bf16 = "mixed_precision" in t.model_fields_set and t.mixed_precision == "bf16"
    if recipe.model.dtype != "float32" or asked_bf16:
        return recipe, (f"precision: {slow}; the recipe asks for bf16, so it is kept. For speed here: "
                        "model.dtype: float32, train.mixed_precision: no, quantization.compute_dtype: float32")
    train = t if "mixed_precision" in t.model_fields_set else t.model_copy(update={"mixed_precision": "no"})
    quant = q
    if train.mixed_precision == "no" and q.compute_dtype == "bfloat16" and "compute_dtype" not in q.model_fields_set:
        quant = q.model_copy(update={"compute_dtype": "float32"})
    if train is t and quant is q:
        return recipe, None
    return (recipe.model_copy(update={"train": train, "quantization": quant}),
            f"precision: {slow}; computing in fp32 (train.mixed_precision: {train.mixed_precision}, "
            f"quantization.compute_dtype: {quant.compute_dtype}). Set them in the recipe to choose otherwise")
