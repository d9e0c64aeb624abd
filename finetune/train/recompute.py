"""model.gradient_checkpointing on the machine the run is on: `auto` resolved by the planner against this
device's memory (plan.checkpointing.fit), the choice said in one line, and how many of the first decoder
layers recompute (train.lora.enable_checkpointing applies it)."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from finetune.util.log import log


def device_memory(device: torch.device) -> int:
    """Bytes `auto` may plan one process's step peak against: a GPU's memory, or on a CPU run what this
    process holds already (the loaded base is part of the plan) plus its share of the RAM still free."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    # CPU-only: a CPU run's device is the host, whose memory the processes of this machine share.
    import psutil

    procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return psutil.Process().memory_info().rss + psutil.virtual_memory().available // procs


def _agreed(acc, value: int) -> int:
    """The smallest of every rank's value: ranks that measured their memory apart still plan one layout."""
    if acc.num_processes == 1:
        return value
    return int(acc.gather(torch.tensor([value], device=acc.device)).min().item())


def resolve(recipe, acc, start_rss: int | None = None) -> int | None:
    """How many of the first decoder layers to checkpoint: None every layer (true), 0 none (false), else the
    recipe's count or, for `auto`, the planner's fewest that fit. The choice is logged in the words of
    `validate` and `estimate`; a model whose shapes the planner cannot read checkpoints every layer.
    `start_rss`: this process's RSS when the run began; on CPU the plan's process constant assumes
    estimate.CPU_START_RSS, so the difference is added to every planned peak (as memory.json's plan adds it)."""
    from finetune.plan import checkpointing as C
    from finetune.plan import estimate as E
    from finetune.plan.archs import resolve as shapes

    setting = recipe.model.gradient_checkpointing
    if setting is True or setting is False:
        return None if setting else 0
    try:
        arch, source = shapes(recipe.model.name)
    except (ValueError, OSError) as e:
        if setting != "auto":
            return setting
        log.warning(f"gradient checkpointing: auto -> every layer (the planner cannot read the shapes: {e})")
        return None
    s = replace(E.from_recipe(recipe), gpus=acc.num_processes, device="cuda" if acc.device.type == "cuda" else "cpu")
    if s.gpus > 1 and s.strategy == "single":
        s = replace(s, strategy="fsdp")
    budget = C.budget(_agreed(acc, device_memory(acc.device)), recipe.model.max_memory_gib)
    # A GPU's plan counts device bytes, which the host's start does not touch; the largest rank's start counts.
    offset = 0 if s.device == "cuda" or not start_rss else E.start_offset(-_agreed(acc, -start_rss))
    _, choice = C.fit(s, arch, source, budget, offset)
    log.info(choice.line())
    return choice.layers
