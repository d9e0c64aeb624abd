"""The MoE router's balance loss (train.router_aux_loss_coef, finetune/train/balance.py) on the grouped 4-bit
experts of moe4bit.WIDE (32 experts, top-4), fp32:

- the loss path hands back transformers' own aux_loss of the same forward, and the cross-entropy unchanged;
  its gradient reaches the router (its logits get a different gradient with the term than without, through
  gradient checkpointing too) and the adapters before it;
- the real loop trains it: aux_loss in metrics.jsonl at every logged step and in the log, and the adapters
  end elsewhere than with the weight 0 from the same start; with 0 nothing of it is asked or logged;
- that run's step plan (memory.json) is within 15% of its measured peak RSS.
"""
from __future__ import annotations

import json

import pytest
import torch

from .moe4bit import WIDE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wide():
    from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    from .conftest import nonzero_adapters

    base = load_model(ModelSpec(name=WIDE, dtype="float32"), QuantizationSpec(), quiet=True)
    model = apply_lora(base, LoraSpec(dropout=0.0), seed=0)
    nonzero_adapters(model)
    return model


def _grads(model, batch, coef, checkpointed):
    """(cross-entropy sum, aux, LoRA gradients, the routers' logit gradients) of CE + coef x aux, as the step
    forms it (finetune.train.step), through the loop's loss (token_loss_sum with an `aux` list)."""
    from finetune.recipe import TrainSpec
    from finetune.train.loss import token_loss_sum

    model.zero_grad(set_to_none=True)
    if checkpointed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    logit_grads = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda m, a, out: out[0].register_hook(logit_grads.append) and None)
             for r in routers]
    aux = []
    loss, _ = token_loss_sum(model, batch, "cpu", TrainSpec(mixed_precision="no"), aux=aux)
    (loss + coef * aux[0]).backward()
    for h in hooks:
        h.remove()
    if checkpointed:
        model.activation_checkpointing_disable()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), aux[0].detach(), grads, logit_grads


def test_the_term_is_the_models_aux_loss_and_its_gradient_reaches_the_router(wide):
    from finetune.train.loss import token_loss_sum
    from finetune.recipe import TrainSpec

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 384, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # padding: masked out of the balance statistics, as transformers masks it
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        want = wide(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        plain, _ = token_loss_sum(wide, batch, "cpu", TrainSpec(mixed_precision="no"))
    for checkpointed in (False, True):
        ce, aux, with_term, router_with = _grads(wide, batch, 0.5, checkpointed)
        ce0, _, without, router_without = _grads(wide, batch, 0.0, checkpointed)
        assert torch.equal(ce, plain) and torch.equal(ce0, plain)  # the cross-entropy is untouched
        torch.testing.assert_close(aux, want.float(), rtol=1e-6, atol=1e-6)
        assert len(router_with) == len(router_without) == 2  # 2 layers' router logits got a gradient
        for a, b in zip(router_with, router_without):
            assert (a - b).abs().max() > 1e-6, checkpointed
        first = [n for n in with_term if "layers.0.self_attn" in n and "lora_" in n]
        assert first and all((with_term[n] - without[n]).abs().max() > 1e-7 for n in first), checkpointed
    wide.zero_grad(set_to_none=True)


def _train(tmp_path, name, coef, fresh=False):
    """(logged step rows, the trained adapter's tensors, memory.json, the command's output) of a 2-step run of
    `python -m finetune`; `fresh`: in a new interpreter, as memory.json's plan assumes (a fork of the suite's warm
    process starts with the libraries' pages already resident, which the plan's process constant counts again)."""
    from safetensors.torch import load_file

    from tests.conftest import run_cli

    run_dir = tmp_path / name
    p = run_cli(["recipes/tiny_cpu.yaml",
        f"model.name={WIDE}", "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1",
        "data.max_samples=16", "data.max_seq_len=32", "output.progress_bar=false", "data.eval_sources=[]",
        "data.eval_split=0", "lora.dropout=0", "model.gradient_checkpointing=true", f"output.dir={run_dir}",
        "train.micro_batch_size=2", "train.gradient_accumulation_steps=2", f"train.router_aux_loss_coef={coef}",
        "train.mixed_precision=no", "quantization.compute_dtype=float32"], fresh=fresh)  # fp32: see the memory note
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    adapters = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    memory = json.loads((run_dir / "memory.json").read_text())
    return [r for r in rows if "loss" in r], adapters, memory, p.stdout + p.stderr


def test_the_loop_trains_and_logs_it_and_zero_leaves_it_out(tmp_path):
    on, trained, memory, said = _train(tmp_path, "on", 0.5, fresh=True)
    assert "MoE router balance: loss + 0.5 x aux_loss" in said
    off, plain, _, said = _train(tmp_path, "off", 0)
    assert "MoE router balance" not in said
    assert len(on) == len(off) == 2
    assert all(3.0 < r["aux_loss"] < 32.0 for r in on), on  # top-4 of 32: 4 when balanced, 32 at worst
    assert all("aux_loss" not in r for r in off), off
    assert on[0]["loss"] == off[0]["loss"]  # the same start: step 1's cross-entropy is the same
    moved = [n for n in trained if "self_attn" in n and (trained[n] - plain[n]).abs().max() > 1e-7]
    assert moved, "the balance term changed no adapter"
    # The planner's step plan of this grouped MoE run (RUN_DIR/memory.json's `plan`,
    # the CPU RAM of the steps phase) within 15% of the peak RSS the run measured in that phase. In bf16 on a
    # CPU with native bf16 the MoE step's RSS grows step after step instead (docs/families.md): fp32 here.
    peak, plan = memory["ranks"][0]["phases"]["steps"]["peak_rss"], memory["plan"]["steps"]
    assert abs(plan - peak) / peak <= 0.15, (plan, peak)
