"""The merge's parity check: does the written model compute what base + adapter computes?

Reference, by target:
- original: plain peft (LoRA layers unmerged) on the unquantized base, in fp32;
- nf4: the 4-bit model exactly as training loaded it (bitsandbytes, the recipe's quant type, double
  quant and model dtype; MoE experts, which transformers leaves dense, quantized and dequantized expert
  by expert as weights/experts/module.py holds them) + the adapter in plain peft. Its compute dtype is set to fp32 for the check, so
  the comparison measures the merge, not bf16 matmul noise.
The merged model is loaded with plain `AutoModelForCausalLM` in fp32 (bf16/fp16 weights upcast exactly).

Memory policy: the full logits check holds ONE model at a time (merged logits are computed, the model is
freed, then the reference is loaded), each in fp32, and only runs when that fp32 model fits comfortably
(under FULL_CHECK_MAX_BYTES and under 40% of available RAM). Bigger models get the layer check instead:
a spread of merged weights are read back from the written shards, one at a time, and compared on random
inputs with peft's own LoRA layer wrapped around the base weight. Either way memory stays bounded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.util.dtypes import torch_dtype

FULL_CHECK_MAX_BYTES = 8 * 2**30  # fp32 bytes of the model; ~2B parameters
# Tolerance on max |logit difference| / max |reference logit|, by the coarser of the written dtype and
# the dtype training held the base in. bf16 keeps 8 mantissa bits (relative rounding 2^-9 per weight);
# a few layers of that give ~1e-2 relative logit error, so 3e-2 flags real bugs (a wrong scale, a missed
# or transposed update all move logits by O(1)) without failing on rounding.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FALLBACK_PROMPTS = ["The quick brown fox", "reverse: red blue green\n", "Once upon a time there was",
                    "sort: sun moon star\n"]


def parity_check(src, out_dir: Path, target: str, full_limit_bytes: int | None = None) -> dict:
    import psutil

    cfg = json.loads((Path(out_dir) / "config.json").read_text())
    out_dtype = torch_dtype(cfg["dtype"])
    train_dtype = torch_dtype(src.recipe.model.dtype) if (target == "nf4" and src.recipe) else torch.float32
    tol = max(TOLERANCE[out_dtype], TOLERANCE[train_dtype])
    fp32_bytes = 4 * _num_params(Path(out_dir))
    limit = FULL_CHECK_MAX_BYTES if full_limit_bytes is None else full_limit_bytes
    if fp32_bytes <= min(limit, 0.4 * psutil.virtual_memory().available):
        result = _logits_check(src, Path(out_dir), target)
    else:
        result = _layer_check(src, Path(out_dir), target)
    result["tolerance"] = tol
    result["status"] = "passed" if result["rel_diff"] <= tol else "failed"
    result["summary"] = (f"{result['kind']} check against {result['reference']}: max |diff| "
                         f"{result['max_abs_diff']:.3g}, relative {result['rel_diff']:.3g} "
                         f"(tolerance {tol:g})")
    return result


def _num_params(out_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                n += torch.Size(h.get_slice(k).get_shape()).numel()
    return n


def check_prompts(src, n: int = 4) -> list[str]:
    """Held-out prompts: the recipe's eval set if it is a local/builtin jsonl, else fixed generic text."""
    from finetune.util.builtin import BUILTIN_DATASETS, builtin_dir

    paths = []
    if src.recipe is not None:
        for s in list(src.recipe.data.eval_sources) + list(src.recipe.data.sources):
            if s.path in BUILTIN_DATASETS:
                paths.append(builtin_dir(s.path, kind="dataset") / "eval.jsonl")  # held out by construction
        paths += [Path(s.path) for s in src.recipe.data.eval_sources if s.path.endswith(".jsonl")]
    for p in paths:
        if p.is_file():
            rows = [json.loads(line) for line in p.read_text().splitlines()[:n] if line.strip()]
            prompts = [r.get("prompt") or r.get("text") for r in rows]
            if all(isinstance(x, str) and x for x in prompts) and prompts:
                return prompts
    return FALLBACK_PROMPTS[:n]


def _logits(model, tok, prompts) -> list[torch.Tensor]:
    from finetune.data.transfer import to_model_device

    model.eval()
    with torch.no_grad():
        return [model(**to_model_device(model, tok(p, return_tensors="pt"))).logits[0].float().cpu()
                for p in prompts]


