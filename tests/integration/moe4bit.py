"""Synthetic Qwen3-MoE and Mixtral checkpoints in the hub's per-expert layout (one 2-D weight per expert
and projection, Mixtral's router under block_sparse_moe), for the 4-bit expert tests and their FSDP
worker: the synthetic model (few layers, many experts, seeded random weights) is built as usual, then its
fused expert tensors are written back out expert by expert."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

SMALL = "?layers=2&hidden=64&intermediate=64&heads=4&kv_heads=2&head_dim=16&vocab=384&experts=16&experts_per_tok=2"
BASES = {"qwen3moe": ("Qwen/Qwen3-30B-A3B", "&moe_intermediate=32"), "mixtral": ("mistralai/Mixtral-8x7B-v0.1", "")}
EXPERTS = 16
# The grouped experts' tests (test_moe_grouped.py, and the FSDP2 run of test_moe_4bit.py): >= 32 experts,
# top-4, rows of whole 64-element blocks (grouped.usable), straight from the synthetic builder (fused experts; the loader quantizes them expert by expert).
WIDE = ("synthetic:Qwen/Qwen3-30B-A3B?layers=2&hidden=64&intermediate=64&moe_intermediate=64&heads=4&kv_heads=2"
        "&head_dim=16&vocab=384&experts=32&experts_per_tok=4")


def hub_layout(family: str, out: Path) -> Path:
    """`out`, holding the family's synthetic model with per-expert tensors (built once per directory)."""
    import torch
    from safetensors.torch import load_file, save_file

    from finetune.plan.archs import per_expert_keys, renamed_key
    from finetune.weights.built.synthetic import synthetic_dir

    if (out / "config.json").exists():
        return out
    base, extra = BASES[family]
    src = synthetic_dir(f"synthetic:{base}{SMALL}{extra}")
    model_type = json.loads((src / "config.json").read_text())["model_type"]
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    hub = {}
    for key, t in tensors.items():
        parts = per_expert_keys(key, model_type, EXPERTS)
        if parts is None:
            hub[renamed_key(key, model_type) or key] = t
            continue
        for e, names in enumerate(parts):
            for name, piece in zip(names, torch.chunk(t[e], len(names), dim=0)):
                hub[name] = piece.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(hub, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    return out
