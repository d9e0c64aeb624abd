"""The frozen base model through the streaming loader: the meta skeleton, the first pass at load time (all
of it for `whole`, placeholders under FSDP), and the meta tensors FSDP wraps (the fills after wrapping:
fsdp2.py, fsdp1.py).

Every parameter the checkpoint holds gets an entry in the load plan (loadplan.py: its checkpoint key,
dtype, shape and, for a 4-bit weight, its quantization arguments); nothing is written onto the modules.
Under FSDP the parameter is a zero-size placeholder of the right dtype until `wrap`: LoRA is attached to a
real (CPU) tensor, not a meta one (peft would put the adapters on meta), and `before_wrap` swaps the
placeholders for meta tensors of the full shape that FSDP then shards.
"""
from __future__ import annotations

from pathlib import Path

import torch

from finetune.util.errors import RecipeError
from finetune.weights.experts.module import PackedExperts, expert_parameter, pack_experts
from finetune.weights.heap import loading_objects_only, release_freed_memory
from finetune.weights.load.loadplan import Entry, LoadPlan, Source
from finetune.weights.load.placement import Placement
from finetune.weights.load.reader import Checkpoint, Stream, check_stored_config, materialize


def skeleton(path: Path, config, dtype: torch.dtype, bnb, prequantized: bool, attn: str, trust: bool):
    """The model with every parameter on meta (buffers such as RoPE's inv_freq real), its target linears
    replaced by `Linear4bit` through transformers' own bitsandbytes quantizer."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                 trust_remote_code=trust)
    retie(model)  # on meta the head is not tied yet: tie it now, so it is tagged and loaded once (as stored)
    quantizer = None
    if bnb is not None:
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(bnb, pre_quantized=prequantized)
        quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None,
                                   use_kernels=False)
        model.hf_quantizer = quantizer
        if not prequantized:
            pack_experts(model, expert_q(bnb), dtype)  # fused MoE experts: 4-bit too (weights/experts/module.py)
    return model, quantizer


@loading_objects_only()  # release_freed_memory's collection, once a weight, scans only what loading made
def set_weights(plan: LoadPlan, placement: Placement) -> None:
    """Every weight of the plan: read (and quantized) for a `whole` placement, else a CPU placeholder. Plain
    tensors first: the embedding and the head are the biggest reads, and their transients (the checkpoint's
    copy beside the cast one) should come while little is held yet (plan/loading.py)."""
    for e in sorted(plan.entries, key=lambda e: e.packed):
        if placement.mode == "whole":
            setattr(e.module, e.name, materialize(plan.stream, e))
            release_freed_memory()
        else:
            setattr(e.module, e.name, cpu_placeholder(e))


def expert_q(bnb) -> dict:
    """The 4-bit arguments of packed experts: those transformers gives every Linear4bit of this config."""
    return {"blocksize": 64, "compress_statistics": bnb.bnb_4bit_use_double_quant,
            "quant_type": bnb.bnb_4bit_quant_type, "quant_storage": bnb.bnb_4bit_quant_storage}


def plan_entries(model, ckpt: Checkpoint) -> list[Entry]:
    """An entry for each parameter, in model order. A parameter the checkpoint lacks is a RecipeError
    naming it (tied parameters are set once, through their owner)."""
    import bitsandbytes as bnb

    cfg = model.config
    mt, experts = cfg.model_type, getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0) or 0
    out, seen, missing = [], set(), []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = f"{mname}.{pname}" if mname else pname
            if not ckpt.link(key, mt, experts):
                missing.append(key)
                continue
            entry = Entry(module, pname, key, p.dtype, tuple(p.shape))
            if isinstance(module, PackedExperts):
                entry.q, entry.dtype = module.q, module.q["quant_storage"]
                entry.shape, entry.experts = module.shapes[pname], module.num_experts
            elif isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                w = module.weight
                entry.q = {"blocksize": w.blocksize, "compress_statistics": w.compress_statistics,
                           "quant_type": w.quant_type, "quant_storage": w.quant_storage}
                entry.dtype = w.quant_storage
            out.append(entry)
    if missing:
        raise RecipeError([f"model.name: {ckpt.path} has no tensor '{k}' the model needs" for k in missing[:5]])
    return out


def load_base(src: Source):
    """(the frozen base for `src.placement` (see the package doc), its load plan: None when every weight is
    set, as for `whole`). `src.bnb`: a 4-bit BitsAndBytesConfig or None."""
    path, config, dtype, bnb, placement = src.path, src.config, src.dtype, src.bnb, src.placement
    ckpt = Checkpoint(path)
    if ckpt.prequantized and bnb is None:
        raise RecipeError([f"model.name: {path} is a pre-quantized 4-bit checkpoint; set quantization.mode "
                           "to its type (nf4 or fp4)"])
    if ckpt.prequantized:
        check_stored_config(config, bnb)
    # The skeleton imports the model's modules and bitsandbytes' integration lazily (~100k objects): it
    # runs before the collector is narrowed to loading's objects, or every collection of the fill rescans
    # them (measured: 39 collections of 0.11 s each for the 2.6M-parameter tiny model).
    model, quantizer = skeleton(path, config, dtype, bnb, ckpt.prequantized, src.attn, src.trust_remote_code)
    plan = LoadPlan(Stream(ckpt, placement, dtype), plan_entries(model, ckpt))
    set_weights(plan, placement)
    if placement.mode == "whole":
        # Buffers (RoPE's inv_freq) were made real on the CPU with the skeleton; a whole model is used where it
        # is loaded (eval, generate), and FSDP and Accelerate move the others with the parameters.
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.device != placement.device:
                    setattr(module, name, buf.to(placement.device))  # nn.Module keeps it a buffer
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if quantizer is not None:
        quantizer.postprocess_model(model)
    model.eval()  # as from_pretrained returns it
    if placement.mode == "whole":
        plan.release()
        return model, None
    return model, plan


def retie(model) -> None:
    """Point a tied output head (Llama 3.2, Gemma 3) at the input embedding's current parameter."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(hf.config, "tie_word_embeddings", False) and hasattr(hf, "tie_weights"):
        hf.tie_weights()


def cpu_placeholder(e: Entry) -> torch.nn.Parameter:
    """The parameter until FSDP shards it: zero-size, except a fused 3-D MoE expert parameter, which peft's
    ParamWrapper sizes its adapters from (E x in x out): a one-element tensor expanded to the full shape,
    which has that shape and holds no memory."""
    if len(e.shape) == 3 and not e.packed:
        return torch.nn.Parameter(torch.empty((1, 1, 1), dtype=e.dtype).expand(e.shape), requires_grad=False)
    return placeholder(e, (0,), "cpu")


def placeholder(e: Entry, shape: tuple, device: str) -> torch.nn.Parameter:
    """An unset parameter of the right class and dtype: a Params4bit (with its quantization arguments,
    which peft reads when it wraps the layer) for a 4-bit weight, a plain frozen Parameter otherwise."""
    data = torch.empty(shape, dtype=e.dtype, device=device)
    if e.experts:
        return expert_parameter(data, e.shape)
    if e.packed:
        import bitsandbytes as bnb

        return bnb.nn.Params4bit(data, requires_grad=False, module=e.module, bnb_quantized=True, **e.q)
    return torch.nn.Parameter(data, requires_grad=False)
