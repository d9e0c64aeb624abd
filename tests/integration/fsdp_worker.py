"""Worker for test_fsdp_blocks.py: trains the tiny 4-bit + LoRA model a few steps with the building blocks
of finetune.train.parallel / finetune.train.optim and writes what it measured to OUT/.

    python fsdp_worker.py OUT --strategy single --micro-batch 8
    torchrun --standalone --nproc_per_node 2 fsdp_worker.py OUT --strategy fsdp --version 2 --micro-batch 4

Every rank takes its slice of the same global batch (rank r: rows r*mb .. (r+1)*mb), so 2 ranks x mb 4
see exactly the rows 1 process x mb 8 sees.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

SEQ, GLOBAL_BATCH = 32, 8


def load_qlora_model(placement=None):
    """The tiny base in 4-bit NF4 (double quant, bf16 compute, fp32 storage, fp32 model) + LoRA r=16 on
    every linear, dropout 0 so 1 and 2 processes compute the same thing. Under FSDP the streaming loader
    leaves the base to `fill_shards`, after wrapping, which gives each rank its shard: (model, load plan)."""
    from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_with_plan

    model, plan = load_with_plan(ModelSpec(gradient_checkpointing=False), QuantizationSpec(), placement, quiet=True)
    return apply_lora(model, LoraSpec(r=16, alpha=32, dropout=0.0), seed=0), plan


def batches(steps: int):
    """Global batches of GLOBAL_BATCH rows x SEQ tokens cut from the tiny instruction set's token stream:
    real text, and every row has the same number of trained tokens, so the mean of the ranks' mean
    losses is the 1-process mean loss."""
    from finetune.recipe import ModelSpec
    from finetune.weights.load.resolve import load_tokenizer
    from finetune.util import builtin as tiny

    tok = load_tokenizer(ModelSpec())
    need = (steps * GLOBAL_BATCH) * SEQ
    stream: list[int] = []
    with open(tiny.dataset_dir() / "train.jsonl") as f:
        for line in f:
            row = json.loads(line)
            stream += tok(row["prompt"] + row["completion"] + "\n")["input_ids"]
            if len(stream) >= need:
                break
    ids = torch.tensor(stream[:need]).view(steps, GLOBAL_BATCH, SEQ)
    return list(ids)


def table_bytes(model) -> int:
    """The local bytes of the embedding and head (parallel.replicated_modules), each parameter once (a tied
    head is the embedding)."""
    from torch.distributed.tensor import DTensor

    tables = {id(p): p for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n}
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in tables.values())


def param_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def four_bit_facts(model) -> dict:
    """The Linear4bit weights as this rank holds them: local storage bytes (summed over ranks by the test)
    against the layers' parameter count, storage dtype and classes."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    local = [m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight for m in layers]
    return {"n_linear4bit": len(layers), "n_params": sum(m.in_features * m.out_features for m in layers),
            "local_storage_bytes": sum(t.numel() * t.element_size() for t in local),
            "weight_dtypes": sorted({str(m.weight.dtype) for m in layers}),
            "weight_classes": sorted({type(m.weight).__name__ for m in layers}),
            "local_classes": sorted({type(t).__name__ for t in local})}


def sharding_facts(model, accelerator) -> dict:
    from torch.distributed.tensor import DTensor

    from finetune.train.parallel import is_sharded

    params = list(model.parameters())
    whole = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]  # left out of sharding
    return {"model_class": type(model).__name__, "is_sharded": is_sharded(model),
            "n_dtensor_params": sum(isinstance(p, DTensor) for p in params), "n_params": len(params),
            "unsharded_names": whole,
            "unsharded_bytes": sum(p.numel() * p.element_size() for p in params if not isinstance(p, DTensor)),
            "table_bytes": table_bytes(model),
            "num_processes": accelerator.num_processes}


