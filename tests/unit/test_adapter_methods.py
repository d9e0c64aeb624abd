"""The adapter methods of the `lora` section: DoRA, rsLoRA, LoRA+ and the initialisations, as
the recipe, `validate`, the optimizer groups, peft's config and the planner see them. No weights."""
from __future__ import annotations

import pytest
import torch

from finetune import cli
from finetune import recipe as R
from finetune.plan import estimate
from finetune.train import optim
from finetune.train.lora import peft_config


def _problems(**lora_and_more) -> list[str]:
    with pytest.raises(R.RecipeError) as e:
        R.from_dict(lora_and_more)
    return e.value.problems


@pytest.mark.parametrize("init", ["pissa", "olora", "loftq"])
def test_base_changing_inits_are_refused_with_the_reason_and_the_fix(init):
    (p,) = _problems(lora={"init": init})
    assert "lora.init" in p and "not supported yet" in p and "set lora.init: gaussian" in p
    assert {"pissa": "residual", "olora": "residual", "loftq": "full-precision"}[init] in p


def test_dora_on_an_int8_base_or_on_moe_experts_is_refused():
    (p,) = _problems(lora={"use_dora": True}, quantization={"mode": "int8"})
    assert "lora.use_dora" in p and "quantization.mode: nf4" in p
    (p,) = _problems(lora={"use_dora": True, "target_parameters": ["experts.down_proj"]})
    assert "lora.target_parameters" in p and "ParamWrapper" in p


def test_loraplus_ratio_below_one_is_a_schema_error():
    (p,) = _problems(lora={"loraplus_lr_ratio": 0.5})
    assert "lora.loraplus_lr_ratio" in p


def test_methods_reach_peft_config():
    r = R.from_dict({"lora": {"use_dora": True, "use_rslora": True}})
    cfg = peft_config(r.lora)
    assert cfg.use_dora and cfg.use_rslora and cfg.init_lora_weights is True
    plain = peft_config(R.from_dict({}).lora)
    assert not plain.use_dora and not plain.use_rslora


def _named_lora():
    """A peft-like module: names with lora_A / lora_B, a DoRA magnitude (1-D) and a frozen weight."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.lora_A = torch.nn.Linear(256, 16, bias=False)
    m.lora_B = torch.nn.Linear(16, 64, bias=False)
    m.lora_magnitude_vector = torch.nn.Parameter(torch.ones(64))
    m.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    return m


@pytest.mark.parametrize("optimizer", ["adamw_torch", "paged_adamw_8bit"])
def test_loraplus_ratio_is_in_the_optimizer_groups(optimizer):
    m = _named_lora()
    train = R.from_dict({"train": {"optimizer": optimizer, "learning_rate": 1e-3, "weight_decay": 0.1}}).train
    opt = optim.build_optimizer(m, train, loraplus_lr_ratio=16)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    a, b, mag = by_param[id(m.lora_A.weight)], by_param[id(m.lora_B.weight)], by_param[id(m.lora_magnitude_vector)]
    assert a["lr"] == pytest.approx(1e-3) and a["lr_ratio"] == 1.0 and a["weight_decay"] == 0.1
    assert b["lr"] == pytest.approx(16e-3) and b["lr_ratio"] == 16 and b["weight_decay"] == 0.1
    assert mag["lr"] == pytest.approx(16e-3) and mag["weight_decay"] == 0.0  # peft's LoRA+: vectors go with B
    assert id(m.frozen.weight) not in by_param
    # The schedule scales every group's own rate: the ratio holds at every step.
    sched = optim.build_scheduler(opt, train, total_steps=10)
    for _ in range(3):
        opt.step()
        sched.step()
    assert b["lr"] == pytest.approx(16 * a["lr"]) and a["lr"] < 1e-3


def test_without_loraplus_the_groups_are_unchanged_and_names_are_needed_with_it():
    m = _named_lora()
    decay, rest = optim.param_groups(m, 0.1)
    assert "lr" not in decay and len(decay["params"]) == 2 and len(rest["params"]) == 1
    with pytest.raises(ValueError, match="names"):
        optim.param_groups(m.parameters(), 0.1, 1e-3, 4.0)


def test_validate_prints_the_method_and_the_loraplus_rates(capsys):
    rc = cli.main(["validate", "recipes/tiny_cpu.yaml", "lora.loraplus_lr_ratio=16", "lora.use_rslora=true"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("adapter method:"))
    assert "LoRA+ ratio 16" in line and "A at lr 0.002" in line and "B at lr 0.032" in line
    assert "rsLoRA scale alpha/sqrt(r) = 8" in line


def test_validate_refuses_pissa_with_exit_2_and_no_traceback(capsys):
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", "lora.init=pissa"]) == 2
    err = capsys.readouterr().err
    assert "lora.init" in err and "Traceback" not in err


def test_planner_counts_dora_magnitudes_outputs_and_workspace():
    r = R.from_dict({})
    plain = estimate.build(estimate.from_recipe(r))
    r.lora.use_dora = True
    dora = estimate.build(estimate.from_recipe(r))
    arch = plain.arch
    rows = sum(x.d_out * x.count for x in arch.linears()) * arch.layers  # one magnitude per output row
    assert dora.to_json()["trainable_params"] - plain.to_json()["trainable_params"] == rows
    assert dora.breakdown["lora"] - plain.breakdown["lora"] == rows * 4  # fp32 adapters
    assert dora.breakdown["activations"] > plain.breakdown["activations"]
    assert plain.breakdown["dora_workspace"] == 0 < dora.breakdown["dora_workspace"]
    assert dora.gpu_bytes_per_device > plain.gpu_bytes_per_device


def test_validate_refuses_dora_on_adapted_moe_experts(capsys):
    """The experts' adapters are peft's ParamWrapper, which has no DoRA: refused before anything loads."""
    assert cli.main(["validate", "recipes/mixtral_8x7b_qlora.yaml", "lora.use_dora=true"]) == 2
    out = capsys.readouterr().out
    assert "lora.use_dora" in out and "lora.target_parameters: []" in out
    assert cli.main(["validate", "recipes/mixtral_8x7b_qlora.yaml", "lora.use_dora=true",
                     "lora.target_parameters=[]"]) == 0


def test_validate_refuses_a_missing_init_adapter_or_one_of_another_rank(tmp_path, capsys):
    # Both used to pass validate; the rank then failed after the model had loaded, in a size-mismatch traceback.
    import json

    import torch
    from safetensors.torch import save_file

    assert cli.main(["validate", "recipes/tiny_cpu.yaml", f"lora.init_adapter={tmp_path / 'nope'}"]) == 2
    err = "".join(capsys.readouterr())  # the findings on stdout
    assert f"lora.init_adapter: {tmp_path / 'nope'} does not exist" in err and "Traceback" not in err
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)}, str(adapter / "adapter_model.safetensors"))
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", f"lora.init_adapter={adapter}", "lora.r=16"]) == 2
    err = "".join(capsys.readouterr())  # the findings on stdout
    assert f"lora.init_adapter: {adapter} has rank 8, lora.r is 16" in err and "lora.r: 8" in err
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", f"lora.init_adapter={adapter}", "lora.r=8"]) == 0
    (adapter / "adapter_config.json").write_text('{"r": 8')  # truncated
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", f"lora.init_adapter={adapter}", "lora.r=8"]) == 2
    assert "adapter_config.json cannot be read as JSON" in "".join(capsys.readouterr())
