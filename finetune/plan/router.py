"""The MoE router's balance loss in the memory plan (`train.router_aux_loss_coef`, trained by
finetune.train.balance): the weight a run trains it with, and the bytes it keeps.

With the weight above 0 the forward is asked for `output_router_logits`. transformers (5.23: Mixtral,
Qwen3-MoE) then records every MoE layer's router logits [tokens, E] as the layer computes them, whether or
not the layer is checkpointed (they are outputs, not saved tensors: a recompute does not replace them), and
at the end of the forward `load_balancing_loss_func` takes each layer's softmax again, whose output autograd
keeps for backward, beside what its sums keep: a padded batch's attention mask flattened to fp32 (one for all
layers) and its token count, and the experts' token shares (fp32 [E]). Its top-k indices and any fp32 copy of
the probabilities live for one layer's turn only (measured: tests/unit/test_moe_balance_plan.py).
"""
from __future__ import annotations

from finetune.plan.activations import DTYPE_BYTES, MP_BYTES
from finetune.plan.archs import Arch


def coefficient(arch: Arch, wanted: float | None) -> float:
    """The balance loss's weight in a run: the recipe's (`wanted`), or (null) the model config's own; 0 on a
    dense model (validate refuses a positive weight there)."""
    if not arch.experts:
        return 0.0
    return float(arch.router_aux_loss_coef if wanted is None else wanted)


def balance_bytes(arch: Arch, s) -> int:
    """What the balance loss keeps at the end of the forward: every layer's router logits (the compute dtype
    under autocast, else the model's) and its softmax (fp32 on CUDA, where autocast runs softmax in fp32; on
    CPU the logits' dtype). The logits go with the forward's output; in backward the softmaxes give way to
    their gradients, one logits-sized buffer a layer waiting for that layer's backward, so this bounds the
    backward too. 0 when the weight is 0 or the model is dense: the logits are then not asked for."""
    if not coefficient(arch, s.router_aux_loss_coef):
        return 0
    t = s.micro_batch * s.seq_len
    autocast = s.mixed_precision != "no"
    logits = MP_BYTES[s.mixed_precision] if autocast else DTYPE_BYTES[s.model_dtype]
    probs = 4 if autocast and s.device == "cuda" else logits
    # the mask's terms are planned always: a packed batch (no mask) keeps 4 (t + 1) bytes less
    return arch.layers * t * arch.experts * (logits + probs) + (t + 1) * 4 + arch.experts * 4
