"""`python -m benchmarks.gpu.capped GIB ARGS...`: `finetune ARGS...` in a process whose CUDA allocator may hold
at most GIB GiB (torch.cuda.set_per_process_memory_fraction): a smaller card on a larger one, for the
long_context stage. Without CUDA (the dry run) it runs finetune uncapped."""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import torch

    gib, args = float(argv[0]), argv[1:]
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), 0)
    from finetune.cli import main as finetune_main

    return finetune_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
