"""Builds a synthetic model (util/synthetic_names.py names it) into the cache: the architecture's skeleton on meta
gives every tensor's name and shape; each tensor is drawn from its own seeded generator (normal, std
initializer_range; norm weights ones) and written in bf16 to safetensors shards of at most SHARD_BYTES,
so building a large model holds one shard at a time. The tiny tokenizer goes along, so the builtin data
works with any synthetic model whose vocabulary holds its ids.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from finetune.util import builtin, synthetic_names
from finetune.util.errors import RecipeError

SHARD_BYTES = 512 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def synthetic_dir(name: str, what: str = "model.name") -> Path:
    """The local directory of the synthetic model `name`, built on first use (atomically: ranks may race)."""
    from finetune.plan.archs import find_config

    base, overrides, seed = synthetic_names.parse(name, what)
    base_cfg, where = find_config(base)
    if base_cfg is None:
        raise RecipeError([f"{what}: '{name}': base '{base}': {where}"])
    cfg = synthetic_names.config_for(base_cfg, overrides)
    device = synthetic_names.draw_device(name)
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError([f"{what}: '{name}' draws its weights on a CUDA GPU (device=cuda) and this machine has "
                           "none. Fix: drop device=cuda"])
    return builtin.atomic_build(synthetic_names.cache_dir(name), lambda out: build(out, cfg, seed, device))


def _tensor_names(cfg: dict) -> tuple[list[tuple[str, tuple, bool]], object, str]:
    """([(name, shape, is a norm weight)] of every parameter the architecture has, in model order), config,
    the model class's name."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # on meta the head is not tied yet; a tied checkpoint holds the embedding alone
    out, seen = [], set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied head is the embedding: stored once, as a tied checkpoint stores it
                continue
            seen.add(id(p))
            norm = "norm" in type(module).__name__.lower()
            out.append((f"{mname}.{pname}", tuple(p.shape), norm))
    return out, config, type(model).__name__


def build(out: Path, cfg: dict, seed: int, device: str = "cpu") -> None:
    from safetensors.torch import save_file

    tok_dir = builtin.model_dir()
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    if cfg.get("vocab_size", 0) < vocab:
        raise RecipeError([f"model.name: a synthetic model needs vocab >= {vocab} (the tiny tokenizer's)"])
    names, config, arch = _tensor_names(cfg)
    std = float(cfg.get("initializer_range", 0.02))
    weight_map, shard, size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, size
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for i, (key, shape, norm) in enumerate(names):
        gen = torch.Generator(device).manual_seed(seed * 1_000_003 + i)
        if norm:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:  # drawn in fp32 on `device`, rounded to bf16 there; only the bf16 copy comes to the host
            t = (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()
        shard[key] = t
        size += shard[key].numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum((out / f).stat().st_size for f in files)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    tok_cfg = json.loads((tok_dir / "config.json").read_text())
    config.update({k: tok_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    config.dtype = torch.bfloat16
    config.architectures = [arch]  # as a published checkpoint names its class (TRL and others read it)
    config.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, out / f)
