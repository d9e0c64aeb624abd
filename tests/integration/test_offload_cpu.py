"""Activation offloading's logic (finetune.train.offload.ActivationOffload) on the CPU: the saved-tensor hooks
move every checkpointed layer input out during the forward, bring each back, one layer ahead, in backward,
and the loss and LoRA gradients are those of a run without them, exactly. (CUDA streams and pinned memory are
the GPU's alone: docs/gpu_paths.md.)"""
import torch

from finetune.recipe import TrainSpec

from .conftest import nonzero_adapters


def test_offloaded_layer_inputs_come_back_one_ahead_and_change_nothing():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.train.loss import token_loss_sum
    from finetune.train.offload import ActivationOffload

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, lora_dropout=0.0, target_modules="all-linear",
                                                             task_type="CAUSAL_LM"))
    nonzero_adapters(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    batch, spec = {"input_ids": ids, "labels": ids}, TrainSpec(mixed_precision="no")

    def run(offload):
        model.zero_grad(set_to_none=True)
        loss, _ = token_loss_sum(model, batch, "cpu", spec, offload)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = run(None)
    layer_input = 2 * 64 * 64 * 4  # [2, 64, 64] fp32: what checkpointing keeps per layer
    off = ActivationOffload(torch.device("cpu"), min_bytes=layer_input)
    loss, grads = run(off)
    packed = off.order
    # each decoder layer's input went out (the first is the embedding's output), and nothing smaller
    assert len(packed) >= 4 and all(p.cpu.numel() * 4 >= layer_input for p in packed)
    assert sum(tuple(p.cpu.shape) == (2, 64, 64) for p in packed) >= 4
    assert all(p.gpu is None for p in packed)  # every one brought back and handed to backward
    assert off.prefetched >= 3  # each layer's backward fetched the previous layer's input ahead
    assert loss == plain[0]
    assert all(torch.equal(grads[k], g) for k, g in plain[1].items()), "offloading changed a gradient"
