"""FSDP2's shards of the frozen base, filled after `fully_shard` wrapped the meta placeholders: every rank
keeps exactly the dim-0 chunk `fully_shard` would have kept of the whole tensor (torch.chunk; the last
rank's chunk may be short or empty, FSDP pads it).

Public torch API only: each parameter's new local shard becomes a DTensor on the parameter's own mesh and
placements (`DTensor.from_local`), set with `load_state_dict(..., assign=True)` on every module that holds
it; FSDP2 re-registers replaced parameters (and pads the local tensors) at its lazy init before the first
forward, its documented path for loading into a meta-initialised model.
"""
from __future__ import annotations

import torch

from finetune.weights.heap import loading_objects_only, release_freed_memory
from finetune.weights.load.loadplan import Entry, LoadPlan
from finetune.weights.load.packed import quantized_range
from finetune.weights.experts.expert_bytes import expert_range
from finetune.weights.load.reader import materialize
from finetune.weights.shard.meta import assign, holders_by_id, leave_tables_whole, to_meta


def local_chunk(plan: LoadPlan, e: Entry, rank: int, world: int) -> torch.Tensor:
    """This rank's dim-0 chunk of one parameter. A plain tensor (embedding, output head, norms) is sent
    chunk by chunk, each rank receiving only its rows; a 4-bit weight's packed bytes likewise, as the
    reader quantizes it piece by piece (packed.py; the quantization state goes whole to every rank). A
    mesh that is not the placement's (no case today) gets the whole parameter, cut here."""
    stream, shape = plan.stream, e.full_shape()
    pl = stream.placement
    if e.experts and (rank, world) == (pl.rank, pl.world):
        return expert_range(stream, e, stream.chunk_spans(shape, world)).view(-1, *shape[1:])
    if e.packed and (rank, world) == (pl.rank, pl.world):
        # the packed weight is stored (elements, 1): its dim-0 chunks are ranges of packed elements
        local, e.module.quant_state = quantized_range(stream, e, stream.chunk_spans(shape, world))
        return local.view(-1, *shape[1:])
    if not e.packed and len(shape) and (rank, world) == (pl.rank, pl.world):
        return stream.plain_chunk(e.key, e.dtype, shape, rank, world)
    full = materialize(stream, e)
    chunks = torch.chunk(full.data, world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else full.data.new_empty((0, *full.shape[1:]))


def before_wrap(model, plan: LoadPlan, plugin) -> None:
    """Before `fully_shard`: the placeholders become meta tensors of their full shape, and the frozen tables
    are left whole unless FSDP offloads (meta.leave_tables_whole)."""
    to_meta(model, plan)
    leave_tables_whole(model, plugin, plan)


@loading_objects_only()  # release_freed_memory's collection, once a weight, scans only what loading made
def fill_shards(model, plan: LoadPlan) -> None:
    """After `fully_shard` on the meta placeholders: stream every parameter of the plan and keep this rank's
    dim-0 chunk. Collective, in plan order on every rank; the plan is released at the end."""
    from torch.distributed.tensor import DTensor

    holders = holders_by_id(model)
    # Plain tensors first: the embedding and the head are the biggest reads, and their transients (the
    # reader holds another rank's rows while it sends them) should come while little is held yet.
    for e in sorted(plan.entries, key=lambda e: e.packed):
        old = getattr(e.module, e.name)
        if not isinstance(old, DTensor):
            if old.is_meta:  # replicated (left out of sharding, meta.replicated_modules): whole everywhere
                assign(holders[id(old)], materialize(plan.stream, e))
                del old
                release_freed_memory()
            continue
        if not old.to_local().is_meta:
            continue
        mesh = old.device_mesh
        local = local_chunk(plan, e, mesh.get_local_rank(), mesh.size())
        if plan.offload:
            local = local.cpu()
        new = torch.nn.Parameter(DTensor.from_local(local, mesh, old.placements, run_check=False, shape=old.shape,
                                                    stride=old.stride()), requires_grad=False)
        assign(holders[id(old)], new)
        del old, local, new
        release_freed_memory()
    plan.release()
