"""FSDP2's shards of the frozen base, filled after `fully_shard` wrapped the meta placeholders: every rank
keeps exactly the dim-0 chunk `fully_shard` would have kept of the whole tensor."""
from __future__ import annotations

import torch

from finetune.weights.heap import loading_objects_only, release_freed_memory
from finetune.weights.packed import quantized_range
from finetune.weights.reader import materialize
from finetune.weights.skeleton import full_shape, tagged


def _fsdp2_params(model) -> dict:
    """(id(module), name) -> FSDPParam for every parameter fully_shard manages."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else []:
                out[(id(fp._module_info.module), fp._module_info.param_name)] = fp
    return out


def _local_chunk(module, pname: str, rank: int, world: int) -> torch.Tensor:
    """This rank's dim-0 chunk of one parameter. A plain tensor (embedding, output head, norms) is sent
    chunk by chunk, each rank receiving only its rows; a 4-bit weight's packed bytes likewise, as the
    reader quantizes it piece by piece (packed.py; the quantization state goes whole to every rank). A
    mesh that is not the placement's (no case today) gets the whole parameter, cut here."""
    stream, shape = module._finetune_stream, full_shape(module, pname)
    pl = stream.placement
    packed = hasattr(module, "_finetune_q") and pname == "weight"
    if packed and (rank, world) == (pl.rank, pl.world):
        # the packed weight is stored (elements, 1): its dim-0 chunks are ranges of packed elements
        local, module.quant_state = quantized_range(stream, module, pname, stream.chunk_spans(shape, world))
        return local.view(-1, *shape[1:])
    if not packed and len(shape) and (rank, world) == (pl.rank, pl.world):
        return stream.plain_chunk(module._finetune_keys[pname], module._finetune_dtypes[pname], shape, rank, world)
    full = materialize(stream, module, pname)
    chunks = torch.chunk(full.data, world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else full.data.new_empty((0, *full.shape[1:]))


@loading_objects_only()
def fill_shards(model) -> None:
    """After `fully_shard` on the meta placeholders: stream every tagged parameter and keep this rank's dim-0
    chunk, exactly the rows `fully_shard` would have kept of the whole tensor (torch.chunk; the last rank's
    chunk may be short or empty, FSDP pads it). Collective, in module order on every rank."""
    from torch.distributed.tensor import DTensor

    fsdp_params = _fsdp2_params(model)
    # Plain tensors first: the embedding and the head are the biggest reads, and their transients (the
    # reader holds another rank's rows while it sends them) should come while little is held yet.
    params = sorted(tagged(model), key=lambda mp: hasattr(mp[0], "_finetune_q") and mp[1] == "weight")
    for module, pname in params:
        fp = fsdp_params[(id(module), pname)]
        old = fp.sharded_param
        if not old._local_tensor.is_meta:
            continue
        local = _local_chunk(module, pname, old.device_mesh.get_local_rank(), old.device_mesh.size())
        if fp.offload_to_cpu:
            local = local.cpu()
        new = torch.nn.Parameter(DTensor.from_local(local, old.device_mesh, old.placements, run_check=False,
                                                    shape=old.shape, stride=old.stride()), requires_grad=False)
        for m in [fp._module_info.module, *fp._module_info.shared_modules]:
            m._parameters[fp._module_info.param_name] = new
        fp.reset_sharded_param()
        release_freed_memory()
