"""Pure pieces of `finetune merge`: sizes, adapter key mapping, adapter feature checks, LoRA scaling,
the output shard plan, and the per-tensor arithmetic (delta and the NF4 round trip).

Nothing here reads a whole model: functions take tensor names, shapes and single tensors, so `merge.py`
can stream the base one shard at a time.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from finetune.util.errors import RecipeError

OUT_DTYPES = ("bf16", "fp16", "fp32")  # `merge --dtype`: the dtypes a merged model is written in

# ---------------------------------------------------------------------------------------------------
# Adapter: which features we can fold into plain weights, and where each LoRA pair goes.

# adapter_config.json keys that do not change the merged weights (they select targets, which the saved
# tensors already tell us, or only matter while training). Every other key must be falsy/default:
# an unknown feature is refused rather than silently merged wrong (allowlist, not blocklist).
_BENIGN = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
           "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout",
           "use_rslora", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
           "megatron_core", "runtime_config", "qalora_group_size", "init_lora_weights", "loftq_config",
           "eva_config", "corda_config", "lora_ga_config", "bias", "ensure_weight_tying", "fan_in_fan_out",
           "target_parameters",  # LoRA on fused MoE expert parameters: folded by merge/experts.py
           "use_dora"}  # DoRA: the magnitude rescales each merged row (merged_tensor)
# These initialisations rewrite the *base* weights at init (residual = W - B0 A0), so the saved adapter
# only makes sense on top of a base we do not have. (True/False/gaussian/eva/orthogonal leave the base
# alone: their initial B @ A is zero.)
_BASE_CHANGING_INIT = ("pissa", "olora", "corda", "loftq", "lora-ga", "lora_ga")
_WHY = {"lora_bias": "LoRA bias terms", "modules_to_save": "fully trained extra modules",
        "trainable_token_indices": "trained token embeddings", "layer_replication": "replicated layers",
        "use_qalora": "QA-LoRA",
        "megatron_config": "Megatron parallel layers", "alora_invocation_tokens": "activated LoRA"}


def adapter_problems(cfg: dict) -> list[str]:
    """Every reason this adapter cannot be merged exactly by `merge` (empty list: supported)."""
    out = []
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        out.append(f"peft_type {cfg.get('peft_type')!r}: only LoRA adapters can be merged")
    for key, value in cfg.items():
        if key not in _BENIGN and value not in (None, False, {}, [], "", 0):
            what = _WHY.get(key, "a feature this merge does not know")
            out.append(f"{key}={value!r} ({what}) is not supported; merge it with peft's "
                       "merge_and_unload on the full model instead")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INIT):
        out.append(f"init_lora_weights={cfg['init_lora_weights']!r} changes the base weights at init; "
                   "convert the adapter to a plain LoRA first (peft's path_initial_model_for_weight_conversion)")
    if cfg.get("bias", "none") != "none":
        out.append(f"bias={cfg['bias']!r}: trained biases are not supported (use bias: none)")
    if cfg.get("fan_in_fan_out"):
        out.append("fan_in_fan_out=True (Conv1D layers, GPT-2 style) is not supported")
    if cfg.get("use_dora") and cfg.get("target_parameters"):
        out.append("use_dora with target_parameters: peft trains fused expert parameters without DoRA, so this "
                   "adapter was not made by peft; merge it with the tool that trained it")
    return out


_PAIR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# DoRA's magnitude: peft 0.21 saves `<module>.lora_magnitude_vector`; older files keep the adapter name
# and the inner layer's `.weight`.
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$")
_PREFIX = "base_model.model."


def magnitude_keys(adapter_keys) -> dict[str, str]:
    """Adapter tensor names -> {module name in the base: its DoRA magnitude key} (empty without DoRA)."""
    found = {}
    for key in adapter_keys:
        m = _MAGNITUDE.match(key)
        if m:
            found[m["module"].removeprefix(_PREFIX)] = key
    return found


def pair_keys(adapter_keys) -> dict[str, tuple[str, str]]:
    """Adapter tensor names -> {module name in the base: (lora_A key, lora_B key)}.

    peft saves `base_model.model.<module>.lora_A.weight` (the adapter name is dropped on save; older
    files keep it: `lora_A.default.weight`). Any other tensor means a feature we do not merge.
    """
    pairs: dict[str, dict[str, str]] = {}
    odd = []
    magnitudes = magnitude_keys(adapter_keys)
    for key in adapter_keys:
        if key in magnitudes.values():
            continue
        m = _PAIR.match(key)
        if not m:
            odd.append(key)
            continue
        module = m["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m["ab"]] = key
    half = sorted(mod for mod, ab in pairs.items() if len(ab) != 2)
    problems = []
    if odd:
        shown = ", ".join(odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
        problems.append(f"adapter tensors that are not LoRA A/B weights or DoRA magnitudes (embeddings, "
                        f"saved modules?): {shown}")
    if half:
        problems.append(f"LoRA layers missing their A or B matrix: {', '.join(half[:3])}")
    lone = sorted(set(magnitudes) - set(pairs))
    if lone:
        problems.append(f"DoRA magnitudes without LoRA A/B weights: {', '.join(lone[:3])}")
    if not pairs and not problems:
        problems.append("the adapter holds no LoRA weights")
    if problems:
        raise RecipeError(problems, "adapter")
    return {mod: (ab["A"], ab["B"]) for mod, ab in sorted(pairs.items())}


def scaling(cfg: dict, module: str, rank: int) -> float:
    """peft's scale for one module: alpha / r, or alpha / sqrt(r) with rslora; per-module patterns win."""
    alpha = lora_alpha(cfg, module)
    r = _per_module(cfg, "rank_pattern", module, cfg.get("r", 8))
    if r != rank:
        raise RecipeError([f"{module}: adapter_config says rank {r}, the saved lora_A has rank {rank}"],
                          "adapter")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def lora_alpha(cfg: dict, module: str) -> float:
    """The module's alpha: its alpha_pattern entry, else the adapter's lora_alpha."""
    return _per_module(cfg, "alpha_pattern", module, cfg.get("lora_alpha", 8))


