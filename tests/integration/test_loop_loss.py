"""The training loop's loss (train.loss.token_loss_sum) against the textbook computation on the 4-bit + LoRA tiny
model: the output head runs on trained positions only, yet the loss and every adapter gradient are those of
full logits; and the attention kernel choice of finetune.plan.attention is the one that actually runs."""
import pytest
import torch
import torch.nn.functional as F

from finetune.data import batching as B
from finetune.data import encode as E
from finetune.recipe import DataSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoTokenizer

    from finetune.train.lora import apply_lora
    from finetune.train.model import load_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": f"reverse: {' '.join(['red', 'cat', 'sun', 'dog', 'fox'][: 1 + i % 5])}\n",
             "completion": " ".join(["dog", "fox", "owl"][: 1 + i % 3])} for i in range(6)]
    batch = B.collate([E.encode(r, "auto", tok, DataSpec()) for r in rows], tok.pad_token_id)
    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False), QuantizationSpec(),
                       quiet=True)
    model = apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0)
    with torch.no_grad():  # non-zero adapters, so every LoRA tensor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model, batch


def lora_grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def test_head_on_trained_rows_gives_the_full_logits_loss_and_gradients(setup):
    from finetune.train.loss import token_loss_sum

    model, batch = setup
    labels = batch["labels"]
    trained = int((labels[:, 1:] != E.IGNORE).sum())
    assert 0 < trained < labels[:, 1:].numel() / 2  # prompts and padding dominate: the case this is for

    spec = TrainSpec(mixed_precision="no")  # fp32 throughout: both computations must agree to rounding
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                          ignore_index=E.IGNORE, reduction="sum")
    ref.backward()
    ref_grads = lora_grads(model)

    head = model.get_output_embeddings()
    rows_seen = []
    probe = head.register_forward_hook(lambda m, a, out: rows_seen.append(out.shape))
    try:
        loss, n = token_loss_sum(model, batch, "cpu", spec)
    finally:
        probe.remove()
    loss.backward()
    grads = lora_grads(model)

    assert rows_seen == [torch.Size([trained, head.out_features])]  # the head saw the trained rows only
    assert not head._forward_pre_hooks  # and the row selection is gone once the forward is done
    assert n == trained
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * 7 * 2
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-7), name


def saved_shapes(kernels, seq: int) -> list[tuple]:
    """Shapes of the fp32 tensors SDPA saves for backward for one causal GQA call under `kernels`."""
    q = torch.randn(2, 4, seq, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    seen = []

    def pack(t):
        if t.dtype == torch.float32:
            seen.append(tuple(t.shape))
        return t

    with kernels, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return seen


@pytest.mark.parametrize("device,precision,seq,math", [
    ("cpu", "bf16", 64, True), ("cpu", "bf16", 128, True),  # short bf16 batches on CPU: the math kernel
    ("cpu", "bf16", 256, False), ("cpu", "no", 64, False), ("cuda", "bf16", 64, False)])
def test_attention_kernels_pick_the_math_kernel_only_for_short_bf16_cpu_batches(device, precision, seq, math):
    from finetune.train.loss import attention_kernels

    shapes = saved_shapes(attention_kernels(device, precision, seq), seq)
    # the math kernel keeps the [batch * heads, T, T] fp32 probabilities; the flash kernel keeps only a
    # per-row logsumexp
    assert ((2 * 4, seq, seq) in shapes) is math, shapes
