"""Names to places and choices to what this machine has: a recipe's model name to a local checkpoint
directory (builtin, synthetic, a directory, a hub id), the tokenizer, and the attention kernel (flash-attn
only where it imports and CUDA is there, with one printed line when it changes).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from finetune.recipe import ModelSpec
from finetune.util.builtin import builtin_dir
from finetune.util.errors import RecipeError
from finetune.util.log import log


def resolve_name(name: str) -> str:
    """builtin:* -> the local directory the project builds; anything else is passed to transformers."""
    if name.startswith("builtin:"):
        return str(builtin_dir(name, "model.name"))
    if name.startswith("synthetic:"):
        from finetune.weights.built.synthetic import synthetic_dir

        return str(synthetic_dir(name))
    if os.path.isdir(os.path.expanduser(name)):
        return str(Path(name).expanduser().resolve())
    return name


def resolve_attention(requested: str, quiet: bool = False) -> str:
    """The attention implementation this machine runs for `requested`: flash_attention_2 needs the
    flash-attn package, importable, and CUDA; SDPA (same math) stands in otherwise, with one line saying
    why unless `quiet`. The package is checked before the device, so the CPU harness runs the same checks."""
    if requested != "flash_attention_2":
        return requested
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        why = "flash-attn is not installed"
    elif (broken := _flash_attn_import_error()) is not None:
        why = f"flash-attn is installed but fails to import: {broken}"
    elif not torch.cuda.is_available():
        why = "no CUDA device"
    else:
        return requested
    if not quiet:
        log.info(f"attention: flash_attention_2 -> sdpa ({why})")
    return "sdpa"


def _flash_attn_import_error() -> str | None:
    # A wheel built for another torch or CUDA is found but fails at import ("undefined symbol ...").
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: do not use it
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def check_weights_format(path: str, allow_pickle: bool):
    """Refuse pickle checkpoints (they can run code) unless the recipe allows them."""
    p = Path(path)
    if not p.is_dir():
        return  # hub id: transformers prefers safetensors; use_safetensors below enforces it
    has_safe = any(p.glob("*.safetensors"))
    has_pickle = any(p.glob("*.bin")) or any(p.glob("*.pt"))
    if not has_safe and has_pickle and not allow_pickle:
        raise RecipeError([f"model.name: {path} has only pickle weights (.bin/.pt), which can execute code "
                           "when loaded; convert them to safetensors or set model.allow_pickle: true"])
    if not has_safe and not has_pickle:
        raise RecipeError([f"model.name: {path} holds no weights (*.safetensors)"])


def load_tokenizer(spec: ModelSpec, path: str | None = None):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path or resolve_name(spec.name), revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code)
    except OSError as e:  # not on disk and not in the HF cache (no network), as load_model reports it
        raise RecipeError([f"model.name: cannot load the tokenizer of '{spec.name}': {str(e).splitlines()[0]}"]) from None
    if tok.pad_token is None:  # batching needs a pad id; padded positions are masked out of the loss anyway
        tok.pad_token = tok.eos_token
    return tok


# Multimodal checkpoints whose text decoder is trained alone (Gemma 3 4B-27B): AutoModelForCausalLM would
# build the whole image-text model; the decoder's own config builds Gemma3ForCausalLM, and the loader finds
# its tensors under the checkpoint's language-model prefix (load.Checkpoint.link).
TEXT_DECODERS = {"gemma3"}


def text_decoder(config, quiet: bool = False):
    """The config to build: a multimodal checkpoint's text_config for the families in TEXT_DECODERS."""
    if config.model_type in TEXT_DECODERS and getattr(config, "text_config", None) is not None:
        if not quiet:
            log.info(f"model: training the text decoder ({config.text_config.model_type}) of a "
                     f"{config.model_type} image-text checkpoint; the vision tower is not loaded")
        return config.text_config
    return config


def local_checkpoint(path: str, spec: ModelSpec) -> str:
    """A local directory for `path`: itself, or the hub snapshot (from the HF cache, downloading what is
    missing unless HF_HUB_OFFLINE)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, revision=spec.revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - not on disk, not in the cache, no network: one clear line
        raise RecipeError([f"model.name: cannot load '{spec.name}': {str(e).splitlines()[0]}"]) from None
