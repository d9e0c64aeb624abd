"""model.gradient_checkpointing: N on the 4-bit + LoRA tiny model, in process: the first N decoder layers
recompute in backward (and only they), the loss and every adapter gradient are those of no checkpointing and
of all, and what autograd keeps falls between the two."""
import json

import torch

from finetune.recipe import ModelSpec

from .conftest import tiny_lora_fp32


def test_first_n_layers_recompute_with_the_same_loss_and_gradients(tiny_model_dir):
    from benchmarks.cpu.memcheck import SavedTensorMeter
    from finetune.train.lora import enable_checkpointing

    # fp32 dequantization and no autocast: two correct computations agree to fp32 rounding
    model = tiny_lora_fp32(tiny_model_dir)  # non-zero adapters: every LoRA tensor gets a gradient
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


def test_auto_on_a_cpu_run_plans_against_ram_or_the_cap_and_says_so(capsys):
    """train.recompute.resolve as training calls it, on this CPU: the machine's RAM holds the tiny recipe's
    activations (none checkpointed); a cap between the planner's figures for 1 and 2 layers makes it 2; a cap
    below everything checkpoints all 4 and says it does not fit."""
    from dataclasses import replace

    from accelerate import Accelerator

    from finetune import recipe as R
    from finetune.plan import checkpointing as C
    from finetune.plan import estimate as E
    from finetune.train.recompute import resolve

    acc = Accelerator(cpu=True)
    tiny = "recipes/tiny_cpu.yaml"
    assert resolve(R.load(tiny, ["model.gradient_checkpointing=auto"]), acc) == 0
    assert "gradient checkpointing: auto -> 0 of 4 layers (plan " in capsys.readouterr().out
    s = replace(E.from_recipe(R.load(tiny)), gpus=1, device="cpu")
    peaks = [C.peak_bytes(C.fit(replace(s, checkpointing=k))[0]) for k in range(5)]
    cap = (peaks[1] + peaks[2]) / 2 / 2**30
    assert resolve(R.load(tiny, ["model.gradient_checkpointing=auto", f"model.max_memory_gib={cap}"]), acc) == 2
    out = capsys.readouterr().out
    assert f"auto -> 2 of 4 layers (plan {peaks[2] / 2**30:.1f} of {cap:.1f} GiB" in out
    assert resolve(R.load(tiny, ["model.gradient_checkpointing=auto", "model.max_memory_gib=0.01"]), acc) == 4
    assert "does not fit even so" in capsys.readouterr().out
    assert resolve(R.load(tiny, ["model.gradient_checkpointing=3"]), acc) == 3
    # A process that started above the plan's constant (estimate.CPU_START_RSS) has that much less room: the
    # same cap, with a start that puts 2 layers over it, takes 3; at the constant itself nothing changes.
    over = int(cap * 2**30) - peaks[2] + 1
    capped = R.load(tiny, ["model.gradient_checkpointing=auto", f"model.max_memory_gib={cap}"])
    assert resolve(capped, acc, start_rss=E.CPU_START_RSS + over) == 3
    assert f"auto -> 3 of 4 layers (plan {(peaks[3] + over) / 2**30:.1f} of {cap:.1f} GiB" in capsys.readouterr().out
    assert resolve(capped, acc, start_rss=E.CPU_START_RSS) == 2


def test_memory_json_plans_the_layers_the_run_checkpointed(tmp_path):
    """RUN_DIR/memory.json's plan is of the count the run resolved (auto, or N), not of the recipe's word:
    `auto` that chose 0 of 4 layers is compared with the plan of 0, which keeps every layer's activations."""
    from accelerate import Accelerator

    from finetune import recipe as R
    from finetune.train.keepers.memory import PhaseMemory, planned

    rec = R.load("recipes/tiny_cpu.yaml", ["model.gradient_checkpointing=auto"])
    mem = PhaseMemory.for_this_process()
    mem.checkpointed = 0
    plan = mem.write(tmp_path, Accelerator(cpu=True), rec)["plan"]
    start = mem.start_rss
    assert plan == planned(rec, 1, False, start, 0)
    assert plan["steps"] > planned(rec, 1, False, start, 4)["steps"]  # keeping activations plans more
    assert json.loads((tmp_path / "memory.json").read_text())["plan"] == plan
