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
        raw = _fsdp1_full_state_dict(model, offload=accelerator.device.type != "cpu")
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


def _fsdp1_full_state_dict(model, offload: bool) -> dict:
    """FSDP1's full state dict, on rank 0 only (rank0_only: the other ranks get {}).

    Not torch's `get_model_state_dict`: with cpu_offload it turns rank0_only on, and its frozen-parameter
    filter then pops keys ranks > 0 never received (KeyError on every rank but 0, torch 2.13). Here rank 0
    filters the trainable tensors itself. `offload` (GPU runs) copies each gathered layer to CPU memory
    at once; on CPU it stays off: FSDP1's `FlatParamHandle.to_cpu` moves the gathered flat parameter to
    where it already is and then frees that storage, leaving every entry pointing at freed memory.
    """
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    cfg = FullStateDictConfig(offload_to_cpu=offload, rank0_only=True)
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        full = model.state_dict()
    if not is_main():
        return {}
    trainable = {_clean(n) for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().to("cpu", copy=True) for k, v in full.items() if _clean(k) in trainable}


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
