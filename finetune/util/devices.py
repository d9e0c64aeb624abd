"""What GPUs this machine has, asked of torch only where a GPU can exist.

The planner and `finetune validate` stay torch-free on machines without GPUs: torch is imported (seconds)
only when it already is, or when an NVIDIA or ROCm device node exists.
"""
from __future__ import annotations

import glob
import os
import sys


def cuda_facts() -> tuple[int, bool, int | None]:
    """(device count, bf16 supported, memory of device 0 in bytes)."""
    if "torch" not in sys.modules and not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return 0, False, None
    import torch

    if not torch.cuda.is_available():
        return 0, False, None
    return torch.cuda.device_count(), torch.cuda.is_bf16_supported(), torch.cuda.get_device_properties(0).total_memory