def reference_model(src, target: str):
    """Base + adapter, unmerged, in plain peft: fp32 base for `original`, the training-time 4-bit base
    (fp32 compute) for `nf4`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.artefacts.adapter import quiet_peft_wrap
    from finetune.merge.experts import roundtrip_fused
    from finetune.merge.source import quant_spec
    from finetune.weights.bnb import disable_cpu_weight_repacking, four_bit_config

    if target == "nf4":
        q = quant_spec(src.recipe)
        storage = src.recipe.effective_quant_storage() if src.recipe else "float32"
        bnb = four_bit_config(q.quant_type, q.double_quant, torch.float32, torch_dtype(storage))
        base = AutoModelForCausalLM.from_pretrained(src.base_dir, quantization_config=bnb, dtype=q.dtype)
        disable_cpu_weight_repacking(base)  # the dequantize-then-matmul path training took, which merging reproduces
        roundtrip_fused(base, q)  # transformers leaves MoE experts dense; training held them 4-bit
    else:
        base = AutoModelForCausalLM.from_pretrained(src.base_dir, dtype=torch.float32)
    with quiet_peft_wrap():
        return PeftModel.from_pretrained(base, src.adapter_dir)


def _logits_check(src, out_dir: Path, target: str) -> dict:
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    prompts = check_prompts(src)
    merged = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    got = _logits(merged, tok, prompts)
    del merged
    gc.collect()  # one model in memory at a time
    want = _logits(reference_model(src, target), tok, prompts)
    diff = max((g - w).abs().max().item() for g, w in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    agree = sum((g.argmax(-1) == w.argmax(-1)).sum().item() for g, w in zip(got, want))
    positions = sum(w.shape[0] for w in want)
    return {"kind": "logits", "prompts": len(prompts), "positions": positions,
            "reference": "4-bit base + adapter (peft)" if target == "nf4" else "fp32 base + adapter (peft)",
            "max_abs_diff": diff, "rel_diff": diff / max(scale, 1e-12), "argmax_agreement": agree / positions}


def _layer_check(src, out_dir: Path, target: str, n_layers: int = 8) -> dict:
    """Big models: peft's LoRA Linear on the base weight vs the merged weight read back from disk."""
    from safetensors import safe_open

    from finetune.merge.plan import magnitude_keys, pair_keys
    from finetune.merge.source import base_tensors

    ad = safe_open(str(src.adapter_dir / "adapter_model.safetensors"), framework="pt")
    # Linear adapters only: fused MoE expert adapters (no `<module>.weight` in the base) are covered by the
    # full logits check; a big MoE model's layer check samples its attention and dense layers.
    names = {t.name for t in base_tensors(src.base_dir)}
    pairs = [(m, ab) for m, ab in pair_keys(ad.keys()).items() if f"{m}.weight" in names]
    picked = [pairs[round(i * (len(pairs) - 1) / max(n_layers - 1, 1))] for i in range(min(n_layers, len(pairs)))]
    base_weight, merged_weight = _base_reader(src, target), _merged_reader(out_dir)
    magnitudes = magnitude_keys(ad.keys())
    gen = torch.Generator().manual_seed(0)
    diff = scale = 0.0
    for module, (ka, kb) in picked:
        name = f"{module}.weight"
        w, a, b = base_weight(name), ad.get_tensor(ka).float(), ad.get_tensor(kb).float()
        m = ad.get_tensor(magnitudes[module]).float() if module in magnitudes else None
        layer = _peft_layer(src.adapter_config, module, w, a, b, m)
        x = torch.randn(4, w.shape[1], generator=gen)
        with torch.no_grad():
            want, got = layer(x), x @ merged_weight(name).T
        diff, scale = max(diff, (got - want).abs().max().item()), max(scale, want.abs().max().item())
    return {"kind": "layer", "layers": len(picked), "reference": "peft LoRA layer on the base weight",
            "max_abs_diff": diff, "rel_diff": diff / max(scale, 1e-12)}


def _base_reader(src, target: str):
    """name -> the base weight as the target says training held it (read from the base's shards)."""
    from safetensors import safe_open

    from finetune.merge.plan import quant_roundtrip
    from finetune.merge.source import base_tensors, four_bit_weights, quant_spec

    where_in = {t.name: t.source for t in base_tensors(src.base_dir)}
    four_bit = four_bit_weights(src.base_dir) if target == "nf4" else set()

    def read(name: str) -> torch.Tensor:
        with safe_open(str(src.base_dir / where_in[name]), framework="pt") as f:
            w = f.get_tensor(name)
        if target == "nf4":
            q = quant_spec(src.recipe)
            w = quant_roundtrip(w, q) if name in four_bit else w.to(q.dtype)
        return w
    return read


def _merged_reader(out_dir: Path):
    """name -> the merged weight in fp32, read back from the written shards."""
    from safetensors import safe_open

    index = out_dir / "model.safetensors.index.json"
    where_out = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    def read(name: str) -> torch.Tensor:
        with safe_open(str(out_dir / (where_out[name] if where_out else "model.safetensors")), "pt") as f:
            return f.get_tensor(name).float()
    return read


def _peft_layer(cfg: dict, module: str, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                magnitude: torch.Tensor | None = None):
    """peft's LoRA Linear around the base weight `w`: peft's own layer computes the scale (alpha/r or
    rslora's alpha/sqrt(r)), the A-then-B forward and, given a `magnitude`, DoRA's rescaling by the
    column norms, independently of the arithmetic in merge.plan."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    from finetune.merge.plan import lora_alpha

    alpha = lora_alpha(cfg, module)
    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    base.weight.data = w.float()
    lcfg = LoraConfig(r=a.shape[0], lora_alpha=alpha, lora_dropout=0.0, use_rslora=bool(cfg.get("use_rslora")),
                      use_dora=magnitude is not None)
    layer = LoraLinear(base, "default", lcfg, r=a.shape[0], lora_alpha=alpha, use_rslora=lcfg.use_rslora,
                       use_dora=lcfg.use_dora)
    layer.lora_A["default"].weight.data, layer.lora_B["default"].weight.data = a, b
    if magnitude is not None:
        layer.lora_magnitude_vector["default"].weight.data = magnitude
    return layer
