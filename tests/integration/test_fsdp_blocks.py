"""FSDP building blocks, proven on 2 real processes over gloo (CPU): sharding of the 4-bit + LoRA model,
8-bit AdamW on shards, equivalence with one process, and the gathered adapter.

Three runs of tests/integration/fsdp_worker.py over the same rows, each once per module: one process x
micro-batch 8; FSDP2 under torchrun and FSDP1 under `accelerate launch`, each 2 processes x micro-batch 4.
The tests read what the workers wrote.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import warm_launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "fsdp_worker.py"
N_LORA_LAYERS = 28  # 4 decoder layers x 7 linears


# FSDP1 is launched the way users launch: `accelerate launch` with an FSDP config, here one whose
# sync_module_states / cpu_ram_efficient_loading cannot work on CPU (the recipe must win over it).
ACCELERATE_FSDP1 = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: false
fsdp_config:
  fsdp_version: 1
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
"""


def _run(out: Path, launcher: list[str], nproc: int, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [*launcher, str(WORKER), str(out), *args]
    cmd, env = warm_launch(cmd, env) if nproc > 1 else (cmd, env)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((out / f"facts-rank{r}.json").read_text()) for r in range(nproc)]
    return {"out": out, "stdout": proc.stdout, "ranks": ranks}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            if name == "single":
                cache[name] = _run(out, [sys.executable], 1, "--strategy", "single", "--micro-batch", "8")
            elif name == "fsdp2":
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
                cache[name] = _run(out, torchrun, 2, "--strategy", "fsdp", "--version", "2", "--micro-batch", "4")
            else:
                config = out / "accelerate_fsdp1.yaml"
                config.write_text(ACCELERATE_FSDP1)
                launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0",
                          "--config_file", str(config)]
                cache[name] = _run(out, launch, 2, "--strategy", "fsdp", "--version", "1", "--micro-batch", "4")
        return cache[name]

    return get


@pytest.mark.parametrize("version", [2, 1])
def test_one_log_line_says_fsdp_is_active(runs, version):
    lines = [ln for ln in runs(f"fsdp{version}")["stdout"].splitlines() if ln.startswith("fsdp: ")]
    shard = "reshard_after_forward=True" if version == 2 else "sharding_strategy=FULL_SHARD, use_orig_params=True"
    assert lines == [f"fsdp: FSDP{version} over gloo, 2 processes, {shard}, wrapping LlamaDecoderLayer"]


@pytest.mark.parametrize("version", [2, 1])
def test_each_rank_holds_half_the_model_and_4bit_stays_4bit(runs, version):
    ranks = runs(f"fsdp{version}")["ranks"]
    full = ranks[0]["full_bytes"]
    for r in ranks:
        assert r["is_sharded"], r["model_class"]  # FSDPModule (FSDP2) / FullyShardedDataParallel (FSDP1)
        assert r["num_processes"] == 2
        # FSDP2 and FSDP1 leave the frozen embedding and head whole on each rank (parallel.replicated_modules):
        # the rest is halved.
        whole = r["unsharded_bytes"] if version == 2 else r["table_bytes"]
        assert r["table_bytes"] == r["full_table_bytes"] > 0  # whole, as one process holds them
        assert abs(r["local_bytes"] - whole - (full - whole) / 2) <= 0.1 * (full - whole) / 2, (r["local_bytes"], full)
        assert r["four_bit"]["n_linear4bit"] == N_LORA_LAYERS
        assert r["four_bit"]["weight_dtypes"] == ["torch.float32"]  # packed nibbles in the fp32 storage dtype
    if version == 2:
        assert ranks[0]["model_class"] == "FSDPPeftModelForCausalLM"
        for r in ranks:  # everything but the frozen tables is a DTensor
            assert r["unsharded_names"] and all("embed_tokens" in n or "lm_head" in n for n in r["unsharded_names"])
            assert r["n_dtensor_params"] == r["n_params"] - len(r["unsharded_names"])
        assert ranks[0]["four_bit"]["weight_classes"] == ["DTensor"]
    else:
        assert ranks[0]["model_class"] == "FullyShardedDataParallel"
    # Summed over ranks, the 4-bit layers hold exactly half a byte per parameter: sharded, never dequantized.
    storage = sum(r["four_bit"]["local_storage_bytes"] for r in ranks)
    assert storage / ranks[0]["four_bit"]["n_params"] == 0.5
    assert all(r["four_bit"]["local_storage_bytes"] < storage for r in ranks)


@pytest.mark.parametrize("version", [2, 1])
def test_two_ranks_match_one_process(runs, version):
    ref = runs("single")["ranks"][0]["losses"]
    ranks = runs(f"fsdp{version}")["ranks"]
    assert len(ref) == 4
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the reduced (global mean) loss
    assert ranks[0]["losses"] == pytest.approx(ref, abs=1e-2)


@pytest.mark.parametrize("version", [2, 1])
def test_8bit_state_is_uint8_and_sharded(runs, version):
    ranks = runs(f"fsdp{version}")["ranks"]
    single = runs("single")["ranks"][0]["optimizer"]
    assert len(single) == N_LORA_LAYERS and all(v["dtype"] == "torch.uint8" for v in single.values())
    # Every lora_A (16 x 256 or 16 x 512: >= 4096 elements) keeps 8-bit state on every rank, though each
    # rank's shard is under bnb's 4096-element threshold, and the state is sized to the rank's shard.
    for name, ref in single.items():
        full = ref["local_numel"]
        per_rank = [r["optimizer"][name] for r in ranks]
        assert sum(v["local_numel"] for v in per_rank) == full >= 4096, per_rank
        held = [v for v in per_rank if v["local_numel"]]  # FSDP1 may give one rank all of a tensor
        assert all(v["dtype"] == "torch.uint8" and v["state_numel"] == v["local_numel"] for v in held), per_rank
        if version == 2:
            assert [v["local_numel"] for v in per_rank] == [full // 2] * 2
    for r in ranks:  # per-rank state_dict -> torch.save -> load_state_dict keeps plain local tensors
        assert r["reloaded_state_tensors"] > 0 and r["reloaded_dtensors"] == 0


def _worker_module():
    spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("version", [2, 1])
def test_gathered_adapter_reproduces_fsdp_logits(runs, version):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from finetune.weights.bnb import disable_cpu_weight_repacking

    out = runs(f"fsdp{version}")["out"]
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert len(adapter) == 2 * N_LORA_LAYERS
    assert all(".default." not in k and k.startswith("base_model.model.model.layers.") for k in adapter)
    assert adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (16, 256)
    assert adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (128, 16)
    assert adapter["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (16, 512)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained (B starts at 0)

    model, _ = _worker_module().load_qlora_model()
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    disable_cpu_weight_repacking(model)
    saved = torch.load(out / "logits.pt")
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=saved["eval_ids"]).logits.float()
    assert logits.shape == saved["logits"].shape
    torch.testing.assert_close(logits, saved["logits"], atol=1e-3, rtol=0)
