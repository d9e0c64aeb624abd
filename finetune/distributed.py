"""Accelerator from the recipe, autocast policy, and rank-zero helpers.

Minimal single-process version; the FSDP/DDP construction lands on top of this interface.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .recipe import DistributedSpec, FsdpSpec, TrainSpec

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs):
    """Print once per job (rank 0 only), flushed so logs interleave sanely."""
    if is_main():
        print(*args, **kwargs, flush=True)


def make_accelerator(dist: DistributedSpec, fsdp: FsdpSpec, train: TrainSpec, model_dtype: str):
    from accelerate import Accelerator

    # mixed_precision="no": Accelerate must not cast parameters (that would cast packed 4-bit storage);
    # bf16 compute comes from `autocast` below around the forward only.
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")


def autocast(train: TrainSpec, device_type: str):
    """bf16/fp16 autocast over fp32 master weights and buffers; a no-op for mixed_precision: no."""
    if train.mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST[train.mixed_precision])
