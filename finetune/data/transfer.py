"""Moving batches to where the model computes: the one place inputs are moved (training, `eval`, `generate`
and the merge's parity check all use it), so a 4-bit model that bitsandbytes placed on `cuda:0` never meets a
batch left on the CPU."""
from __future__ import annotations

import torch


def model_device(model) -> torch.device:
    """The device of the model's first parameter: where transformers puts the embedding, so where the
    inputs must be (a 4-bit model loads onto the current CUDA device when one is available)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on `device` (other values unchanged). The only place inputs are moved. To a GPU
    they go through pinned host memory, asynchronously: a copy from pageable memory makes the host wait
    for the GPU to reach it (measured: three waits per micro-batch on an H200); torch's pinned allocator
    keeps the staging buffer until the copy has run."""
    device = torch.device(device)
    if device.type == "cuda":  # pinned memory is a CUDA driver allocation: no such thing without a GPU
        return {k: v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) and v.device.type == "cpu"
                else v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def to_model_device(model, batch: dict) -> dict:
    return to_device(batch, model_device(model))
