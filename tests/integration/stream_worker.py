"""Worker for test_stream_load.py: loads a base through the streaming loader under FSDP (or alone), wraps it
with LoRA as training does, and saves what this rank holds of the 4-bit base to OUT/rank{R}.pt:

- FSDP2: per Linear4bit weight, the local packed bytes (its dim-0 chunk) and the quantization state;
- FSDP1: per flat parameter, this rank's flat shard and, per original parameter in it, which of its
  elements the shard holds (FSDP1's own shard bookkeeping);
- logits of a fixed batch (rank 0).

    torchrun --standalone --nproc_per_node 2 stream_worker.py OUT MODEL_DIR --version 2 [--no-quantize] [--quant-chunk N]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def fsdp2_holdings(model) -> dict:
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight
            qs = {k: v.clone() for k, v in m.quant_state.as_dict(packed=True).items()}
            out[clean(name)] = {"packed": _bytes(w), "rows": w.shape[0], "quant_state": qs}
    return out


def tables(model) -> dict:
    """The input embedding's and output head's weights as this rank holds them: whether sharded (a DTensor)
    and the local tensor."""
    from torch.distributed.tensor import DTensor

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {}
    for key, m in (("embed", base.get_input_embeddings()), ("head", base.get_output_embeddings())):
        w = m.weight
        out[key] = {"sharded": isinstance(w, DTensor),
                    "local": (w.to_local() if isinstance(w, DTensor) else w).detach().clone()}
    return out


def fsdp1_holdings(model) -> list:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = {id(p): clean(n) for n, p in model.named_parameters()}
    out = []
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        infos = [(names.get(id(p)), i.offset_in_shard, i.numel_in_shard, i.intra_param_start_idx)
                 for p, i in zip(flat._params, flat._shard_param_infos) if i.in_shard]
        out.append({"flat": _bytes(flat.data), "itemsize": flat.element_size(), "infos": infos})
    return out


def clean(name: str) -> str:
    for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "base_model.model.", ".base_layer"):
        name = name.replace(part, "")
    return name


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model")
    ap.add_argument("--version", type=int, default=2)
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--no-quantize", action="store_true")
    ap.add_argument("--quant-chunk", type=int, default=0, help="the loader's QUANT_CHUNK (0: its own)")
    args = ap.parse_args(argv)
    if args.quant_chunk:  # small pieces: a rank's part begins and ends inside a piece
        from finetune.weights.load import quantize

        quantize.QUANT_CHUNK = args.quant_chunk
    if args.no_quantize:  # a pre-quantized checkpoint must load without bitsandbytes quantizing anything
        import bitsandbytes.functional as F

        def refuse(*a, **k):
            raise AssertionError("quantize_4bit was called")
        F.quantize_4bit = refuse
        from finetune.weights.load import packed, quantize

        quantize.quantize = quantize.quantize_piece = packed.quantize_piece = refuse  # the loader's own (piecewise)

    from finetune.recipe import DistributedSpec, FsdpSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec
    from finetune.train import parallel as D
    from finetune.weights.load.placement import placement_for
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_with_plan
    from finetune.weights.shard.fsdp import fill_shards
    from finetune.train.optim import build_optimizer

    train = TrainSpec(optimizer="adamw_torch", mixed_precision="no")
    acc = D.make_accelerator(DistributedSpec(strategy=args.strategy), FsdpSpec(version=args.version), train,
                             "float32")
    spec = ModelSpec(name=args.model, gradient_checkpointing=False)
    placement = placement_for(acc)
    model, plan = load_with_plan(spec, QuantizationSpec(), placement, quiet=True)
    model = apply_lora(model, LoraSpec(r=8, alpha=16, dropout=0.0), seed=0)
    opt = build_optimizer(model.named_parameters(), train)
    model, opt = D.wrap(acc, model, opt, plan)
    fill_shards(model, plan)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(24).view(2, 12) % 300).logits.float()
    facts = {"logits": logits, "fsdp2": fsdp2_holdings(model), "reader": placement.reader,
             "tables": tables(model)}
    if args.strategy == "fsdp" and args.version == 1:
        facts["fsdp1"] = fsdp1_holdings(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(facts, out / f"rank{acc.process_index}.pt")
    acc.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
