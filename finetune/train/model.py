"""Tokenizer and base model from the recipe's `model` and `quantization` sections.

The quantized base is frozen; only LoRA adapters (lora.py) train. Every GPU-only choice (flash-attn) is
resolved here against what this machine has, with one printed line when it changes.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from finetune.recipe import ModelSpec, QuantizationSpec
from finetune.util.builtin import builtin_dir
from finetune.util.dtypes import torch_dtype
from finetune.util.errors import RecipeError
from finetune.util.log import log


def resolve_name(name: str) -> str:
    """builtin:* -> the local directory the project builds; anything else is passed to transformers."""
    if name.startswith("builtin:"):
        return str(builtin_dir(name, "model.name"))
    if name.startswith("synthetic:"):
        from finetune.train.synthetic import synthetic_dir

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


def bnb_config(q: QuantizationSpec, model_dtype: str):
    """QuantizationSpec -> transformers BitsAndBytesConfig (None for mode: none)."""
    from transformers import BitsAndBytesConfig

    if q.mode == "none":
        return None
    if q.mode == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.mode,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(q.compute_dtype),
        # The packed 4-bit bytes live in a tensor of this dtype. FSDP shards and gathers it like any other
        # parameter, so it must be the dtype of every other parameter (model.dtype) and never be cast.
        bnb_4bit_quant_storage=torch_dtype(q.quant_storage or model_dtype),
    )


def _check_weights_format(path: str, allow_pickle: bool):
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


def default_device() -> torch.device:
    """The device a process without an Accelerator computes on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(spec: ModelSpec, quant: QuantizationSpec, placement=None, quiet: bool = False):
    """Load the frozen base: quantized per `quant`, non-quantized parameters in `spec.dtype`, through the
    streaming loader (train/base.py) for the placement (None: the whole model in this process). `quiet`
    silences the attention fallback line (see resolve_attention).

    Two kinds of base still go through transformers' `from_pretrained`, and only unsharded: int8
    (LLM.int8 weights cannot be sharded by FSDP at all) and pickle-only checkpoints the recipe allows
    (the streaming reader reads safetensors only)."""
    from finetune.train.load import Placement

    # No placement (eval, generate, quantize, merge checks): the whole model on this process's GPU when there
    # is one, as training puts it; the CPU only without CUDA.
    placement = placement or Placement(device=default_device())
    path = local_checkpoint(resolve_name(spec.name), spec)
    _check_weights_format(path, spec.allow_pickle)
    attn = resolve_attention(spec.attn_implementation, quiet)
    if quant.mode == "int8" or not any(Path(path).glob("*.safetensors")):
        if placement.mode != "whole":
            raise RecipeError([f"model.name: {spec.name}: FSDP loads safetensors 4-bit (or unquantized) bases "
                               "shard by shard; int8 and pickle-only checkpoints load whole, without FSDP"])
        model = _from_pretrained(path, spec, quant, attn)
    else:
        from transformers import AutoConfig

        from finetune.train.base import load_base

        config = text_decoder(AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code), quiet)
        model = load_base(Path(path), config, torch_dtype(spec.dtype), bnb_config(quant, spec.dtype), placement,
                          attn, spec.trust_remote_code)
    model.config.use_cache = False  # training never uses the KV cache; it would also break packing masks
    for p in model.parameters():
        p.requires_grad_(False)
    keep_buffers_fp32(model)
    from finetune.train.distributed import disable_cpu_weight_repacking

    # bitsandbytes repacks 4-bit weights in place on AVX512-BF16 CPUs during eval forwards, which corrupts
    # later training steps and every FSDP gather (see disable_cpu_weight_repacking); keep the trained layout.
    disable_cpu_weight_repacking(model)
    return model


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


def _from_pretrained(path: str, spec: ModelSpec, quant: QuantizationSpec, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, revision=spec.revision, dtype=torch_dtype(spec.dtype), quantization_config=bnb_config(quant, spec.dtype),
        attn_implementation=attn, trust_remote_code=spec.trust_remote_code,
        use_safetensors=None if spec.allow_pickle else True)


def keep_buffers_fp32(model):
    """RoPE's inv_freq (and similar buffers) must stay fp32: in bf16 the rotary angles of late positions
    lose precision. Loading in a half dtype casts them; put them back."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = buf.float()


def enable_checkpointing(model, spec: ModelSpec):
    """Gradient checkpointing per the recipe. Non-reentrant by default: it handles inputs that do not
    require grad (frozen embeddings before the first adapter) and composes with FSDP2."""
    if not spec.gradient_checkpointing:
        return
    kwargs = {"use_reentrant": spec.reentrant_checkpointing}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # transformers 5 name
    if spec.reentrant_checkpointing:
        # Reentrant checkpointing only builds a graph when an input requires grad.
        model.enable_input_require_grads()


def quantized_bytes_per_param(model) -> float:
    """Storage bytes per weight element of the quantized linear layers (about 0.5 for 4-bit)."""
    import bitsandbytes as bnb

    nbytes = n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight
            nbytes += w.numel() * w.element_size()
            n += m.in_features * m.out_features
    return nbytes / n if n else float("nan")
