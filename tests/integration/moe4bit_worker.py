"""Worker for test_moe_4bit.py: under `torchrun --nproc_per_node 2`, train each hub-layout synthetic MoE model
(moe4bit.py) with FSDP2 through the real loop, then compare every rank's shard of the packed 4-bit experts
with its dim-0 chunk of a one-process load of the same model.

    torchrun --nproc_per_node 2 moe4bit_worker.py OUT FSDP_VERSION FAMILY=DIR [FAMILY=DIR ...]

Each rank writes OUT/FAMILY.RANK.json: the losses, and per packed expert parameter whether its local shard
equals that chunk (and how many elements it holds of the whole; FSDP2 only: FSDP1's flat shards cut
across parameters, and test_stream_load checks those against a one-process load).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's finetune, not an installed one

from tests.integration.families import ROOT  # noqa: E402


def shards(model, whole) -> dict:
    """name -> (local shard equals this rank's torch.chunk of the one-process load's packed bytes, local
    elements, whole elements)."""
    from finetune.weights.experts.module import PackedExperts

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ref = {n: m for n, m in whole.named_modules() if isinstance(m, PackedExperts)}
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, PackedExperts):
            continue
        key = name[name.index("model.layers"):].replace(".base_layer", "")
        for p in ("gate_up_proj", "down_proj"):
            local = getattr(m, p).to_local()
            full = getattr(ref[key], p)
            chunk = torch.chunk(full, world, dim=0)[rank]
            same = torch.equal(local[:chunk.shape[0]].view(torch.uint8), chunk.contiguous().view(torch.uint8))
            stats = all(torch.equal(getattr(m, f"{p}_{s}"), getattr(ref[key], f"{p}_{s}")) for s in ("absmax", "offset"))
            out[f"{key}.{p}"] = [same and stats, local.numel(), full.numel()]
    return out


def main() -> None:
    from finetune.recipe import ModelSpec, QuantizationSpec, load
    from finetune.train.loop import train
    from finetune.weights.load.model import load_model

    out, version = Path(sys.argv[1]), sys.argv[2]
    for arg in sys.argv[3:]:
        family, path = arg.split("=", 1)
        run_dir = out / family
        recipe = load(ROOT / "recipes" / "tiny_cpu.yaml", [
            f"model.name={path}", "train.max_steps=8", "train.warmup_steps=0", "train.log_every=1",
            "data.max_samples=64", "data.max_seq_len=48", "output.progress_bar=false", "data.eval_sources=[]",
            "data.eval_split=0", "lora.dropout=0", f"output.dir={run_dir}", "distributed.strategy=fsdp",
            f"fsdp.version={version}"])
        result = train(recipe, run_dir, return_model=True)
        facts, whole = {}, None
        if version == "2":
            whole = load_model(ModelSpec(name=path, dtype=recipe.model.dtype), QuantizationSpec(), quiet=True)
            facts["shards"] = shards(result["model"], whole)
        rank = torch.distributed.get_rank()
        (out / f"{family}.{rank}.json").write_text(json.dumps(facts))
        del result, whole
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
