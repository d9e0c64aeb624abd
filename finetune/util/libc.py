"""glibc's calls: memory handed back to the OS (loaders, merge), and the parent-death signal (workers)."""
from __future__ import annotations

import functools
import sys


@functools.lru_cache(maxsize=1)
def glibc():
    """glibc through ctypes, or None (another C library, another OS): callers then skip their memory tuning
    and run the same, only with a higher peak."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not (name and sys.platform.startswith("linux")):
        return None
    try:
        lib = ctypes.CDLL(name)
        return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


def trim_heap() -> None:
    """malloc_trim: return the heap's free pages to the OS. Measured on the loader's reader: without a trim
    after each piece, quantizing one 5632 x 2048 weight left the heap ~90 MiB larger (four times the bf16
    weight: each piece's temporaries landed beside the pieces kept), most of a reader's extra peak; the
    merge trims after each output shard for the same reason."""
    lib = glibc()
    if lib is not None:
        lib.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # <malloc.h>


def map_large_buffers(threshold: int = 1 << 20) -> None:
    """Serve every allocation of `threshold` bytes or more (tensors) by its own mmap, so freeing it returns it
    to the OS at once. glibc's default threshold grows to the largest block freed so far (up to 32 MiB on
    64-bit), after which tensors come from the heap and their freed space stays in the process. Measured:
    the merge's peak varied 667-695 / 728-782 MB run to run on 200 / 400 MB models, and 583 / 615 MB with a
    fixed 1 MiB threshold; a 2-process FSDP2 run on CPU kept 0.8-1.2 GiB per rank after its training steps
    (benchmarks/cpu/phase_rss.py), which a fixed threshold hands back. Process-wide and permanent: it changes
    only where large blocks come from. Host memory only: a GPU's tensors are CUDA's caching allocator's."""
    lib = glibc()
    if lib is not None:
        lib.mallopt(M_MMAP_THRESHOLD, threshold)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent exits (prctl PR_SET_PDEATHSIG), so a
    worker whose launcher was SIGKILLed hears of it at once. False where it is not available (not Linux)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return lib.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):
        return False
