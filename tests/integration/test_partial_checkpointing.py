"""model.gradient_checkpointing: N on the 4-bit + LoRA tiny model, in process: the first N decoder layers
recompute in backward (and only they), the loss and every adapter gradient are those of no checkpointing and
of all, and what autograd keeps falls between the two."""
import torch

from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec


def test_first_n_layers_recompute_with_the_same_loss_and_gradients(tiny_model_dir):
    from benchmarks.cpu.memcheck import SavedTensorMeter
    from finetune.train.lora import apply_lora, enable_checkpointing
    from finetune.weights.load.model import load_model

    # fp32 dequantization and no autocast: two correct computations agree to fp32 rounding
    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False),
                       QuantizationSpec(compute_dtype="float32"), quiet=True)
    model = apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0)
    with torch.no_grad():  # non-zero adapters, so every LoRA tensor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.train()
    layers = model.get_base_model().model.layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):  # attention runs inside the layer's forward: again when it recomputes
        layer.self_attn.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    on = ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=True)

    def run(k):
        enable_checkpointing(model, on, k)
        calls[:] = [0] * len(layers)
        meter = SavedTensorMeter(model)
        with meter():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return float(loss), grads, meter.total, list(calls)

    base_loss, base_grads, none_saved, none_calls = run(0)
    assert none_calls == [1, 1, 1, 1]
    _, _, all_saved, all_calls = run(None)
    assert all_calls == [2, 2, 2, 2]
    loss, grads, half_saved, half_calls = run(2)
    assert half_calls == [2, 2, 1, 1]  # the first two recompute, the last two keep their activations
    assert loss == base_loss
    worst = max(float((g - base_grads[k]).norm() / base_grads[k].norm()) for k, g in grads.items())
    assert worst <= 1e-6 and len(grads) == 4 * 7 * 2, worst
    assert all_saved < half_saved < none_saved
