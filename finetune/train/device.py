"""Where tensors go, and whether the GPU that should be there is usable.

One helper moves inputs to where the model lives (`to_model_device`): training, `eval`, `generate` and the
merge's parity check all use it, so a 4-bit model that bitsandbytes placed on `cuda:0` never meets a batch
left on the CPU. `cuda_unusable_reason` refuses to train on the CPU when a GPU is installed but torch
cannot use it (a device is never silently swapped).
"""
from __future__ import annotations

import glob
import os

import torch


def model_device(model) -> torch.device:
    """The device of the model's first parameter: where transformers puts the embedding, so where the
    inputs must be (a 4-bit model loads onto the current CUDA device when one is available)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on `device` (other values unchanged). The only place inputs are moved."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def to_model_device(model, batch: dict) -> dict:
    return to_device(batch, model_device(model))


def gpu_device_nodes() -> list[str]:
    """NVIDIA device nodes (/dev/nvidia0...) and ROCm's /dev/kfd: a GPU is installed here."""
    return glob.glob("/dev/nvidia[0-9]*") + (["/dev/kfd"] if os.path.exists("/dev/kfd") else [])


def cuda_unusable_reason(nodes: list[str] | None = None) -> str | None:
    """Why torch cannot use the GPU this machine has, or None (CUDA usable, or no GPU installed).

    `torch.cuda.is_available()` is False both on a machine without GPUs and on one whose driver is older
    than the wheel's CUDA (or with a CPU-only wheel); only the first may train on the CPU.
    """
    if torch.cuda.is_available():
        return None
    nodes = gpu_device_nodes() if nodes is None else nodes
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not nodes or visible in ("", "-1"):  # no GPU, or GPUs hidden on purpose
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return (f"a GPU is installed ({nodes[0]}) but this torch build has no CUDA (torch {torch.__version__}). "
                "Fix: install a CUDA build of torch, or hide the GPU with CUDA_VISIBLE_DEVICES=-1 to train on CPU")
    try:
        torch.cuda.init()  # raises with the driver's own reason (e.g. "driver ... is too old")
        why = "torch.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001 - any failure here is the reason to report
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"a GPU is installed ({nodes[0]}) but CUDA is unusable: {why}. Fix: update the NVIDIA driver to "
            f"one that supports CUDA {torch.version.cuda}, or hide the GPU with CUDA_VISIBLE_DEVICES=-1 to "
            "train on CPU")


def bf16_native(capability: tuple[int, int] | None) -> bool:
    """bf16 runs natively from compute capability 8.0 (Ampere) on. `torch.cuda.is_bf16_supported()` is
    also True on a T4 (7.5), where bf16 is emulated and several times slower than fp16."""
    return capability is not None and tuple(capability) >= (8, 0)


def restore_cuda_rng(states: list) -> int:
    """Restore the CUDA generators of the devices that exist here; returns how many were restored. A
    checkpoint written with more visible GPUs than this process has would fail `set_rng_state_all`."""
    if not torch.cuda.is_available():
        return 0
    n = min(len(states), torch.cuda.device_count())
    for i in range(n):
        torch.cuda.set_rng_state(states[i], i)
    return n
