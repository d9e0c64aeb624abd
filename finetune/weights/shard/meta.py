"""What both FSDP versions share around the wrap: the base's placeholders turned into meta tensors of their
full shape (which FSDP shards without memory), the frozen tables FSDP leaves whole, whether FSDP offloads
the shards, and who holds a parameter (to set it in every place at once)."""
from __future__ import annotations

import torch

from finetune.weights.load.loadplan import LoadPlan
from finetune.weights.load.skeleton import placeholder, retie


def to_meta(model, plan: LoadPlan) -> None:
    """Placeholders -> meta tensors of the parameter's full shape. A tied head is tied again to the new
    embedding tensor, so FSDP sees (and shards) one parameter."""
    for e in plan.entries:
        p = getattr(e.module, e.name)
        if not p.is_meta and (p.numel() == 0 or not any(p.stride())):
            setattr(e.module, e.name, placeholder(e, e.full_shape(), "meta"))
    retie(model)


def replicated_modules(model) -> list:
    """The frozen input embedding and output head, which FSDP (2 and 1) then leaves whole on every rank
    instead of sharding them. Sharded, they sit in the root unit, which FSDP gathers for the whole forward
    and backward: at a step's peak a rank holds its shard AND the whole tables, and the all-gather's own
    output buffer besides (measured on CPU by the phase-RSS benchmark). Whole, a rank holds them once and
    no step gathers them. Trained ones (an adapter on the embedding, `modules_to_save`) stay sharded."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = []
    for m in (base.get_input_embeddings(), base.get_output_embeddings()):
        if m is not None and m not in out and not any(p.requires_grad for p in m.parameters()):
            out.append(m)
    return out


def leave_tables_whole(model, plugin, plan: LoadPlan) -> None:
    """Record in the plan whether FSDP offloads its shards (the FSDP2 fill then builds them on the CPU) and,
    unless it does, tell FSDP to leave the frozen tables whole: offloaded, FSDP moves what it manages, and a
    table left out would stay off the GPU."""
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy

    policy = plugin.cpu_offload  # Accelerate made it torch's FSDP2 CPUOffloadPolicy or FSDP1 CPUOffload
    plan.offload = isinstance(policy, CPUOffloadPolicy) or (isinstance(policy, CPUOffload) and policy.offload_params)
    if not plan.offload:
        plugin.ignored_modules = replicated_modules(model) or None


def holders_by_id(model) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) -> every (module, name) that holds it: a tied head shares the embedding's."""
    out: dict[int, list] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            out.setdefault(id(p), []).append((module, name))
    return out


def assign(holders: list, new: torch.nn.Parameter) -> None:
    """`new` in place of the parameter in every (module, name) of `holders`, through the public
    `load_state_dict(..., assign=True)`."""
    for module, name in holders:
        module.load_state_dict({name: new}, strict=False, assign=True)
