"""Are the packed 4-bit bytes still the loaded bytes after the FSDP2 wrap? (bitsandbytes issue 1945)

    torchrun --nproc_per_node N -m benchmarks.gpu.bytecheck RECIPE

Under FSDP2 the packed NF4 bytes are stored in the recipe's quant storage dtype (bf16 by default), so to torch
they are bf16 numbers, and about 0.1% of the byte pairs of a random weight read as bf16 NaNs. An operation that
canonicalizes NaN payloads on the way (reported on GPU for FSDP2's parameter swap) silently changes the
weights. This check loads the recipe's base twice, whole in one process and through finetune's sharded path
(streaming load, FSDP2 wrap, shard fill), and compares, bit for bit:
  1. every rank's local shard of every 4-bit weight with the same rows of the whole load;
  2. every 4-bit weight after `unshard()` (the all-gather the forward runs) with the whole load;
  3. the logits of one batch, sharded model against the whole one.
It prints one JSON line on rank 0 and exits 1 when anything differs.
"""
from __future__ import annotations

import json
import sys

import torch


def packed_params(model) -> dict[str, torch.Tensor]:
    """{name: tensor} of the 4-bit weights (bitsandbytes' Params4bit, or their FSDP2 DTensor stand-ins)."""
    import bitsandbytes as bnb

    out = {}
    for mname, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[f"{mname}.weight"] = module.weight
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach().contiguous().view(torch.uint8).cpu()


def nan_patterns(t: torch.Tensor) -> int:
    """How many elements of packed bytes stored as a floating dtype read as NaN."""
    return int(torch.isnan(t.detach()).sum()) if t.dtype.is_floating_point else 0


def logits(model, ids: torch.Tensor, acc, train) -> torch.Tensor:
    from finetune.train.precision import autocast

    with torch.no_grad(), autocast(train, acc.device.type):
        return model(input_ids=ids).logits.float().cpu()


def main(argv: list[str]) -> int:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from finetune.recipe import load
    from finetune.train.lora import apply_lora
    from finetune.train.optim import build_optimizer
    from finetune.train.parallel import make_accelerator, wrap
    from finetune.weights.load.model import load_model, load_with_plan
    from finetune.weights.shard.fsdp import fill_shards
    from finetune.weights.load.placement import Placement, placement_for

    rec = load(argv[0])
    acc = make_accelerator(rec.distributed, rec.fsdp, rec.train, rec.model.dtype)
    rank, world = acc.process_index, acc.num_processes
    whole = apply_lora(load_model(rec.model, rec.quantization, Placement(device=acc.device)), rec.lora, seed=1)
    packed = packed_params(whole)
    ref = {k: as_bytes(v) for k, v in packed.items()}
    nan_count = sum(nan_patterns(v) for v in packed.values())
    elements = sum(v.numel() for v in packed.values())
    del packed
    ids = torch.randint(0, whole.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(acc.device)
    whole.eval()
    want = logits(whole, ids, acc, rec.train)
    del whole

    model, plan = load_with_plan(rec.model, rec.quantization, placement_for(acc))
    model = apply_lora(model, rec.lora, seed=1)
    model, _ = wrap(acc, model, build_optimizer(model, rec.train), plan)
    fill_shards(model, plan)
    inner = acc.unwrap_model(model)
    shard_bad, gathered_bad, checked = [], [], 0
    for name, p in packed_params(inner).items():
        full = ref[name]
        rows = torch.chunk(full, world, dim=0)  # FSDP2 shards dim 0 as torch.chunk does
        mine = rows[rank] if rank < len(rows) else full[:0]
        if not torch.equal(as_bytes(p), mine):
            shard_bad.append(name)
        checked += 1
    for m in inner.modules():  # the all-gather the forward runs, then compare the whole weights
        if isinstance(m, FSDPModule):
            m.unshard()
    for name, p in packed_params(inner).items():
        if not torch.equal(as_bytes(p), ref[name]):
            gathered_bad.append(name)
    for m in inner.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    model.eval()
    got = logits(model, ids, acc, rec.train)
    diff = float((got - want).abs().max())
    ok = not shard_bad and not gathered_bad and diff == 0.0
    flags = torch.tensor([0 if ok else 1], device=acc.device)
    if dist.is_initialized():
        dist.all_reduce(flags)
    res = {"world": world, "weights_checked": checked, "packed_elements": elements,
           "nan_patterns_in_packed": nan_count, "storage": rec.effective_quant_storage(),
           "shard_mismatches": shard_bad[:5], "n_shard_mismatches": len(shard_bad),
           "gathered_mismatches": gathered_bad[:5], "n_gathered_mismatches": len(gathered_bad),
           "logits_max_abs_diff": diff, "ok": int(flags.item()) == 0}
    if rank == 0:
        print(json.dumps(res), flush=True)
    acc.wait_for_everyone()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
