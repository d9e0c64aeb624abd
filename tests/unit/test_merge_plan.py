import math

import pytest
import torch

from finetune.merge.plan import (QuantSpec, TensorInfo, adapter_problems, lora_delta, magnitude_keys, merged_tensor,
                                 pair_keys, plan_shards, scaling, shard_names)
from finetune.util.errors import RecipeError
from finetune.util.units import parse_size


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("100MB", 10**8), ("2GiB", 2 * 2**30),
                                           ("1.5 kb", 1500), ("512", 512), ("10mib", 10 * 2**20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5 GBs", "-1GB", "0MB", "five"])
def test_parse_size_rejects(bad):
    with pytest.raises(RecipeError, match="max-shard-size"):
        parse_size(bad, "--max-shard-size")


def test_pair_keys_maps_peft_names_to_base_modules():
    keys = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            "base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight",  # older files keep the name
            "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"]
    assert pair_keys(keys) == {
        "model.layers.0.self_attn.q_proj": (keys[0], keys[1]),
        "model.layers.1.mlp.down_proj": (keys[2], keys[3])}


@pytest.mark.parametrize("keys,match", [
    (["base_model.model.a.lora_A.weight", "base_model.model.a.lora_B.weight",
      "base_model.model.a.lora_embedding_A"], "not LoRA A/B"),
    (["base_model.model.a.lora_A.weight", "base_model.model.a.lora_B.weight",
      "base_model.model.b.lora_magnitude_vector"], "DoRA magnitudes without"),
    (["base_model.model.a.lora_A.weight"], "missing their A or B"),
    ([], "no LoRA weights")])
def test_pair_keys_refuses_what_it_cannot_merge(keys, match):
    with pytest.raises(RecipeError, match=match):
        pair_keys(keys)


def test_adapter_problems():
    ok = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "use_dora": False, "bias": "none",
          "modules_to_save": None, "init_lora_weights": True, "use_rslora": True, "future_flag": False}
    assert adapter_problems(ok) == []
    assert adapter_problems({**ok, "use_dora": True}) == []  # DoRA merges (merged_tensor's magnitude)
    assert any("DoRA" in p for p in adapter_problems({**ok, "use_dora": True, "target_parameters": ["x"]}))
    assert any("modules_to_save" in p for p in adapter_problems({**ok, "modules_to_save": ["lm_head"]}))
    assert any("unknown_thing" in p for p in adapter_problems({**ok, "unknown_thing": 3}))
    assert any("pissa" in p for p in adapter_problems({**ok, "init_lora_weights": "pissa_niter_4"}))
    assert any("only LoRA" in p for p in adapter_problems({**ok, "peft_type": "IA3"}))
    assert adapter_problems({**ok, "init_lora_weights": "gaussian"}) == []


def test_scaling_plain_rslora_and_patterns():
    cfg = {"r": 16, "lora_alpha": 32}
    assert scaling(cfg, "model.layers.0.self_attn.q_proj", 16) == 2.0
    assert scaling({**cfg, "use_rslora": True}, "x.q_proj", 16) == 32 / math.sqrt(16)
    pat = {**cfg, "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"q_proj": 4}}
    assert scaling(pat, "model.layers.0.self_attn.q_proj", 8) == 0.5
    assert scaling(pat, "model.layers.0.self_attn.k_proj", 16) == 2.0
    with pytest.raises(RecipeError, match="rank"):
        scaling(cfg, "x.q_proj", 8)


def _t(name, n, dtype=torch.float32):
    return TensorInfo(name, (n,), dtype, "in.safetensors")


def test_plan_shards_is_greedy_in_order_and_counts_output_bytes():
    ts = [_t("a", 100), _t("b", 100), _t("c", 300), _t("d", 10, torch.int64), _t("e", 50)]
    # bf16: a=200, b=200, c=600 (bigger than the limit: alone), d=80 (int keeps 8 bytes), e=100
    shards = plan_shards(ts, torch.bfloat16, 450)
    assert [[t.name for t in s] for s in shards] == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards([], torch.bfloat16, 10) == []


def test_shard_names():
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[1] == "model-00002-of-00003.safetensors"


def test_merged_tensor_adds_in_fp32_and_rounds_once():
    w = torch.randn(8, 4)
    a, b = torch.randn(2, 4), torch.randn(8, 2)
    out = merged_tensor(w.to(torch.bfloat16), torch.float32, lora_delta(a, b, 0.5))
    assert torch.allclose(out, w.to(torch.bfloat16).float() + 0.5 * b @ a, atol=1e-6)
    ints = torch.arange(4)
    assert merged_tensor(ints, torch.bfloat16) is ints
    with pytest.raises(RecipeError, match="does not fit"):
        merged_tensor(w, torch.float32, torch.zeros(4, 8))


def test_quant_roundtrip_is_4bit():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))  # seeded: the global draw depends on what ran before
    out = merged_tensor(w, torch.float32, quant=QuantSpec())
    # NF4 keeps 16 levels per 64-value block: far fewer distinct values than the input, close to it
    assert out[0].unique().numel() <= 16
    assert (out - w).abs().max() < 0.5 and not torch.equal(out, w)


def test_dora_magnitude_keys_old_and_new_names():
    keys = ["base_model.model.m.q_proj.lora_A.weight", "base_model.model.m.q_proj.lora_B.weight",
            "base_model.model.m.q_proj.lora_magnitude_vector",  # peft 0.21
            "base_model.model.m.k_proj.lora_A.weight", "base_model.model.m.k_proj.lora_B.weight",
            "base_model.model.m.k_proj.lora_magnitude_vector.default.weight"]  # older files
    assert magnitude_keys(keys) == {"m.q_proj": keys[2], "m.k_proj": keys[5]}
    assert set(pair_keys(keys)) == {"m.q_proj", "m.k_proj"}


def test_dora_merged_weight_equals_peft_merge():
    """merged_tensor with a magnitude == peft's own DoRA merge of the same layer (fp32)."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    g = torch.Generator().manual_seed(0)
    w, a, b = torch.randn(12, 10, generator=g), torch.randn(4, 10, generator=g), torch.randn(12, 4, generator=g)
    base = torch.nn.Linear(10, 12, bias=False)
    base.weight.data = w.clone()
    layer = LoraLinear(base, "default", LoraConfig(r=4, lora_alpha=8, use_dora=True), r=4, lora_alpha=8,
                       use_dora=True)
    layer.lora_A["default"].weight.data, layer.lora_B["default"].weight.data = a, b
    m = torch.rand(12, generator=g) + 0.5
    layer.lora_magnitude_vector["default"].weight.data = m
    x = torch.randn(3, 10, generator=g)
    with torch.no_grad():
        want = layer(x)
        layer.merge()
        peft_merged = layer.get_base_layer().weight.detach().clone()
    ours = merged_tensor(w, torch.float32, lora_delta(a, b, 2.0), magnitude=m)
    assert torch.allclose(ours, peft_merged, atol=1e-5)
    assert torch.allclose(x @ ours.T, want, atol=1e-4)
    with pytest.raises(RecipeError, match="magnitude"):
        merged_tensor(w, torch.float32, lora_delta(a, b, 2.0), magnitude=m[:5])
