"""The inputs of a merge: the adapter (a run dir or a plain PEFT adapter dir), its base model (local, builtin
or the local HF cache, never downloaded) and the base's tensors, read from the safetensors headers only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import recipe as recipe_mod
from finetune.merge.plan import QuantSpec, TensorInfo, adapter_problems
from finetune.util.builtin import BUILTIN_MODELS, builtin_dir
from finetune.util.dtypes import torch_dtype
from finetune.util.errors import RecipeError
from finetune.util.untrusted import adapter_problem


@dataclass
class Source:
    adapter_dir: Path
    base_dir: Path
    base_name: str  # how the user refers to the base (hub id, path or builtin name)
    adapter_config: dict
    recipe: recipe_mod.Recipe | None = None
    run_dir: Path | None = None


def resolve_source(path: str | os.PathLike) -> Source:
    """A run dir (recipe.yaml + adapter/) or a plain PEFT adapter dir -> adapter, base and recipe."""
    p = Path(path).expanduser().resolve()
    if (p / "adapter" / "adapter_config.json").is_file():
        run_dir, adapter_dir = p, p / "adapter"
    elif (p / "adapter_config.json").is_file():
        run_dir, adapter_dir = None, p
    elif not p.exists():
        raise RecipeError([f"no such directory: {p}"], "merge")
    else:
        raise RecipeError([f"{p} is neither a run dir (recipe.yaml + adapter/) nor a PEFT adapter dir "
                           "(adapter_config.json)"], "merge")
    damaged = adapter_problem(adapter_dir)  # empty or truncated config or weights: one line, not a traceback
    if damaged:
        raise RecipeError([damaged])
    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise RecipeError([f"cannot read adapter_config.json: {e}"], str(adapter_dir)) from None
    problems = adapter_problems(cfg)
    if problems:
        raise RecipeError(problems, str(adapter_dir / "adapter_config.json"))
    recipe = None
    if run_dir is not None and (run_dir / "recipe.yaml").is_file():
        recipe = recipe_mod.load(run_dir / "recipe.yaml")
    base_name, base_dir = find_base(cfg, recipe)
    return Source(adapter_dir, base_dir, base_name, cfg, recipe, run_dir)


def find_base(cfg: dict, recipe) -> tuple[str, Path]:
    """The adapter's own base_model_name_or_path first (what training wrote), then the recipe's model."""
    names = [n for n in (cfg.get("base_model_name_or_path"), recipe and recipe.model.name) if n]
    revision = cfg.get("revision") or (recipe.model.revision if recipe else None)
    for name in names:
        if name in BUILTIN_MODELS:  # only known builtin models: any other name may be a local dir or cached
            return name, builtin_dir(name)
        if name.startswith("synthetic:"):  # adapters name these bases portably (artefacts/tokenizer.py and artefacts/adapter.py)
            from finetune.weights.built.synthetic import synthetic_dir

            return name, synthetic_dir(name)
        if Path(name).expanduser().is_dir():
            return name, Path(name).expanduser().resolve()
    for name in names:
        if "/" in name and not Path(name).is_absolute():
            try:  # the local HF cache only: merge never downloads
                from huggingface_hub import snapshot_download
                return name, Path(snapshot_download(name, revision=revision, local_files_only=True))
            except Exception:  # noqa: BLE001 - any miss means "not cached"; reported below
                continue
    if not names:
        raise RecipeError(["adapter_config.json names no base_model_name_or_path"], "adapter")
    raise RecipeError([f"base model {names[0]!r} is not a local directory nor in the local Hugging Face "
                       f"cache; fetch it first (e.g. `hf download {names[0]}`)"], "merge")


def base_tensors(base_dir: Path) -> list[TensorInfo]:
    """Names, shapes and dtypes from the shard headers only, in file order."""
    from safetensors import safe_open

    cfg = json.loads((base_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise RecipeError([f"{base_dir} holds pre-quantized weights; merge needs the unquantized base"], "merge")
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (base_dir / f).is_file()]
        if missing:
            raise RecipeError([f"{index} names {len(missing)} shard(s) that are not there, e.g. {missing[0]}: an "
                               "incomplete download? fetch the missing files"], "merge")
    elif (base_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise RecipeError([f"{base_dir} has no safetensors weights (merge does not read pickle .bin files)"],
                          "merge")
    out = []
    for name in files:
        with safe_open(str(base_dir / name), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out.append(TensorInfo(key, tuple(s.get_shape()), st_dtype(s.get_dtype()), name))
    return out


def st_dtype(code: str) -> torch.dtype:
    """A safetensors header dtype; codes torch has no name for (F8_*, U16...) count as bytes."""
    try:
        return torch_dtype(code)
    except ValueError:
        return torch.uint8


def four_bit_weights(base_dir: Path) -> set[str]:
    """Weights that bitsandbytes held in 4-bit during training: every plain nn.Linear transformers'
    4-bit loader converts (it skips the output head, tied weights and fp32-pinned modules). Found on a
    meta-device copy of the model, with transformers' own skip rules, so it matches the loader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
    skip = list(set(get_keys_to_not_convert(model)) | set(getattr(model, "_keep_in_fp32_modules", None) or []))
    return {f"{n}.weight" for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and should_convert_module(n, skip)}


def quant_spec(recipe) -> QuantSpec:
    if recipe is None:  # plain adapter: assume the recipe defaults, and say so in the card
        recipe = recipe_mod.Recipe()
    q = recipe.quantization
    if q.mode not in ("nf4", "fp4"):
        raise RecipeError([f"--target nf4: this run trained on a {q.mode!r} base, not a 4-bit one; "
                           "use --target original"], "merge")
    return QuantSpec(quant_type=q.mode, double_quant=q.double_quant, dtype=torch_dtype(recipe.model.dtype))
