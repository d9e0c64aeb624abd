"""The families of the architecture table: shapes against published totals, tied heads and MoE experts
counted once and in the right dtype, the adapted share validate prints, the per-expert checkpoint layout
the loader and the merge read, and the synthetic copies' layer pattern."""
from __future__ import annotations

import pytest
import torch

from finetune.plan import estimate as E
from finetune.plan.archs import per_expert_keys, renamed_key, resolve
from finetune.util import synthetic_names as synthetic

# Published totals (model cards / keras-hub presets); the table must reproduce them to 3 digits.
PUBLISHED = {
    "meta-llama/Llama-3.2-1B": 1.24e9, "meta-llama/Llama-3.2-3B": 3.21e9, "Qwen/Qwen3-4B": 4.02e9,
    "Qwen/Qwen3-8B": 8.19e9, "Qwen/Qwen3-14B": 14.8e9, "Qwen/Qwen3-32B": 32.8e9, "Qwen/Qwen3-30B-A3B": 30.5e9,
    "google/gemma-3-1b-pt": 1.00e9, "google/gemma-3-12b-pt": 11.8e9, "google/gemma-3-27b-pt": 27.0e9,
    "microsoft/phi-4": 14.7e9, "mistralai/Mixtral-8x7B-v0.1": 46.7e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_table_shapes_give_the_published_parameter_count(name):
    arch, where = resolve(name)
    assert where.startswith("built-in table")
    assert arch.params() == pytest.approx(PUBLISHED[name], rel=5e-3)


def test_gemma3_1b_matches_its_exact_published_count():
    # keras-hub's gemma3_1b preset: 999,885,952 parameters (tied head, QK-norm, four norms a layer)
    assert resolve("google/gemma-3-1b-pt")[0].params() == 999_885_952


def test_layer_classes_and_quirks():
    qwen3, llama32, gemma3, phi4 = (resolve(n)[0] for n in ("Qwen/Qwen3-8B", "meta-llama/Llama-3.2-3B",
                                                            "google/gemma-3-12b-pt", "microsoft/phi-4"))
    assert (qwen3.layer_class, llama32.layer_class, gemma3.layer_class, phi4.layer_class) == \
        ("Qwen3DecoderLayer", "LlamaDecoderLayer", "Gemma3DecoderLayer", "Phi3DecoderLayer")
    assert llama32.tied and gemma3.tied and not qwen3.tied and not qwen3.qkv_bias
    assert [x.name for x in phi4.linears()] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert gemma3.norms_per_layer == 4


def test_multimodal_gemma3_config_plans_its_text_decoder():
    from finetune.plan.archs import from_config

    text = {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208}
    arch = from_config({"model_type": "gemma3", "text_config": text, "vision_config": {}}, "g")
    assert arch.params() == resolve("google/gemma-3-12b-pt")[0].params() and arch.tied


def test_tied_head_is_planned_once():
    s = E.Setup(model="meta-llama/Llama-3.2-3B", model_dtype="bfloat16", quant_storage="bfloat16")
    arch = resolve(s.model)[0]
    w = E.weight_terms(arch, s)
    assert w["unquantized"] == (arch.vocab * arch.hidden + arch.small_params()) * 2


def test_moe_experts_are_planned_4bit_with_adapters():
    s = E.Setup(model="Qwen/Qwen3-30B-A3B", model_dtype="bfloat16", quant_storage="bfloat16", lora_r=16)
    arch = resolve(s.model)[0]
    assert arch.experts == 128 and arch.intermediate == 768  # moe_intermediate_size, not the dense width
    assert [x.name for x in arch.linears()] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # all-linear's reach
    experts = sum(x.d_in * x.d_out * x.count for x in arch.expert_params()) * arch.layers
    w = E.weight_terms(arch, s)
    assert w["experts"] == experts // 2  # 4-bit: two codes a byte (weights/experts/module.py)
    # the per-expert quantization state (one absmax byte per 64, a scale per 256 blocks, an offset) is held whole
    blocks = experts // 64
    assert blocks < w["quant_constants"] - E.weight_terms(arch, E.Setup(model=s.model, quant="none"))["quant_constants"]
    assert E.weight_terms(arch, E.Setup(model=s.model, quant="none", model_dtype="bfloat16"))["experts"] == experts * 2
    assert 13 * 2**30 < w["experts"] < 14 * 2**30  # Qwen3-30B-A3B: 54 GiB of bf16 experts -> 13.5 GiB
    # ParamWrapper: A [r*E, in] and B [out, r*E] per fused parameter, per layer
    per_layer = 16 * 128 * (2048 + 1536) + 16 * 128 * (768 + 2048)
    assert sum(E.lora_tensor_sizes(arch, s)) - sum(E.lora_tensor_sizes(arch, E.Setup(
        model=s.model, lora_r=16, lora_expert_targets=[]))) == per_layer * arch.layers
    share = E.adapted_share(arch, s)
    assert share["expert_adapted"] == share["expert_total"] == experts
    frozen = E.adapted_share(arch, E.Setup(model=s.model, lora_expert_targets=[]))
    assert frozen["expert_adapted"] == 0 and frozen["pct"] < 5  # a silently frozen expert set shows
    line = E.describe_adapted(arch, E.Setup(model=s.model, lora_expert_targets=[]))
    assert "MoE experts 0% adapted (none), held 4-bit (nf4, double quant, per expert): 13.9" in line


def test_hub_expert_layouts():
    assert per_expert_keys("model.layers.3.mlp.experts.gate_up_proj", "mixtral", 2) == [
        ["model.layers.3.block_sparse_moe.experts.0.w1.weight", "model.layers.3.block_sparse_moe.experts.0.w3.weight"],
        ["model.layers.3.block_sparse_moe.experts.1.w1.weight", "model.layers.3.block_sparse_moe.experts.1.w3.weight"]]
    assert per_expert_keys("model.layers.0.mlp.experts.down_proj", "qwen3_moe", 1) == [
        ["model.layers.0.mlp.experts.0.down_proj.weight"]]
    assert per_expert_keys("model.layers.0.self_attn.q_proj.weight", "mixtral", 8) is None
    assert renamed_key("model.layers.1.mlp.gate.weight", "mixtral") == "model.layers.1.block_sparse_moe.gate.weight"


def test_loader_stacks_a_per_expert_checkpoint(tmp_path):
    """A hub-layout Mixtral layer (w1/w3/w2 per expert) reads as transformers 5's fused parameters."""
    from safetensors.torch import save_file

    from finetune.weights.load.reader import Checkpoint

    g = torch.Generator().manual_seed(0)
    w = {f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight": torch.randn(shape, generator=g)
         for e in range(3) for p, shape in (("w1", (5, 4)), ("w3", (5, 4)), ("w2", (4, 5)))}
    w["model.layers.0.block_sparse_moe.gate.weight"] = torch.randn(3, 4, generator=g)
    save_file(w, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                "model.layers.0.mlp.gate.weight"):
        assert ckpt.link(key, "mixtral", 3)
    assert not ckpt.link("model.layers.0.mlp.experts.gate_up_proj", "qwen3_moe", 3)
    gate_up = ckpt.read("model.layers.0.mlp.experts.gate_up_proj")
    want = torch.stack([torch.cat([w[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"],
                                   w[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"]]) for e in range(3)])
    assert torch.equal(gate_up, want) and gate_up.shape == (3, 10, 4)
    assert torch.equal(ckpt.read_rows("model.layers.0.mlp.experts.down_proj", 1, 3)[0],
                       w["model.layers.0.block_sparse_moe.experts.1.w2.weight"])
    assert ckpt.read_rows("model.layers.0.mlp.experts.down_proj", 3, 3).shape == (0, 4, 5)
    assert torch.equal(ckpt.read("model.layers.0.mlp.gate.weight"), w["model.layers.0.block_sparse_moe.gate.weight"])


def test_merge_splits_an_expert_update_into_per_expert_rows():
    """The per-expert rows the merge adds equal the fused update peft's ParamWrapper applies."""
    from finetune.merge.experts import ExpertUpdate, expert_delta, resolve as resolve_updates

    n, r, h, i = 3, 2, 4, 5
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(r * n, h, generator=g), torch.randn(2 * i, r * n, generator=g)
    fused = expert_delta(a, b, n, 0.5, ExpertUpdate("x", ("a", "b")))
    assert fused.shape == (n, 2 * i, h)
    shapes = {f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight": (i, h) for e in range(n) for p in ("w1", "w3")}
    shapes.update({f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight": (h, i) for e in range(n)})
    pairs = {"model.layers.0.mlp.experts.base_layer": ("A0", "B0"), "model.layers.0.mlp.experts": ("A1", "B1")}
    cfg = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    updates = resolve_updates(pairs, cfg, shapes, "mixtral", n)
    w3 = updates["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    assert w3.keys == ("A0", "B0") and w3.rows == (i, 2 * i)  # gate_up_proj: the inner (first wrapped)
    assert updates["model.layers.0.block_sparse_moe.experts.0.w2.weight"].keys == ("A1", "B1")
    assert torch.allclose(expert_delta(a, b, n, 0.5, w3), fused[2, i:])


def test_synthetic_copy_keeps_sliding_and_global_layers():
    base = {"model_type": "gemma3_text", "num_hidden_layers": 48, "sliding_window_pattern": 6}
    cfg = synthetic.config_for(base, {"num_hidden_layers": 2})
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    cfg = synthetic.config_for({"model_type": "mixtral", "num_local_experts": 8}, {"num_experts": 4})
    assert cfg["num_local_experts"] == 4 and "num_experts" not in cfg
