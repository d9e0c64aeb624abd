"""The router balance loss in the memory plan (finetune/plan/router.py): its `router_balance` term equals the
bytes a tiny Qwen3-MoE forward keeps because `output_router_logits` was asked for (the logits every layer
returns, checkpointed or not, and what transformers' load_balancing_loss_func leaves for backward), and is 0
when the weight is 0 or the model is dense."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace

import pytest
import torch

from finetune.plan import estimate as E
from finetune.plan import router
from finetune.plan.archs import from_config, resolve

LAYERS, EXPERTS, BATCH, SEQ = 3, 8, 2, 16


@pytest.fixture(scope="module")
def moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
                         num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(cfg).train()


def _kept_by_the_balance_loss(model, autocast: bool, checkpointed: bool) -> int:
    """Bytes alive once the forward returned, with the router logits asked for, beyond those without: the
    logits tuple of the output plus the storages autograd still holds (each storage once)."""
    if checkpointed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0  # a padded row, as padded batches reach the model

    def held(logits: bool) -> int:
        saved = []
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t), ctx:
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=logits, use_cache=False)
        alive = [t for t in (r() for r in saved) if t is not None] + list(out.router_logits or ())
        if logits:
            assert len(out.router_logits) == LAYERS  # every layer's, the checkpointed ones' too
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())

    return held(True) - held(False)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("precision", ["bf16", "no"], ids=["bf16-autocast", "fp32"])
def test_the_term_is_what_the_balance_loss_keeps(moe, precision, checkpointed):
    arch = from_config(moe.config.to_dict(), "tiny-moe")
    s = E.Setup(model="tiny-moe", device="cpu", seq_len=SEQ, micro_batch=BATCH, model_dtype="float32",
                mixed_precision=precision, checkpointing=checkpointed)
    measured = _kept_by_the_balance_loss(moe, precision == "bf16", checkpointed)
    assert router.balance_bytes(arch, s) == measured > 0


def test_the_term_is_zero_when_off_or_dense_and_the_config_weight_counts_when_null():
    moe_arch = resolve("Qwen/Qwen3-30B-A3B")[0]
    s = E.Setup(model="Qwen/Qwen3-30B-A3B", seq_len=2048, micro_batch=2, model_dtype="bfloat16")
    on = E.build(s, moe_arch, "table")
    assert moe_arch.router_aux_loss_coef == 0.001 and router.coefficient(moe_arch, None) == 0.001
    # bf16 logits and fp32 softmax (CUDA autocast) for 48 layers x 4096 tokens x 128 experts
    assert on.breakdown["router_balance"] == 48 * 4096 * 128 * 6 + 4097 * 4 + 128 * 4
    off = E.build(replace(s, router_aux_loss_coef=0.0), moe_arch, "table")
    assert off.breakdown["router_balance"] == 0
    assert on.allocated - off.allocated == on.breakdown["router_balance"]
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 8, "num_experts": 4, "num_experts_per_tok": 2}
    assert router.coefficient(from_config(cfg), None) == 0.001  # config.json without it: the config class's
    zero = from_config({**cfg, "router_aux_loss_coef": 0})
    assert router.coefficient(zero, None) == 0 and router.coefficient(zero, 0.01) == 0.01
    dense = resolve("Qwen/Qwen3-8B")[0]
    assert router.coefficient(dense, None) == 0 == router.coefficient(dense, 0.01)
    assert E.build(E.Setup(model="Qwen/Qwen3-8B"), dense, "table").breakdown["router_balance"] == 0
