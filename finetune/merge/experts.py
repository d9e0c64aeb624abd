"""Merging LoRA on fused MoE experts (lora.target_parameters, peft's ParamWrapper).

peft saves an adapted 3-D parameter [E, out, in] as one A [r*E, in] and one B [out, r*E] under its experts
module. When a module has several adapted parameters, peft wraps one ParamWrapper in the next, in the
order the module registers them (gate_up_proj, then down_proj, in transformers 5's MixtralExperts and
Qwen3MoeExperts), so the last one wrapped is saved as `<experts>.lora_A.weight` and the one before as
`<experts>.base_layer.lora_A.weight`. Expert e's update is scale * B_e @ A_e with A_e = A.reshape(E, r,
in)[e] and B_e = B.reshape(out, r, E)[:, :, e] (peft's get_delta_weight: "o r e, e r i -> e o i").

The base holds the experts either fused (a checkpoint written by transformers 5, as the synthetic models
are) or per expert (the hub's Mixtral and Qwen3-MoE files, plan.archs.EXPERT_LAYOUTS): then each
per-expert tensor gets its rows of its expert's update (Mixtral's w1 the gate rows, w3 the up rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.plan.archs import per_expert_keys
from finetune.util.errors import RecipeError

ORDER = ("gate_up_proj", "down_proj")  # the experts modules' parameter order: peft's nesting order
_BASE = ".base_layer"


@dataclass(frozen=True)
class ExpertUpdate:
    """Where one base tensor's update comes from: the fused parameter's A/B keys, and for a per-expert
    tensor its expert and its rows of that expert's update."""
    fused: str
    keys: tuple[str, str]
    expert: int | None = None
    rows: tuple[int, int] | None = None


def _unwrap(module: str) -> tuple[str, int]:
    depth = 0
    while module.endswith(_BASE):
        module, depth = module[: -len(_BASE)], depth + 1
    return module, depth


def _targeted(name: str, targets) -> bool:
    return any(name == t or name.endswith(f".{t}") for t in targets or [])


def resolve(pairs: dict, cfg: dict, shapes: dict, model_type: str, experts: int) -> dict[str, ExpertUpdate]:
    """{base tensor name: ExpertUpdate} for every adapter module that wraps parameters, not a Linear.
    `pairs`: {adapter module: (A key, B key)}; `shapes`: the base's {tensor name: shape}."""
    groups: dict[str, dict[int, tuple[str, str]]] = {}
    for mod, ab in pairs.items():
        if f"{mod}.weight" not in shapes:
            module, depth = _unwrap(mod)
            groups.setdefault(module, {})[depth] = ab
    out: dict[str, ExpertUpdate] = {}
    for module, by_depth in groups.items():
        params = [p for p in ORDER if _targeted(f"{module}.{p}", cfg.get("target_parameters"))]
        if not params or sorted(by_depth) != list(range(len(params))):
            raise RecipeError([f"the adapter targets {module}, which the base does not have: wrong base model?"],
                              "merge")
        for k, p in enumerate(params):
            fused, ab = f"{module}.{p}", by_depth[len(params) - 1 - k]
            if fused in shapes:
                out[fused] = ExpertUpdate(fused, ab)
            else:
                out.update(_per_expert(fused, ab, shapes, model_type, experts))
    return out


def _per_expert(fused: str, ab, shapes: dict, model_type: str, experts: int) -> dict[str, ExpertUpdate]:
    sources = per_expert_keys(fused, model_type, experts)
    if not sources or any(k not in shapes for parts in sources for k in parts):
        raise RecipeError([f"the adapter targets {fused}, which the base holds neither fused nor per expert: "
                           "wrong base model?"], "merge")
    out = {}
    for e, parts in enumerate(sources):
        start = 0
        for key in parts:
            rows = shapes[key][0]
            out[key] = ExpertUpdate(fused, ab, e, (start, start + rows))
            start += rows
    return out


def expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int, scale: float, update: ExpertUpdate) -> torch.Tensor:
    """The fp32 update of the base tensor `update` describes: all experts [E, out, in] for a fused one,
    else its expert's rows [rows, in]."""
    r = a.shape[0] // experts
    a3 = a.to(torch.float32).reshape(experts, r, a.shape[-1])  # [E, r, in]
    b3 = b.to(torch.float32).reshape(b.shape[0], r, experts)  # [out, r, E]
    if update.expert is None:
        return torch.einsum("ore,eri->eoi", b3, a3) * scale
    lo, hi = update.rows
    return (b3[lo:hi, :, update.expert] @ a3[update.expert]) * scale


def rank(a: torch.Tensor, experts: int) -> int:
    return a.shape[0] // experts


def as_trained(name: str, w: torch.Tensor, read, q, model_type: str, experts: int) -> torch.Tensor | None:
    """The expert weight `name` (`w`) as 4-bit training held it, for `--target nf4`: each expert quantized
    alone, as weights/experts/module.py quantizes it (gate and up rows together), then dequantized. A per-expert
    tensor (Mixtral's w1) is quantized with its expert's other parts (`read(key)` reads one), and keeps its
    rows. None when `name` is no expert weight."""
    from finetune.merge.plan import quant_roundtrip

    if name.endswith(tuple(f"experts.{p}" for p in ORDER)) and w.dim() == 3:
        return torch.stack([quant_roundtrip(w[e], q) for e in range(w.shape[0])])
    home = _expert_home(name, model_type, experts)
    if home is None:
        return None
    parts = [w if key == name else read(key) for key in home]
    lo = sum(p.shape[0] for p in parts[:home.index(name)])
    return quant_roundtrip(torch.cat(parts), q)[lo:lo + w.shape[0]]


def _expert_home(name: str, model_type: str, experts: int) -> list[str] | None:
    """The checkpoint keys of the expert (and projection) that the per-expert tensor `name` belongs to."""
    import re

    from finetune.plan.archs import EXPERT_LAYOUTS

    if model_type not in EXPERT_LAYOUTS:
        return None
    fused_at, stored, params = EXPERT_LAYOUTS[model_type]
    m = re.fullmatch(rf"(.*)\.{re.escape(stored)}\.(\d+)\.(\w+)\.weight", name)
    if not m:
        return None
    prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
    param = next((p for p, names in params.items() if part in names), None)
    if param is None or e >= experts:
        return None
    return per_expert_keys(f"{prefix}.{fused_at}.{param}", model_type, experts)[e]


def roundtrip_fused(model, q) -> None:
    """Every fused 3-D expert parameter of a loaded model, as 4-bit training held it (as_trained)."""
    for module in model.modules():
        for pname in ORDER:
            p = getattr(module, pname, None)
            if isinstance(p, torch.nn.Parameter) and p.dim() == 3:
                p.data = as_trained(f"experts.{pname}", p.data, None, q, "", 0).to(p.dtype)
