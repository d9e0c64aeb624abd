"""FSDP1 over the meta model: FSDP1 flattens and shards parameters that hold no memory, then each rank fills
only its own slice of every flat parameter from the checkpoint (the load plan says what each parameter is).

FSDP1 builds a wrapped module's FlatParameter by concatenating its parameters, then keeps this rank's slice:
with real parameters, every rank would hold each wrapped module whole twice (the parameters and their
concatenation) before sharding; for the root unit (embedding and output head) that is the biggest
transient of the load. On meta both are free, and what FSDP1 records (each parameter's place in the flat
parameter, this rank's `_shard_param_infos`) is all the fill needs:

- `param_init(plan)` (FSDP1's `param_init_fn`): the base's parameters stay meta; any real parameter (LoRA) is
  moved to meta too, its value stashed in the load plan. The Python object stays the same (the optimizer, built
  before `prepare`, holds it; FSDP1 with use_orig_params keeps it).
- `meta_wrapping` (around `accelerator.prepare`): two places where torch 2.13's FSDP1 assumes the
  parameters are real after `param_init_fn` (see the function).
- `fill_shards` (after `prepare`): for every flat parameter, in the same order on every rank, this rank's
  slice: plain tensors as the few rows covering it (the reader sends each rank its elements alone), 4-bit
  weights quantized on the reader piece by piece, each rank sent the packed bytes of its slice alone
  (packed.py; the quantization state is set whole on every rank), LoRA from the stash. FSDP1's padding stays zero.
  The frozen tables FSDP1 was told to leave out (ignored modules) come whole to every rank, as under FSDP2.
"""
from __future__ import annotations

import contextlib

import torch

from finetune.weights.heap import loading_objects_only, release_freed_memory
from finetune.weights.packed import quantized_range
from finetune.weights.packed_experts import expert_range
from finetune.weights.reader import materialize


