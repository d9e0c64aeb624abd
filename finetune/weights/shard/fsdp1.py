"""FSDP1 over the streamed model: FSDP1 flattens and shards each wrapped unit as usual, then each rank fills
only its own slice of every flat parameter from the checkpoint (the load plan says what each parameter is).

- `param_init(plan, device)` (FSDP1's public `param_init_fn`, called per unit just before FSDP1 flattens it):
  the unit's base parameters, meta until now, get uninitialised memory of their full shape on the compute
  device. FSDP1 then concatenates them into the unit's FlatParameter and keeps this rank's slice, so the
  largest transient of the wrap is one unit whole twice (its parameters and their concatenation), one unit
  at a time: a decoder layer, whose gathered copy every training step holds anyway (plan/loading.py plans
  it). Real parameters (LoRA) keep their values and FSDP1 flattens them as they are. No torch function is
  replaced: the wrap is FSDP1's own, on real tensors.
- `fill_shards` (after `prepare`): for every flat parameter, in the same order on every rank, this rank's
  slice of each parameter `param_init` gave memory to: plain tensors as the few rows covering it (the
  reader sends each rank its elements alone), 4-bit weights quantized on the reader piece by piece, each
  rank sent the packed bytes of its slice alone (packed.py; the quantization state is set whole on every
  rank). The slice is written in place into the local shard (on the CPU when FSDP1 offloads it), which the
  original parameters are views of. FSDP1's padding stays zero.
  The frozen tables FSDP1 was told to leave out (ignored modules) come whole to every rank, as under FSDP2.
"""
from __future__ import annotations

import torch

from finetune.weights.heap import loading_objects_only, release_freed_memory
from finetune.weights.load.packed import quantized_range
from finetune.weights.experts.expert_bytes import expert_range
from finetune.weights.load.reader import materialize
from finetune.weights.shard.meta import assign, holders_by_id, leave_tables_whole, to_meta


def swap_storage(t: torch.Tensor, data: torch.Tensor) -> None:
    """Point the tensor object `t` at `data`. `.data =` cannot move a tensor from meta to a real device;
    torch.utils.swap_tensors can, and here `t` keeps its class and attributes (a Params4bit's quantization
    arguments)."""
    new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    new.__class__, new.__dict__ = t.__class__, t.__dict__
    torch.utils.swap_tensors(t, new)
    new.__dict__ = {}


def param_init(plan, device: torch.device):
    """FSDP1's `param_init_fn`, called for each module of a unit about to be flattened: every meta parameter
    of the module gets uninitialised memory of its shape on `device` (the same Python object: a Params4bit
    keeps its class and quantization arguments, and the optimizer, built before `prepare`, holds it), and
    `plan.materialized` records it for the fill. A parameter tied to one already given memory is real by then."""

    def init(module):
        for p in module.parameters(recurse=False):
            if p.is_meta:
                swap_storage(p, torch.empty(p.shape, dtype=p.dtype, device=device))
                plan.materialized.add(id(p))
        return module

    return init


def before_wrap(model, plan, plugin, device: torch.device) -> None:
    """Before FSDP1 wraps: the placeholders become meta tensors of their full shape, FSDP1's `param_init_fn`
    gives each unit's meta parameters memory just before it flattens them (param_init), and the frozen
    tables are left whole unless FSDP offloads (meta.leave_tables_whole)."""
    to_meta(model, plan)
    plugin.param_init_fn = param_init(plan, device)
    leave_tables_whole(model, plugin, plan)


@loading_objects_only()  # release_freed_memory's collection, once a weight, scans only what loading made
def fill_shards(model, plan) -> None:
    """Write this rank's slice of every parameter `param_init` gave memory to into its FlatParameter's local
    shard (see the module doc). Collective: every rank walks the same units and parameters in the same
    order; the plan is released at the end."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    _fill_replicated(model, plan)  # first: the tables' read-and-cast transient while little is held yet
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        if not any(id(p) in plan.materialized for p in flat._params):
            continue
        local = flat.detach()  # this rank's shard: FSDP1 sharded (and offloaded) it at the wrap
        spans = _peer_spans(handle, plan.stream.placement)
        for i, ((pname, module, _), info) in enumerate(zip(flat._param_infos, flat._shard_param_infos)):
            param = flat._params[i]
            if id(param) not in plan.materialized:
                continue  # LoRA: FSDP1 flattened its value
            part = _part(plan, module, pname, param, {r: s[i] for r, s in spans.items() if s[i]}, info)
            if info.in_shard:
                local[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard].copy_(part.reshape(-1))
            del part
            release_freed_memory()  # the whole packed weight and its quantization's heap, before the next
    plan.release()


def _fill_replicated(model, plan) -> None:
    """The parameters FSDP1 left out of every flat parameter (the frozen tables, meta.replicated_modules):
    each gets its whole value on every rank, in plan order (collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

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
    e = plan.find(module, pname)
    if e is None:
        raise RuntimeError(f"FSDP1: {type(module).__name__}.{pname} was given memory at the wrap but the checkpoint "
                           "has no value for it")
    if e.experts:  # packed MoE experts: the state of every expert goes to the module's buffers
        local = expert_range(plan.stream, e, spans)
        return local if mine else None
    if e.packed:
        local, qs = quantized_range(plan.stream, e, spans)  # the quantization state whole on every rank
        module.quant_state = param.quant_state = qs
        return local if mine else None
    return plan.stream.plain_range(e.key, e.dtype, e.shape, spans)
