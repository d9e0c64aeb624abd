"""Read a GGUF back with llama.cpp's own reader (the gguf-py vendored with the pinned converter) and compare
every tensor with the weights it was converted from.

- Names: the reader's names are llama.cpp's (`blk.0.attn_q.weight`); gguf-py's own TensorNameMap maps each
  Hugging Face name to it, so the check uses the converter's mapping, not one of ours.
- MoE experts: the converter stacks each layer's per-expert weights into one tensor per projection; the
  check compares it with the merged experts stacked the same way (gguf/stacked_experts.py).
- llama.cpp's llama architecture stores q_proj and k_proj with the rotary halves interleaved per head (the
  converter's `LlamaModel.permute`); the check undoes that permutation on the GGUF tensor before comparing.
  For a LoRA GGUF only lora_b carries the output rows, so only lora_b is permuted back.
- Tolerances by the type the tensor was written in: F32 exact; F16 equal to the source rounded to fp16 (the
  converter's cast); Q8_0 within half a quantization step of its 32-value block (step = max|block| / 127)
  plus what storing that step in fp16 adds (see _q8_bound); llama-quantize's K-quants and the fallbacks it picks
  for rows too short for them: relative RMS error within REL_RMS.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

Q8_BLOCK = 32
# llama-quantize's types (export --outtype q4_k_m and friends): a tensor's relative RMS error at most this. A
# block of b levels spread over its values' range rounds with RMS about range / (b - 1) / sqrt(12): for normal
# weights about 0.08 of their RMS at 4 bits (16 levels), 0.04 at 5, 0.02 at 6; the bounds are 1.5x that.
REL_RMS = {"Q4_K": 0.12, "Q4_0": 0.14, "Q4_1": 0.12, "Q5_K": 0.06, "Q5_0": 0.07, "Q5_1": 0.06, "Q6_K": 0.03}
_PERMUTED = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}


def gguf_module(converter: Path):
    """The vendored gguf-py (put first on sys.path: an installed `gguf` of another version must not win)."""
    path = str(converter / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    return gguf


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` along the output rows: (n_head, half, 2, ...) -> (n_head, 2, half, ...)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensor(gguf, t) -> torch.Tensor:
    """A ReaderTensor as a float32 torch tensor in Hugging Face's (rows, cols) order."""
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(arr.reshape(shape).copy())


def _q8_bound(src: torch.Tensor) -> torch.Tensor:
    """Per element: half a Q8_0 step d = max|block| / 127 (the rounding to int8), plus up to 127 times the
    fp16 rounding of d (ggml rounds with the exact d, then stores d as fp16): relative 2^-11, or half the
    smallest fp16 subnormal (2^-25) where d is that small."""
    blocks = src.reshape(-1, Q8_BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    bound = d * (0.5 + 127 * 2.0 ** -11) + 127 * 2.0 ** -25
    return bound.expand_as(blocks).reshape(src.shape)


def compare(gguf, t, got: torch.Tensor, src: torch.Tensor) -> tuple[bool, float]:
    """(within tolerance, max abs difference) of one tensor; see the module doc for the tolerances."""
    src = src.float()
    if tuple(got.shape) != tuple(src.shape):
        return False, float("inf")
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        ok = torch.equal(got, src)
    elif t.tensor_type == gguf.GGMLQuantizationType.F16:
        ok = torch.equal(got, src.half().float())
    elif t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        ok = bool(((got - src).abs() <= _q8_bound(src)).all())
    elif t.tensor_type.name in REL_RMS:
        ok = bool((got - src).norm() <= REL_RMS[t.tensor_type.name] * src.norm())
    else:
        return False, float("inf")
    return ok, float((got - src).abs().max()) if src.numel() else 0.0


def _n_head(hf_name: str, config: dict) -> int | None:
    for proj, key in _PERMUTED.items():
        if f".{proj}." in hf_name or hf_name.endswith(f".{proj}"):
            return int(config.get(key) or config["num_attention_heads"])
    return None


def check_tensors(converter: Path, gguf_path: Path, sources: dict, config: dict, lora: bool = False) -> dict:
    """Every tensor of `gguf_path` against `sources` (HF name -> tensor, lazily loadable via a mapping);
    returns {"tensors", "checked", "mismatched": [...], "types": {type: count}, "max_abs_diff": {type: x}}."""
    from finetune.gguf.stacked_experts import StackedSources

    gguf = gguf_module(converter)
    if not lora:  # MoE experts as the converter stacks them (gguf/stacked_experts.py)
        sources = StackedSources(sources)
    reader = gguf.GGUFReader(str(gguf_path))
    arch_name = reader.fields["general.architecture"].contents()
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    name_map = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    by_gguf = {}
    for hf_name in sources:
        stem, suffix = _split_suffix(hf_name, lora)
        mapped = name_map.get_name(stem, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            by_gguf[mapped + suffix] = hf_name
    result = {"tensors": len(reader.tensors), "checked": 0, "mismatched": [], "types": {}, "max_abs_diff": {}}
    for t in reader.tensors:
        kind = t.tensor_type.name
        result["types"][kind] = result["types"].get(kind, 0) + 1
        hf_name = by_gguf.get(t.name)
        if hf_name is None:
            result["mismatched"].append(f"{t.name}: no source tensor maps to it")
            continue
        got = read_tensor(gguf, t)
        n_head = _n_head(hf_name, config) if arch_name == "llama" and (not lora or "lora_B" in hf_name) else None
        if n_head:
            got = unpermute(got, n_head)
        ok, diff = compare(gguf, t, got, sources[hf_name])
        result["checked"] += 1
        result["max_abs_diff"][kind] = max(result["max_abs_diff"].get(kind, 0.0), diff)
        if not ok:
            origin = getattr(sources, "parts", {}).get(hf_name, hf_name)
            result["mismatched"].append(f"{t.name} ({origin}, {kind}): max abs diff {diff:.3g}")
    missing = sorted(set(sources) - set(by_gguf.values()))
    result["mismatched"] += [f"{n}: not in the GGUF" for n in missing]
    return result


def _split_suffix(hf_name: str, lora: bool) -> tuple[str, str]:
    """('model.layers.0.self_attn.q_proj', '.lora_a') for a PEFT key; (name, '') for a plain weight."""
    if not lora:
        return hf_name, ""
    for part, suffix in ((".lora_A.weight", ".lora_a"), (".lora_B.weight", ".lora_b")):
        if hf_name.endswith(part):
            stem = hf_name[: -len(part)].removeprefix("base_model.model.")
            return stem + ".weight", suffix
    return hf_name, ""
