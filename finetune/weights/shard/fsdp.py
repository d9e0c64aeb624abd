"""The two calls the training code makes into the FSDP half of the load: `before_wrap` (the one weights call
before `accelerator.prepare`) and `fill_shards` (after it). Each dispatches to the FSDP version's own module."""
from __future__ import annotations

from finetune.weights.bnb import disable_cpu_weight_repacking
from finetune.weights.load.loadplan import LoadPlan
from finetune.weights.shard import fsdp1, fsdp2


def before_wrap(model, plan: LoadPlan | None, plugin, device) -> None:
    """Everything the base needs before `accelerator.prepare`: bitsandbytes' in-place CPU repacking off (it
    would corrupt the layout training and every FSDP gather rely on: weights.bnb), and with FSDP's `plugin`
    and the streaming loader's `plan` (a placeholder base) the meta tensors FSDP shards, plus what the FSDP
    version needs (fsdp2.before_wrap, fsdp1.before_wrap). `plugin` None: no FSDP."""
    disable_cpu_weight_repacking(model)
    if plugin is None or plan is None:
        return
    if plugin.fsdp_version == 1:
        fsdp1.before_wrap(model, plan, plugin, device)
    else:
        fsdp2.before_wrap(model, plan, plugin)


def fill_shards(model, plan: LoadPlan | None) -> None:
    """After the strategy wrapped the model: each rank's part of the base, streamed into FSDP's shards as the
    load plan says; the plan is released after. Nothing to do without a plan (every weight was set at load
    time). Collective."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if plan is None:
        return
    if isinstance(model, FullyShardedDataParallel):
        fsdp1.fill_shards(model, plan)
    elif isinstance(model, FSDPModule):
        fsdp2.fill_shards(model, plan)
    else:
        raise RuntimeError(f"fill_shards: a {plan.stream.placement.mode} load plan, but the model is an unsharded "
                           f"{type(model).__name__}")
