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


def cpu_bf16_is_native() -> bool:
    """Whether torch multiplies bf16 matrices through oneDNN on this CPU (AVX512 or AMX). Without it (CPUs
    with AVX2 only) torch falls back to a scalar kernel: measured on a 2-core AMD EPYC with AVX2, 0.69
    GFLOP/s in bf16 against 35 in fp32, and the tiny recipe's steps 10x slower under bf16 autocast."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN has no fast bf16 path either
        return False


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


def release_cached_memory() -> None:
    """Hand memory the load no longer uses back to the device: on a GPU torch's caching allocator keeps the
    blocks of the load's transients reserved for the rest of the run (measured on an H200: the load phase of
    a 70B-width run, whose synthetic weights were drawn on the GPU in it, left 7.96 GiB reserved for steps
    that allocate 5.61), so empty its cache; on CPU return freed heap pages to the system (the same role)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from finetune.util.libc import trim_heap

    trim_heap()
