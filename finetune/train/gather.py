"""The trained adapter gathered to full shapes on rank 0, from whatever the strategy sharded it into (FSDP2
DTensors, FSDP1 flat parameters, or nothing): what checkpoints and the final adapter write."""
from __future__ import annotations

import torch

from finetune.train.parallel import is_sharded
from finetune.util.log import is_main


def gather_full_adapter_state(accelerator, model) -> dict[str, torch.Tensor]:
    """Full-shape (unsharded) adapter tensors on CPU, on rank 0 (other ranks get {}). Collective: every
    rank must call it.

    Keys are PEFT's file keys, without the adapter name ("...q_proj.lora_A.weight"): what
    adapter_model.safetensors holds and `set_peft_model_state_dict` loads. (PeftModel.save_pretrained's
    own `state_dict=` argument wants the raw keys with ".default." instead.)
    Only trainable tensors are gathered; the frozen 4-bit base never leaves its shards.
    """
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    unwrapped = accelerator.unwrap_model(model)
    fsdp1 = is_sharded(model) and accelerator.state.fsdp_plugin.fsdp_version == 1
    if fsdp1 and not _fsdp1_unsharded(model):
        raw = _fsdp1_trainable(model, offload=accelerator.device.type != "cpu")
    elif is_sharded(model) and not fsdp1:
        # FSDP2: rank 0 receives the full tensors in CPU memory (offload: the gathered copy never sits
        # on the device), the others get {}; the frozen base is skipped before gathering.
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        raw = get_model_state_dict(model, options=opts)  # clean names: no FSDP wrapper prefixes
    else:
        raw = {k: v.detach().to("cpu", copy=True) for k, v in unwrapped.named_parameters() if v.requires_grad}
    if not is_main():
        return {}
    # peft (0.21) finds adapter tensors by walking the model's module names; inside FSDP1 those carry
    # "_fsdp_wrapped_module." for every wrapped layer, so clean keys match nothing and it returns {}.
    # Give it the names it walks, then clean its answer.
    names = {_clean(n): n for n, _ in unwrapped.named_parameters()}
    raw = {names.get(k, k): v for k, v in raw.items()}
    out = {_clean(k): v.detach().to("cpu").contiguous()
           for k, v in get_peft_model_state_dict(unwrapped, state_dict=raw).items()}
    n_trainable = sum(p.requires_grad for p in unwrapped.parameters())
    if len(out) < n_trainable:  # never write an empty or partial adapter without a word
        raise RuntimeError(f"gathered {len(out)} adapter tensors for {n_trainable} trainable parameters")
    return out


def _fsdp1_unsharded(model) -> bool:
    """FSDP1 under NO_SHARD (chosen, or forced by torch for one process): every rank holds whole parameters,
    which use_orig_params exposes as they are; FSDP1's full state dict misses the root unit's parameters then
    (an AssertionError naming embed_tokens, torch 2.13), so the adapter is read like an unwrapped model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    return isinstance(model, FullyShardedDataParallel) and model.sharding_strategy == ShardingStrategy.NO_SHARD


def _fsdp1_trainable(model, offload: bool) -> dict:
    """The trainable tensors at full shape, on rank 0 only (the other ranks get {}), gathered one FSDP1 unit
    at a time (`summon_full_params(unit, recurse=False)`), so rank 0 holds one unit's full parameters beside
    its shards. FSDP1's FULL_STATE_DICT instead gathers and clones every unit's full parameters on rank 0,
    frozen 4-bit weights included: the whole model at every save (measured: +2.9 GiB on rank 0 of the
    2 GB synthetic model, benchmarks/cpu/phase_rss.py). The root unit comes first in `fsdp_modules` and is
    always summoned: FSDP1's lazy init must start from the root (summoning a nested unit first would make
    it a root). `offload` (GPU runs) copies each gathered unit to CPU memory at once; on CPU it stays off:
    FSDP1's `FlatParamHandle.to_cpu` moves the gathered flat parameter to where it already is and then
    frees that storage, leaving every entry pointing at freed memory.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, unit in enumerate(FullyShardedDataParallel.fsdp_modules(model)):
        # the unit's own parameters: not inside a nested unit (whose names carry a second wrapper prefix)
        own = [p for n, p in unit.named_parameters() if p.requires_grad and n.count("_fsdp_wrapped_module.") <= 1]
        if not own and i > 0:
            continue
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True,
                                                         offload_to_cpu=offload):
            if is_main():
                out.update({_clean(names[id(p)]): p.detach().to("cpu", copy=True) for p in own})
    return out


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
