"""DoRA on a streamed base: peft's own DoRA layers, made one base weight at a time.

peft makes a DoRA layer's magnitude vector at adapter creation from the column norms of the base weight
(dequantized, for a 4-bit base). Under FSDP the streaming loader leaves every base weight a zero-size
placeholder until the shard fill after wrapping, so peft's creation has nothing to take norms of. Here
the adapters are created without DoRA, then each adapted layer gets its DoRA variant from peft while its
base weight is materialized from the load plan's reader (quantized exactly as the fill will quantize
it), and the placeholder goes back right after: one whole weight in memory at a time, on every rank.
"""
from __future__ import annotations

from finetune.weights.load.reader import materialize


def add_dora(model, plan, adapter: str = "default") -> int:
    """Turn every LoRA layer of the peft `model` into peft's DoRA layer, with magnitudes from the base
    weights the load `plan` streams. Collective under FSDP (the reader shares each weight over the
    machine's ranks): every rank calls it, in the same module order. Returns the number of layers."""
    from peft.tuners.lora import LoraLayer

    config = model.peft_config[adapter]
    config.use_dora = True  # what adapter_config.json says, and what peft reloads
    done = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        base = module.get_base_layer()
        entry = plan.find(base, "weight")
        if entry is None:
            raise RuntimeError(f"DoRA: {name} has no base weight in the load plan")
        placeholder, state = base.weight, getattr(base, "quant_state", None)
        base.weight = materialize(plan.stream, entry)
        try:
            # peft's own path (LoraLayer.update_layer): pick the variant for the config, then let it
            # build the magnitude from the (dequantized) base weight plus the zero initial B @ A.
            variant = module.resolve_lora_variant(config=config)
            module.lora_variant[adapter] = variant
            module.use_dora[adapter] = True
            variant.init(module, adapter_name=adapter, config=config)
        finally:
            base.weight, base.quant_state = placeholder, state
        done += 1
    return done
