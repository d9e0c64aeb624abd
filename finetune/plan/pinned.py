"""Host (CPU) memory of what FSDP's CPU offload and activation offloading keep in pinned memory.

Two facts of the libraries decide it, beyond the tensors' own sizes:
- torch's pinned-memory allocator (CachingHostAllocator) rounds every allocation up to a power of two.
- FSDP1's CPU offload pins each flat parameter's local shard and pre-allocates a pinned gradient of the
  same size for it (torch/distributed/fsdp/_flat_param.py, init_flat_param_attributes), frozen flat
  parameters (the whole 4-bit base) included; FSDP2's CPUOffloadPolicy pins each parameter's shard and
  keeps gradients only for parameters that train.
- FSDP1 pins at its lazy init (the first forward), for every flat parameter at once, and the unpinned
  shard it copied from stays alive as `flat_param.data` until that unit's first unshard (same file,
  `init_flat_param_attributes` then `pre_unshard`): until the first forward has run through every unit,
  each process holds three copies of its shards. FSDP2 pins one parameter at a time at wrap time.
"""
from __future__ import annotations


def pow2(n: int) -> int:
    """The size the pinned-memory allocator reserves for an n-byte request."""
    return 1 << (max(1, n) - 1).bit_length()


def fsdp_offload_bytes(unit_bytes: list[int], tensor_bytes: list[int], trained: int, shard: int,
                       version: int) -> int:
    """Pinned bytes one process holds for FSDP CPU offload. `unit_bytes`: the parameter bytes of each
    wrapped unit (FSDP1 flattens a unit into one tensor); `tensor_bytes`: each parameter's bytes
    (FSDP2 shards them one by one); `trained`: bytes of the trainable parameters."""
    if version == 1:
        return sum(2 * pow2(-(-u // shard)) for u in unit_bytes)  # local shard + its pinned gradient
    return sum(pow2(-(-t // shard)) for t in tensor_bytes) + pow2(-(-trained // shard))


def fsdp1_start_extra_bytes(unit_bytes: list[int], shard: int) -> int:
    """FSDP1 with CPU offload: the unpinned local shards still alive between lazy init and each unit's
    first unshard (exact sizes: the CPU allocator does not round), on top of `fsdp_offload_bytes`."""
    return sum(-(-u // shard) for u in unit_bytes)
