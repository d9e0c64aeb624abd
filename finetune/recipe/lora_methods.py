"""Rules for the adapter methods of the `lora` section (DoRA, rsLoRA, LoRA+, the initialisations): which
combinations cannot work, each with the reason and the fix. Pure, like `contract` which runs them."""
from __future__ import annotations

from finetune.util.errors import Problem

# Why each init other than `gaussian` is refused this round. All three need the base's unquantized weights in
# memory at adapter creation: the streamed load quantizes each tensor as it arrives (and under FSDP a rank
# never holds a whole weight), so there is nothing full-precision to decompose.
_INIT_WHY = {
    "pissa": "PiSSA starts A and B from the base's top singular vectors and replaces the base with the "
             "residual W - B A, so the run would have to quantize and save that residual base for the merge "
             "to stay exact",
    "olora": "OLoRA starts A and B from a QR factor of the base and subtracts it from the base, so the run "
             "would have to quantize and save that residual base for the merge to stay exact",
    "loftq": "LoftQ fits A and B to the 4-bit quantization error W - Q(W), which needs the full-precision "
             "weights; peft's loftq init (0.21) quantizes them itself from an unquantized model, and its "
             "replace_lora_weights_loftq re-reads the whole checkpoint outside our streamed (and sharded) load",
}


def lora_method_problems(r) -> list[Problem]:
    """Every combination of adapter method, quantization and strategy that cannot train or merge exactly."""
    lo, q = r.lora, r.quantization
    out: list[Problem] = []
    if lo.init != "gaussian":
        out.append(Problem(level="error", path="lora.init",
                           message=f"{lo.init} is not supported yet: {_INIT_WHY[lo.init]}",
                           fix="set lora.init: gaussian (use_dora or use_rslora are the supported "
                               "ways to change how the adapter learns)"))
    if lo.use_dora and q.mode == "int8":
        # peft's DoRA deep-copies the base layer to dequantize it; bitsandbytes' Int8Params lose their
        # quantization state in the copy (peft 0.21 says so in tuners/lora/dora.py).
        out.append(Problem(level="error", path="lora.use_dora",
                           message="DoRA cannot take its column norms from an 8-bit (LLM.int8) base",
                           fix="use quantization.mode: nf4 (QDoRA), or lora.use_dora: false"))
    if lo.use_dora and isinstance(lo.target_parameters, list) and lo.target_parameters:
        out.append(Problem(level="error", path="lora.target_parameters",
                           message="peft adapts fused MoE expert parameters without DoRA (ParamWrapper refuses "
                                   "use_dora)", fix="set lora.target_parameters: [] or lora.use_dora: false"))
    return out


def describe_method(r) -> str:
    """One line for `validate`: the adapter method and what it does to the scale and the learning rates."""
    lo, lr = r.lora, r.train.learning_rate
    parts = ["DoRA (magnitude per output row)" if lo.use_dora else "LoRA"]
    if lo.use_rslora:
        parts.append(f"rsLoRA scale alpha/sqrt(r) = {lo.alpha / lo.r ** 0.5:.4g}")
    else:
        parts.append(f"scale alpha/r = {lo.alpha / lo.r:.4g}")
    if lo.loraplus_lr_ratio is not None:
        parts.append(f"LoRA+ ratio {lo.loraplus_lr_ratio:g}: A at lr {lr:.3g}, B"
                     f"{' and magnitudes' if lo.use_dora else ''} at lr {lr * lo.loraplus_lr_ratio:.3g}")
    parts.append(f"init {lo.init}")
    return "adapter method: " + ", ".join(parts)
