"""LoRA on 4-bit MoE experts (weights/experts/module.PackedExperts) through peft's own ParamWrapper.

peft's ParamWrapper adapts a fused expert parameter by registering a parametrization W + scale·B·A of the
whole dense [E, out, in] tensor around the experts' forward (torch evaluates it at registration and the
forward reads it): on packed 4-bit bytes that cannot work, and it would build every expert's full weight
each step. `PackedExpertsLora` is ParamWrapper itself (same adapters, names, init, scaling, saved keys and
config, so the adapter loads in plain peft on the dense base), with one change: its forward hands peft's
low-rank factors (`get_delta_factors`, the factors peft folds into W) to PackedExperts, which adds
scale·(x·Aₑᵀ)·Bₑᵀ to each picked expert's output. The math is peft's per expert; nothing dense is built.

`adopt` turns peft's wrappers into it once peft has injected them. Why not peft's custom-module mapping
(LoraConfig._register_custom_module): peft 0.21 nests a second wrapped parameter of one module only inside
a class named exactly `ParamWrapper` (tuners_utils.create_and_replace_param), so a dispatched subclass
stops the down_proj adapter from joining the gate_up_proj one.
"""
from __future__ import annotations

from peft.tuners.lora.layer import ParamWrapper

from finetune.weights.experts.module import PackedExperts


class PackedExpertsLora(ParamWrapper):
    """peft's ParamWrapper over a PackedExperts parameter; nested wrappers (one per adapted parameter) are
    walked by the outermost one, which calls PackedExperts once with every wrapper's factors."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        factors, layer = {}, self
        while isinstance(layer, ParamWrapper):
            active = [a for a in layer.active_adapters if a in layer.lora_A]
            if len(active) > 1:
                raise ValueError("LoRA on 4-bit experts applies one active adapter at a time")
            if active and not layer.disable_adapters:
                factors[layer.parameter_name] = layer.get_delta_factors(active[0])
            layer = layer.base_layer
        return layer(hidden_states, top_k_index, top_k_weights, factors)

    def merge(self, *args, **kwargs) -> None:
        raise ValueError("4-bit experts cannot take a merged adapter: `finetune merge` folds it into the "
                         "experts as published")


def adopt(model) -> int:
    """Every peft ParamWrapper over a PackedExperts parameter becomes a PackedExpertsLora (same state, same
    adapters: only the forward differs). Returns how many; call it after get_peft_model or
    PeftModel.from_pretrained, before any forward."""
    count = 0
    for module in model.modules():
        if type(module) is ParamWrapper and isinstance(module.get_base_layer(), PackedExperts):
            module.__class__ = PackedExpertsLora
            count += 1
    return count