def _per_module(cfg: dict, key: str, module: str, default):
    from peft.utils.other import get_pattern_key  # peft's own matcher, so patterns resolve exactly as in training

    pattern = cfg.get(key) or {}
    return pattern.get(get_pattern_key(pattern.keys(), module), default)


# ---------------------------------------------------------------------------------------------------
# Output shards, planned from the input headers before any tensor is read, so file names
# (model-0000i-of-0000n) are known up front and each output shard is written once.


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str  # input shard file name


def out_nbytes(t: TensorInfo, out_dtype: torch.dtype) -> int:
    dt = out_dtype if t.dtype.is_floating_point else t.dtype
    return math.prod(t.shape) * dt.itemsize


def plan_shards(tensors: list[TensorInfo], out_dtype: torch.dtype, max_bytes: int) -> list[list[TensorInfo]]:
    """Greedy, in input order: a new shard starts when the next tensor would pass max_bytes (a tensor
    bigger than the limit gets a shard of its own, as in transformers)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        n = out_nbytes(t, out_dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards if shards[0] else []


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


# ---------------------------------------------------------------------------------------------------
# Per-tensor arithmetic.


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """(scale) * B @ A in fp32, whatever dtype the adapter was saved in."""
    return (b.to(torch.float32) @ a.to(torch.float32)) * scale


@dataclass(frozen=True)
class QuantSpec:
    """How training stored the frozen base: the weight was cast to `dtype` and then 4-bit quantized."""
    quant_type: str = "nf4"
    double_quant: bool = True
    dtype: torch.dtype = torch.float32
    blocksize: int = 64  # bitsandbytes' Params4bit default, which transformers' 4-bit loader uses


def quant_roundtrip(w: torch.Tensor, q: QuantSpec) -> torch.Tensor:
    """The weight exactly as the 4-bit model used it: cast to the model dtype, quantize, dequantize.
    (transformers casts to the load dtype before bitsandbytes quantizes; quant_storage only repacks the
    same bytes, so it does not change values.)"""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(w.to(q.dtype).contiguous(), blocksize=q.blocksize,
                                       compress_statistics=q.double_quant, quant_type=q.quant_type)
    return bnbf.dequantize_4bit(packed, state)


def merged_tensor(w: torch.Tensor, out_dtype: torch.dtype, delta: torch.Tensor | None = None,
                  quant: QuantSpec | None = None, cast_to: torch.dtype | None = None,
                  magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """One output tensor. `cast_to`: the dtype training held this tensor in (nf4 target), `quant`: it was
    4-bit during training, `magnitude`: DoRA's learned norm of each output row. The sum is formed in fp32
    and rounded once, to the output dtype."""
    if not w.is_floating_point():
        return w
    if quant is not None:
        w = quant_roundtrip(w, quant)
    elif cast_to is not None:
        w = w.to(cast_to)
    if delta is not None:
        if delta.shape != w.shape:
            raise RecipeError([f"LoRA update of shape {tuple(delta.shape)} does not fit a weight of shape "
                               f"{tuple(w.shape)}"], "adapter")
        w = w.to(torch.float32) + delta
    if magnitude is not None:
        w = dora_rescale(w, magnitude)
    return w.to(out_dtype).contiguous()


def dora_rescale(w: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's merged weight from W + s B A: each output row scaled to its learned magnitude, m / ||row||,
    as peft's DoRA forward and merge compute it. `w` is the base as the target says training held it (the
    dequantized 4-bit weight for nf4), so the norms are the ones training divided by."""
    if magnitude.shape != w.shape[:1]:
        raise RecipeError([f"DoRA magnitude of shape {tuple(magnitude.shape)} does not fit a weight of shape "
                           f"{tuple(w.shape)}"], "adapter")
    w = w.to(torch.float32)
    norm = torch.linalg.norm(w, dim=1)
    return w * (magnitude.to(torch.float32) / norm).unsqueeze(1)
