"""The planner against published figures, architecture facts and its own CLI contract."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from finetune import cli
from finetune.plan import archs
from finetune.plan import estimate as E
from finetune.util.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
MB = 10**6


def within(planned, published, tol=0.15):
    return abs(planned - published) / published <= tol


# Source: AnswerDotAI fsdp_qlora, benchmarks_03_2024.md ("Starting at 7B"): Llama-2-7B QLoRA on 2 x 3090
# with FSDP, batch 1, gradient checkpointing, no CPU offload: 4.98 GiB peak per GPU at context 512 and
# 5.21 GiB at 2048. Its train.py defaults of that time: bf16 parameters and adapters (precision "bf16"),
# LoRA rank 64 on q,k,v,gate,up,down, torch AdamW, FSDP1. The published numbers are torch's peak *reserved*
# memory, compared with the plan's reserved figure. At context 512 the plan is 27% under (open gap O3 of
# docs/planner_accuracy.md: fsdp_qlora's wrap leaves a cached pool the plan does not model), so only the
# 2048 figure is held to 15% here.
FSDP_QLORA_7B = E.Setup(model="meta-llama/Llama-2-7b-hf", gpus=2, micro_batch=1, lora_r=64,
                        lora_targets=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                        lora_dtype="bfloat16", lora_dropout=0.1, model_dtype="bfloat16", quant_storage="bfloat16",
                        optimizer="adamw_torch", strategy="fsdp", fsdp_version=1,
                        loss="transformers")  # its loss: the model's own, on full fp32 logits


def test_fsdp_qlora_llama2_7b_two_gpus():
    plan = E.build(replace(FSDP_QLORA_7B, seq_len=2048))
    assert within(plan.reserved / E.GiB, 5.21)


def test_qlora_paper_7b_base_and_adapter():
    # Source: Dettmers et al. 2023, QLoRA, Figure 6 (memory footprint of LLaMA 7B): 4-bit base model
    # 5,048 MB; LoRA parameters 26 MB, which the caption describes as the common 0.2% of the model's
    # weights, in 16-bit. The paper's code kept non-quantized weights in fp32 (peft's
    # prepare_model_for_kbit_training), as our default model.dtype does.
    plan = E.build(E.Setup(model="meta-llama/Llama-2-7b-hf", model_dtype="float32"))
    base = plan.breakdown["base_4bit"] + plan.breakdown["quant_constants"] + plan.breakdown["unquantized"]
    assert within(base / MB, 5048)
    # 0.2% of the weights: rank 26 on peft's default Llama targets (q_proj, v_proj) in bf16.
    lora = E.build(E.Setup(model="meta-llama/Llama-2-7b-hf", lora_r=26, lora_targets=["q_proj", "v_proj"],
                           lora_dtype="bfloat16")).breakdown["lora"]
    assert within(lora / MB, 26)


def test_double_quantization_saves_0373_bits_per_parameter():
    # QLoRA paper, section 3: from 0.5 to 0.127 bits per parameter (blocksize 64, second-level 256).
    n = 4096 * 11008
    saved_bits = (E.quant_constant_bytes(n, False) - E.quant_constant_bytes(n, True)) * 8 / n
    assert saved_bits == pytest.approx(0.373, abs=0.002)


@pytest.mark.parametrize("name,billions", [
    ("meta-llama/Llama-2-7b-hf", 6.74), ("meta-llama/Llama-2-13b-hf", 13.02), ("meta-llama/Llama-2-70b-hf", 68.98),
    ("meta-llama/Meta-Llama-3-8B", 8.03), ("meta-llama/Meta-Llama-3-70B", 70.55), ("meta-llama/Llama-3.1-405B", 405.85),
    ("mistralai/Mistral-7B-v0.1", 7.24), ("mistralai/Mixtral-8x7B-v0.1", 46.70), ("Qwen/Qwen2.5-7B", 7.62),
    ("Qwen/Qwen2.5-72B", 72.71), ("google/gemma-2-9b", 9.24), ("microsoft/Phi-3-mini-4k-instruct", 3.82),
    ("01-ai/Yi-34B", 34.39),
])
def test_builtin_table_matches_published_parameter_counts(name, billions):
    # Parameter counts as published on each model card / by safetensors metadata.
    arch, where = archs.resolve(name)
    assert "built-in" in where
    assert arch.params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_config_json_from_local_dir_and_hf_cache(tmp_path, monkeypatch):
    cfg = dict(archs.TABLE["mistralai/Mistral-7B-v0.1"], num_hidden_layers=2)
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(cfg))
    assert archs.resolve(str(local))[0].layers == 2
    snap = tmp_path / "hub" / "models--acme--small" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    arch, where = archs.resolve("acme/small")
    assert arch.layers == 3 and str(snap) in where


def test_builtin_tiny_resolves_through_tiny_model_dir():
    from finetune.util import builtin as tiny

    arch, where = archs.resolve("builtin:tiny-llama")
    assert where.startswith(str(tiny.model_dir()))
    assert (arch.hidden, arch.layers, arch.heads, arch.kv_heads) == (256, 4, 4, 2)


def test_unknown_model_is_bad_input(capsys):
    assert cli.main(["estimate", "--model", "nobody/nothing-7b"]) == 2
    assert "built-in table" in capsys.readouterr().err


def test_plan_responds_to_each_knob():
    s = E.Setup(model="meta-llama/Meta-Llama-3-8B", seq_len=1024, micro_batch=2, checkpointing=False)
    gpu = lambda **kw: E.build(replace(s, **kw)).gpu_bytes_per_device  # noqa: E731
    assert gpu(seq_len=2048) > gpu() > gpu(checkpointing=True)
    assert gpu(micro_batch=4) > gpu()
    fsdp = dict(strategy="fsdp", gpus=2)
    assert gpu(**fsdp) > gpu(strategy="fsdp", gpus=4) > gpu(strategy="fsdp", gpus=4, offload=True)
    assert gpu(lora_r=64) > gpu(lora_r=8)
    assert gpu(attn="eager") > gpu()
    p = E.build(replace(s, strategy="fsdp", gpus=2, offload=True))
    assert p.breakdown["base_4bit"] == 0 and p.cpu["training"] > E.build(replace(s, strategy="fsdp", gpus=2)).cpu["training"]
    # The streaming loader: FSDP ranks load their shard, so 2 ranks need less per GPU than 1 process.
    assert E.build(replace(s, strategy="fsdp", gpus=2)).load_gpu < E.build(s).load_gpu


def test_fsdp1_offload_peaks_at_the_first_forward_with_three_copies_of_each_shard():
    # FSDP1 pins every flat parameter's shard and a pinned gradient at lazy init, while the unpinned shard
    # stays `flat_param.data` until the unit's first unshard; FSDP2 pins parameter by parameter at wrap time
    s = E.Setup(model="meta-llama/Llama-2-70b-hf", gpus=2, strategy="fsdp", fsdp_version=1, offload=True,
                quant_storage="bfloat16", model_dtype="bfloat16", lora_dtype="bfloat16")
    p = E.build(s)
    arch, w = p.arch, E.weight_terms(p.arch, s)
    units = [(w["base_4bit"] + w["lora"]) // arch.layers] * arch.layers + [w["unquantized"]]
    unpinned = sum(-(-u // 2) for u in units)
    opt = E.optimizer_terms(arch, s, 2)
    assert p.cpu["training_start"] - p.cpu["training"] == 2 * (unpinned - opt["optimizer_8bit"] - opt["optimizer_32bit"])
    assert p.cpu_bytes_peak == p.cpu["training_start"]
    assert "training_start" not in E.build(replace(s, fsdp_version=2)).cpu
    assert "training_start" not in E.build(replace(s, offload=False)).cpu


def test_sharded_quant_state_divides_the_constants_and_gathers_them_with_each_layer():
    # torchao's NF4Tensor (torchtune's QLoRA) shards its scalers with the packed weight; bitsandbytes'
    # quant state is a plain attribute, which FSDP neither shards nor gathers
    s = E.Setup(model="meta-llama/Meta-Llama-3-70B", gpus=8, strategy="fsdp")
    bnb, ao = E.build(s), E.build(replace(s, quant_state_sharded=True))
    consts = E.weight_terms(bnb.arch, s)["quant_constants"]
    assert bnb.breakdown["quant_constants"] == consts
    assert ao.breakdown["quant_constants"] == -(-consts // 8)
    per_layer = consts // bnb.arch.layers
    assert ao.breakdown["fsdp_buffers"] - bnb.breakdown["fsdp_buffers"] in range(2 * per_layer - 2, 2 * per_layer + 3)
    one = replace(s, gpus=1, strategy="single")  # nothing to shard on one device
    assert E.build(one).breakdown == E.build(replace(one, quant_state_sharded=True)).breakdown


def test_eight_bit_optimizer_keeps_small_tensors_in_32_bit():
    arch = archs.resolve("builtin:tiny-llama")[0]
    small = E.optimizer_terms(arch, E.Setup(lora_r=4), 1)  # r x 256 = 1024 < 4096 elements
    assert small["optimizer_8bit"] == 0 and small["optimizer_32bit"] > 0
    big = E.optimizer_terms(arch, E.Setup(lora_r=16), 1)
    assert big["optimizer_8bit"] > 0


@pytest.mark.parametrize("text,value", [("24GiB", 24 * 2**30), ("24G", 24 * 2**30), ("80GB", 80 * 10**9),
                                        ("1.5 TiB", int(1.5 * 2**40)), ("1000", 1000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_cli_json_last_line_for_70b_without_torch():
    # What makes `estimate` quick is that it imports no torch or transformers; its time is a benchmark's
    # business (benchmarks/cpu/startup.py), not a unit test's.
    code = ("import sys, time; t = time.time(); from finetune import cli; "
            "rc = cli.main(['estimate', '--model', 'meta-llama/Llama-3.1-70B', '--gpus', '2', '--offload', "
            "'--gpu-memory', '24GiB', '--json']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; "
            "print('elapsed', time.time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-2])
    assert {"gpu_bytes_per_device", "cpu_bytes_peak", "breakdown"} <= set(data)
    assert data["gpu_bytes_per_device"] == sum(data["breakdown"].values())
    assert data["fits"] is True and data["setup"]["strategy"] == "fsdp"


def test_cli_on_a_recipe_with_overrides(capsys):
    assert cli.main(["estimate", str(ROOT / "recipes/llama3_8b_qlora.yaml"), "--gpus", "4", "--seq-len", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["setup"]["gpus"] == 4 and data["setup"]["seq_len"] == 4096 and data["setup"]["strategy"] == "fsdp"


def test_fsdp_keeps_the_frozen_tables_whole_and_gathers_none_of_them():
    # FSDP2 and FSDP1 leave the frozen embedding and head whole on every rank (train.parallel.replicated_modules):
    # they count whole, and the root's all-gather no longer holds a second copy of them. Before, measured on an
    # H200 (FSDP2 world 1, 8B widths): 0.98 GiB of gathered head at the step's peak (benchmarks/RESULTS_GPU.md).
    # Other stacks shard them into the root unit (`tables_whole=False`, docs/planner_accuracy.md's rows).
    s = E.Setup(model="meta-llama/Llama-3.1-8B-Instruct", gpus=2, seq_len=2048, micro_batch=2, strategy="fsdp",
                model_dtype="bfloat16", quant_storage="bfloat16")
    arch = E.build(s).arch
    tables = 2 * arch.vocab * arch.hidden * 2  # untied: embedding and head, bf16
    two, one = E.build(replace(s, fsdp_version=2)), E.build(replace(s, fsdp_version=2, gpus=1))
    v1, theirs = E.build(replace(s, fsdp_version=1)), E.build(replace(s, fsdp_version=1, tables_whole=False))
    assert two.breakdown["unquantized"] >= tables and v1.breakdown["unquantized"] >= tables
    assert tables > theirs.breakdown["unquantized"]
    assert theirs.breakdown["fsdp_buffers"] - v1.breakdown["fsdp_buffers"] >= tables - theirs.breakdown["unquantized"]
    assert 0 < one.breakdown["fsdp_buffers"] < tables / 4  # one process: two layers' 4-bit copies, no table
    assert E.build(replace(s, fsdp_version=1, gpus=1)).breakdown["fsdp_buffers"] == 0
    offloaded = E.build(replace(s, fsdp_version=2, offload=True))
    assert offloaded.breakdown["unquantized"] == 0  # offloaded: FSDP2 shards the tables (they go to the CPU)


def test_dora_on_cuda_plans_the_fp32_outputs_it_measured_on_an_h100():
    # peft's DoRA under CUDA autocast hands back fp32 (fp32 magnitude x bf16 base output), so the MLP's kept
    # tensors and the residual stream are fp32. Measured on an H100 (4-layer 8B widths, 2 x 2048, all-linear,
    # benchmarks/RESULTS_GPU.md): steps peak allocated LoRA 3.56 GiB, DoRA 6.01 GiB. The DoRA-over-LoRA excess
    # was planned 1.97 GiB before (bf16 outputs), 2.45 measured.
    from finetune.plan.activations import dora_promotes

    s = E.Setup(model="synthetic:meta-llama/Llama-3.1-8B-Instruct?layers=4", gpus=1, seq_len=2048, micro_batch=2,
                strategy="single", model_dtype="bfloat16", quant_storage="bfloat16")
    lora, dora = E.build(s), E.build(replace(s, use_dora=True))
    excess = (dora.allocated - lora.allocated) / 2**30
    assert abs(excess - 2.45) / 2.45 < 0.10, excess
    arch = dora.arch
    assert dora_promotes(arch, dora.setup, {"down_proj"})
    cpu = replace(s, use_dora=True, device="cpu")  # peft casts back on CPU: nothing promoted there
    assert not dora_promotes(arch, cpu, {"down_proj"})
    bf16_adapters = replace(s, use_dora=True, lora_dtype="bfloat16")  # nothing wider than the compute dtype
    assert not dora_promotes(arch, bf16_adapters, {"down_proj"})
