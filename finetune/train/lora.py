"""LoRA spec -> peft config; apply it; keep the trainable weights in the adapter dtype (fp32 by default)."""
from __future__ import annotations

from pathlib import Path

import torch

from finetune.recipe import LoraSpec, ModelSpec
from finetune.train.dora import add_dora
from finetune.util.errors import RecipeError
from finetune.util.dtypes import torch_dtype
from finetune.artefacts.adapter import quiet_peft_wrap


def expert_parameters(model) -> list[str]:
    """Suffixes (`experts.gate_up_proj`, ...) of the fused 3-D MoE expert parameters of `model`: the
    parameters of a module whose class name ends in `Experts` (transformers 5's MixtralExperts,
    Qwen3MoeExperts, or their 4-bit PackedExperts), in model order, each once."""
    from finetune.weights.experts.module import PackedExperts

    found: list[str] = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            for pname, p in module.named_parameters(recurse=False):
                fused = p.dim() == 3 or isinstance(module, PackedExperts)  # 4-bit experts: packed bytes
                if fused and f"experts.{pname}" not in found:
                    found.append(f"experts.{pname}")
    return found


def target_parameters(spec: LoraSpec, model) -> list[str]:
    """lora.target_parameters resolved against the model: `auto` -> every fused expert parameter."""
    if spec.target_parameters == "auto":
        return expert_parameters(model) if model is not None else []
    return [t if "." in t else f"experts.{t}" for t in spec.target_parameters]


def linear_names(model) -> list[str]:
    """Leaf names of the model's linear layers (4-bit or not) but the output head: what `all-linear` means."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head}
    return sorted(names)


def target_modules(spec: LoraSpec, model) -> object:
    """lora.target_modules for peft. On a model with fused MoE experts, `all-linear` is spelled out: peft
    0.21 under transformers 5 otherwise rewrites an `all-linear` config for Mixtral and Qwen3-MoE as the
    transformers 4 model had it (peft.utils.transformers_weight_conversion), adding the router
    (`gate.weight`) and both expert parameters at double rank, whatever target_parameters says. The
    router must stay frozen and lora.target_parameters decides the experts."""
    if spec.target_modules == "all-linear" and model is not None and expert_parameters(model):
        return linear_names(model)
    return spec.target_modules


def peft_config(spec: LoraSpec, model=None):
    from peft import LoraConfig

    params = target_parameters(spec, model)
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=target_modules(spec, model),
        # MoE experts are 3-D parameters, not Linear modules: peft's ParamWrapper adapts them (the
        # router is a parameter too, and stays frozen in the model dtype: it is never targeted).
        target_parameters=params or None,
        bias=spec.bias,
        use_dora=spec.use_dora,  # peft's DoRA: on Linear4bit it takes the norms of the dequantized base
        use_rslora=spec.use_rslora,
        # `gaussian` is today's start (peft's default: A random, B zero, so B @ A = 0 and the run starts
        # from the base); the recipe refuses the base-changing inits before anything loads.
        init_lora_weights=True,
        task_type="CAUSAL_LM",
    )


def apply_lora(model, spec: LoraSpec, seed: int, plan=None):
    """Wrap the frozen base with fresh adapters. Seeded so adapter init is reproducible. `plan`: the load
    plan of a base left as placeholders (FSDP), which DoRA needs to read the base weights."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    config = peft_config(spec, model)
    if spec.use_dora and config.target_parameters:  # preflight refuses it first; a direct caller gets this
        raise RecipeError(["lora.use_dora: peft adapts fused MoE expert parameters without DoRA. Fix: set "
                           "lora.target_parameters: [] or lora.use_dora: false"])
    streamed_dora = spec.use_dora and plan is not None
    if streamed_dora:
        config.use_dora = False  # peft would read placeholders: add_dora makes DoRA weight by weight
    with quiet_peft_wrap():
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if config.target_parameters:
        from finetune.weights.experts.expert_lora import adopt

        adopt(model)  # 4-bit experts: peft's ParamWrapper with a forward that fits packed bytes
    if streamed_dora:
        add_dora(model, plan)
    # Master copies of the trainable weights stay in the adapter dtype (fp32 default): the optimizer updates
    # them exactly while autocast does the matmuls in bf16.
    dtype = torch_dtype(spec.dtype)
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def parameter_counts(model) -> dict:
    """Parameters, not stored elements: a 4-bit weight's packed storage holds 2 parameters per byte (a bf16
    element 4, a uint8 element 2), so its element count is not its parameter count."""
    from bitsandbytes.nn import Linear4bit

    packed = {id(m.weight) for m in model.modules() if isinstance(m, Linear4bit)}
    total = trainable = quantized = 0
    for p in model.parameters():
        n = p.numel() * p.element_size() * 2 if id(p) in packed else p.numel()
        total, trainable = total + n, trainable + (n if p.requires_grad else 0)
        quantized += n if id(p) in packed else 0
    return {"params": total, "trainable": trainable, "quantized_4bit": quantized}


def count(n: int) -> str:
    """1234567 -> 1.23M: parameter counts as people read them."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def trainable_report(model) -> str:
    c = parameter_counts(model)
    quant = f", {count(c['quantized_4bit'])} of them in 4 bits" if c["quantized_4bit"] else ""
    return (f"{count(c['params'])} parameters{quant}, {count(c['trainable'])} trainable "
            f"({100 * c['trainable'] / max(c['params'], 1):.2g}%)")


def enable_checkpointing(model, spec: ModelSpec, layers: int | None = None):
    """Gradient checkpointing per the recipe: every decoder layer, or (`layers`, train.recompute.resolve) the
    first that many. Non-reentrant by default: it handles inputs that do not require grad (frozen embeddings
    before the first adapter) and composes with FSDP2."""
    if not spec.gradient_checkpointing or layers == 0:
        return
    kwargs = {"use_reentrant": spec.reentrant_checkpointing}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # transformers 5 name
    if layers is not None:
        checkpoint_first(model, layers)
    if spec.reentrant_checkpointing:
        # Reentrant checkpointing only builds a graph when an input requires grad.
        model.enable_input_require_grads()


def checkpoint_first(model, k: int) -> int:
    """Leave transformers' per-layer switch (`gradient_checkpointing` of each GradientCheckpointingLayer, set
    by activation_checkpointing_enable) on for the first `k` decoder layers only. The first, because backward
    reaches them last: by then every later layer has freed what it saved, so a recomputed layer's working
    set never stacks on kept activations (the layout plan.activations plans). Returns the layer count."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if k > len(blocks):
        raise RecipeError([f"model.gradient_checkpointing: {k} layers, but the model has {len(blocks)} decoder "
                           f"layers. Fix: at most {len(blocks)}, true or auto"])
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i < k
    return len(blocks)


def load_adapter_into(model, adapter_dir: Path):
    """Adapter weights (a checkpoint's, or lora.init_adapter's) into the (not yet sharded) PeftModel; every
    key must match."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint adapter does not match the model: missing {missing[:3]}, "
                           f"unexpected {list(result.unexpected_keys)[:3]}")