def optimizer_facts(opt, named_before: dict) -> dict:
    """Per lora_A tensor: state dtype and whether the state is sized to this rank's shard."""
    from finetune.train.optim import _local

    inner = getattr(opt, "optimizer", opt)
    out = {}
    for group in inner.param_groups:
        for p in group["params"]:
            name = named_before.get(id(p))
            if name is None:
                continue
            st = inner.state.get(p) or {}  # no state: FSDP1 gave this rank none of p, so no grad either
            s1 = st.get("state1")
            out[name] = {"dtype": str(s1.dtype) if s1 is not None else None,
                         "state_numel": s1.numel() if s1 is not None else 0, "local_numel": _local(p).numel()}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--version", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--optimizer", default="paged_adamw_8bit")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from finetune.recipe import DistributedSpec, FsdpSpec, TrainSpec
    from finetune.train import parallel as D
    from finetune.train.optim import build_optimizer, build_scheduler

    train = TrainSpec(micro_batch_size=args.micro_batch, optimizer=args.optimizer, learning_rate=args.lr,
                      mixed_precision=args.precision,
                      weight_decay=0.01, warmup_steps=0, max_steps=args.steps, max_grad_norm=args.clip or None)
    acc = D.make_accelerator(DistributedSpec(strategy=args.strategy), FsdpSpec(version=args.version), train,
                             "float32")
    from finetune.weights.load.placement import placement_for
    from finetune.train.precision import autocast
    from finetune.weights.shard.fsdp import fill_shards

    whole = load_qlora_model()[0]  # the whole model, as one process holds it
    full_bytes, full_tables = param_bytes(whole), table_bytes(whole)
    del whole
    model, plan = load_qlora_model(placement_for(acc))
    opt = build_optimizer(model.named_parameters(), train)
    sched = build_scheduler(opt, train, args.steps)
    model, opt = D.wrap(acc, model, opt, plan)
    fill_shards(model, plan)
    # Parameter objects after prepare (FSDP2 swaps them for DTensors): name them for the optimizer report.
    names_after = {id(p): n.replace("_fsdp_wrapped_module.", "") for n, p in model.named_parameters()}

    facts = {"rank": acc.process_index, "full_bytes": full_bytes, "full_table_bytes": full_tables,
             "local_bytes": param_bytes(model),
             **sharding_facts(model, acc), "four_bit": four_bit_facts(model)}
    r, mb = acc.process_index, args.micro_batch
    losses = []
    model.train()
    for batch in batches(args.steps):
        ids = batch[r * mb:(r + 1) * mb]
        with autocast(train, acc.device.type):
            loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        if train.max_grad_norm:
            facts.setdefault("grad_norms", []).append(
                float(acc.clip_grad_norm_(model.parameters(), train.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(acc.reduce(loss.detach(), "mean").item())
    facts["losses"] = losses
    facts["optimizer"] = {n: v for n, v in optimizer_facts(opt, names_after).items() if "lora_A" in n}

    # Optimizer state round trip, per rank: what a sharded checkpoint does.
    path = out / f"optim-rank{r}.pt"
    torch.save(opt.state_dict(), path)
    saved = torch.load(path, weights_only=False)
    opt.load_state_dict(saved)
    inner = getattr(opt, "optimizer", opt)
    reloaded = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    facts["reloaded_state_tensors"] = len(reloaded)
    facts["reloaded_dtensors"] = sum(type(t).__name__ == "DTensor" for t in reloaded)

    from finetune.train.gather import gather_full_adapter_state
    from finetune.util.log import is_main

    adapter = gather_full_adapter_state(acc, model)
    model.eval()
    eval_ids = batches(args.steps + 1)[-1][:2]
    with torch.no_grad(), autocast(train, acc.device.type):
        logits = model(input_ids=eval_ids).logits.float()
    if is_main():
        from safetensors.torch import save_file
        save_file(adapter, str(out / "adapter_model.safetensors"))
        torch.save({"eval_ids": eval_ids, "logits": logits}, out / "logits.pt")
    (out / f"facts-rank{r}.json").write_text(json.dumps(facts, indent=1))
    acc.wait_for_everyone()
    acc.end_training()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
