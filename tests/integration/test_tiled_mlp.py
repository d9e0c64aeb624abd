"""model.tiled_mlp (finetune.train.tiled): each gated MLP over the tokens in chunks, recomputed chunk by
chunk in backward. The loss and every LoRA gradient equal the untiled model's to fp32 rounding on a
synthetic Llama with checkpointing and LoRA dropout (the chunks' dropout masks replayed in backward); MoE
blocks are refused by name. The 4-bit tiny model's case is in test_loop_loss.py (its loaded model reused)."""
import pytest
import torch

from finetune.util.errors import RecipeError

from .conftest import nonzero_adapters

TOL = 1e-5


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def assert_same(a, b, n_grads):
    (loss, grads), (tiled_loss, tiled_grads) = a, b
    assert abs(tiled_loss - loss) <= TOL * max(1.0, abs(loss)), (loss, tiled_loss)
    assert len(grads) == n_grads and grads.keys() == tiled_grads.keys()
    worst = max(float((tiled_grads[k] - g).abs().max()) for k, g in grads.items())
    assert worst <= TOL, worst
    mlp = [k for k in grads if "mlp" in k and "lora_" in k]
    assert mlp and all(float(grads[k].abs().max()) > 100 * TOL for k in mlp)  # the MLP's LoRA does train


@pytest.fixture(scope="module")
def synthetic_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    nonzero_adapters(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # dropout on: each chunk's masks must be drawn again in backward
    return model


def _dropout(model, p):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def test_tiled_mlp_on_a_synthetic_llama_gives_the_untiled_gradients_and_replays_dropout(synthetic_llama):
    from finetune.train import tiled

    model = synthetic_llama
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(1))
    mlps = [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    _dropout(model, 0.0)
    untiled = loss_and_grads(model, ids)
    # Dropout draws its masks per call, so a chunked MLP draws other masks than a whole one: with dropout the
    # reference is the same chunks kept by autograd (nothing recomputed), from the same seed.
    _dropout(model, 0.1)
    for m in mlps:
        m.forward = lambda x, f=m.forward: torch.cat([f(c) for c in x.reshape(-1, 64).split(64)]).view(
            *x.shape[:-1], 64)
    torch.manual_seed(5)
    kept = loss_and_grads(model, ids)
    for m in mlps:
        del m.forward
    assert tiled.apply(model, True, hidden=64) == 3  # true: chunks of hidden_size (64) tokens, 5 of them
    torch.manual_seed(5)
    assert_same(kept, loss_and_grads(model, ids), n_grads=3 * 7 * 2)  # the forward's masks in backward
    _dropout(model, 0.0)
    assert_same(untiled, loss_and_grads(model, ids), n_grads=3 * 7 * 2)
    _dropout(model, 0.1)


def test_moe_blocks_are_refused_by_name():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from finetune.train import tiled

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                         num_experts_per_tok=2, head_dim=16)
    with pytest.raises(RecipeError, match="model.tiled_mlp: Qwen3MoeSparseMoeBlock"):
        tiled.apply(Qwen3MoeForCausalLM(cfg), True, hidden=32)
