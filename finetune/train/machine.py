"""What the machine can do, checked before a run relies on it: whether the GPU that is installed is usable
(a device is never silently swapped for the CPU) and whether bf16 runs natively (on the GPU or the CPU)."""
from __future__ import annotations

import glob
import os

import torch


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


def cpu_bf16_is_native() -> bool:
    """Whether torch multiplies bf16 matrices through oneDNN on this CPU (AVX512 or AMX). Without it (CPUs
    with AVX2 only) torch falls back to a scalar kernel: measured on a 2-core AMD EPYC with AVX2, 0.69
    GFLOP/s in bf16 against 35 in fp32, and the tiny recipe's steps 10x slower under bf16 autocast."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN has no fast bf16 path either
        return False