def swap_storage(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Point the tensor object `t` at `data` and return what it pointed at. `.data =` cannot move a tensor
    between meta and a real device; torch.utils.swap_tensors can, and here `t` keeps its class and
    attributes (a Params4bit's quantization arguments, FSDP1's bookkeeping on a FlatParameter)."""
    new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    new.__class__, new.__dict__ = t.__class__, t.__dict__
    torch.utils.swap_tensors(t, new)
    new.__dict__ = {}
    return new.data


def param_init(plan):
    """FSDP1's `param_init_fn`, called for each module of a unit being wrapped: every parameter of the module
    ends on meta (the base's already are; a real one, LoRA, is stashed whole in `plan` first, by the
    parameter's identity: a shared one is stashed once)."""

    def init(module):
        for p in module.parameters(recurse=False):
            if not p.is_meta:
                plan.stash[id(p)] = swap_storage(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        return module

    return init


@contextlib.contextmanager
def meta_wrapping():
    """FSDP1 (torch 2.13) wrapping parameters that `param_init` left on meta. Two of its steps assume real
    parameters, and both are only bookkeeping here:

    - `_init_utils._get_compute_device` takes the compute device from the first parameter; meta is not
      `device_id`, so it raises "Inconsistent compute device" (_init_utils.py:1101). The compute device is
      `device_id`, where `fill_shards` puts the shards.
    - with cpu_offload, `_init_param_handle_from_params` copies the sharded flat parameter to CPU
      (_init_utils.py:673, `FlatParamHandle.flat_param_to`), which a meta tensor cannot do; `fill_shards`
      allocates an offloaded shard on CPU in the first place.
    """
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    compute_device, flat_param_to = _init_utils._get_compute_device, FlatParamHandle.flat_param_to

    def meta_compute_device(module, ignored_params, device_from_device_id, rank, device_handle):
        first = next(_init_utils._get_orig_params(module, ignored_params), None)
        if first is not None and first.is_meta and device_from_device_id is not None:
            return device_from_device_id
        return compute_device(module, ignored_params, device_from_device_id, rank, device_handle)

    def meta_flat_param_to(handle, *args, **kwargs):
        if not handle.flat_param.is_meta:
            flat_param_to(handle, *args, **kwargs)

    _init_utils._get_compute_device, FlatParamHandle.flat_param_to = meta_compute_device, meta_flat_param_to
    try:
        yield
    finally:
        _init_utils._get_compute_device, FlatParamHandle.flat_param_to = compute_device, flat_param_to


@loading_objects_only()  # release_freed_memory's collection, once a weight, scans only what loading made
def fill_shards(model, plan) -> None:
    """Give every FlatParameter still on meta its real local shard (see the module doc). Collective: every
    rank walks the same units and parameters in the same order; the plan is released at the end."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    _fill_replicated(model, plan)  # first: the tables' read-and-cast transient while little is held yet
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None or not handle.flat_param.is_meta:
            continue
        flat = handle.flat_param
        device = torch.device("cpu") if handle._offload_params else handle.device
        local = torch.zeros(flat.numel(), dtype=flat.dtype, device=device)
        spans = _peer_spans(handle, plan.stream.placement)
        for i, ((pname, module, _), info) in enumerate(zip(flat._param_infos, flat._shard_param_infos)):
            part = _part(plan, module, pname, flat._params[i], {r: s[i] for r, s in spans.items() if s[i]}, info)
            if info.in_shard:
                local[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard].copy_(part)
            del part
            release_freed_memory()  # the whole packed weight and its quantization's heap, before the next
        swap_storage(flat, local)
        # The original parameters are views of the flat parameter: real from now on, so `.data` takes views.
        for p in [*flat._params, *(flat._shared_params or [])]:
            swap_storage(p, torch.empty(0, dtype=p.dtype, device=device))
        handle._use_sharded_views()
        release_freed_memory()
    plan.release()


def _fill_replicated(model, plan) -> None:
    """The parameters FSDP1 left out of every flat parameter (the frozen tables, parallel.replicated_modules):
    each gets its whole value on every rank, in plan order (collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from finetune.weights.fsdp2 import assign, holders_by_id

    flat = {id(p) for unit in FullyShardedDataParallel.fsdp_modules(model) if unit._handle is not None
            for p in [*unit._handle.flat_param._params, *(unit._handle.flat_param._shared_params or [])]}
    holders = None
    for e in plan.entries:
        old = getattr(e.module, e.name)
        if old.is_meta and id(old) not in flat:
            holders = holders or holders_by_id(model)
            assign(holders[id(old)], materialize(plan.stream, e))
            del old
            release_freed_memory()


def _peer_spans(handle, pl) -> dict[int, list]:
    """Global rank of each process on this machine -> per parameter of the handle, the (start, stop) of
    that parameter's elements in the rank's shard (None when none): FSDP1's own shard bookkeeping
    (`_get_shard_metadata`) for each rank's interval of the flat parameter."""
    import torch.distributed as dist

    n, out = handle.flat_param.numel(), {}
    for g in range(pl.reader, pl.reader + pl.local_world):
        s = dist.get_group_rank(handle.process_group, g) if handle.uses_sharded_strategy else 0  # NO_SHARD: all
        infos = handle._get_shard_metadata(s * n, (s + 1) * n - 1)
        out[g] = [(i.intra_param_start_idx, i.intra_param_end_idx + 1) if i.in_shard else None for i in infos]
    return out


def _part(plan, module, pname: str, param, spans: dict, info) -> torch.Tensor | None:
    """This rank's elements of `module.pname` (`param`; None when its shard holds none, after taking part
    in the collective reads that every rank makes for this parameter)."""
    mine = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else None
    whole = plan.stash.pop(id(param), None)
    if whole is not None:  # LoRA: every rank has its whole value
        return whole.reshape(-1)[mine[0]:mine[1]] if mine else None
    e = plan.find(module, pname)
    if e is None:
        raise RuntimeError(f"FSDP1: {type(module).__name__}.{pname} is on meta and neither loaded nor stashed")
    if e.experts:  # packed MoE experts: the state of every expert goes to the module's buffers
        local = expert_range(plan.stream, e, spans)
        return local if mine else None
    if e.packed:
        local, qs = quantized_range(plan.stream, e, spans)  # the quantization state whole on every rank
        module.quant_state = param.quant_state = qs
        return local if mine else None
    return plan.stream.plain_range(e.key, e.dtype, e.shape, spans)
