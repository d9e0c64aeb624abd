"""Handing the memory a load frees back to the OS, and keeping that cheap (weights.load.reader, weights.load.skeleton,
weights.shard.fsdp2, weights.shard.fsdp1): Python's cycle collector for the objects a loaded weight leaves in cycles, glibc's
malloc_trim (util.libc) for the heap pages it keeps.
"""
from __future__ import annotations

import contextlib

from finetune.util.libc import trim_heap


def release_freed_memory() -> None:
    """Give the memory of the tensors just dropped back to the OS. A loaded tensor is freed right after its
    shard is kept, but (measured on CPU) the process keeps most of it: some go only with Python's cycle
    collector (bitsandbytes' parameter and state objects), and glibc keeps freed mid-size blocks in its
    heap once its mmap threshold has grown to the largest tensor freed so far. Without this, a rank's RSS
    after loading its half of a model was two to three times that half. Called once a weight: callers
    hold `loading_objects_only()` around the loop so each collection is cheap."""
    import gc

    gc.collect()
    trim_heap()


_frozen_depth = 0


@contextlib.contextmanager
def loading_objects_only():
    """While active, Python's cycle collector sees only objects made since it began (gc.freeze): a full
    collection over everything the libraries import (~500k objects with transformers 5) took 0.26 s, paid
    once a weight by `release_freed_memory` (10 s of the tiny model's 39-weight load; minutes at 70B);
    over what loading makes it takes well under 1 ms. Objects alive before never become loading's garbage,
    so nothing collectable is hidden. Nests; the outermost exit unfreezes."""
    import gc

    global _frozen_depth
    if _frozen_depth == 0:
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def release_cached_memory() -> None:
    """Hand memory the load no longer uses back to the device: on a GPU torch's caching allocator keeps the
    blocks of the load's transients reserved for the rest of the run (measured on an H200: the load phase of
    a 70B-width run, whose synthetic weights were drawn on the GPU in it, left 7.96 GiB reserved for steps
    that allocate 5.61), so empty its cache; on CPU return freed heap pages to the system (the same role)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_heap()
