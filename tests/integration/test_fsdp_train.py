"""The whole training loop under FSDP, launched the way users launch it:
`accelerate launch --config_file configs/cpu_fsdp.yaml -m finetune recipes/tiny_cpu_fsdp.yaml`,
2 processes over gloo, against 1 process with the same global batch."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import ROOT, run_cli, warm_launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, SAVE = 20, 10
COMMON = [f"train.max_steps={STEPS}", f"train.save_every={SAVE}", "train.log_every=1", "train.warmup_steps=2",
          "data.max_samples=400", "output.progress_bar=false", "eval.max_batches=2"]


def launch(run_dir, version, extra=()):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file", str(ROOT / "configs" / "cpu_fsdp.yaml"),
           "--fsdp_version", str(version), "--num_processes", "2", "-m", "finetune",
           str(ROOT / "recipes" / "tiny_cpu_fsdp.yaml"), f"fsdp.version={version}", f"output.dir={run_dir}",
           *COMMON, *extra]
    cmd, env = warm_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def losses(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


# fp32 compute, 32-bit Adam state and a large epsilon (updates linear in the gradient): what is left between
# 1 and 2 processes is summation order. The default (bf16 autocast, 8-bit state quantised in blocks that
# follow each rank's shard) adds rounding that Adam's near-sign early updates amplify in a few elements.
STRICT = ["train.mixed_precision=no", "quantization.compute_dtype=float32", "train.optimizer=adamw_torch",
          "train.adam_epsilon=1.0"]


# 1 process over the global batch of 2 processes x 8 rows: as one micro-batch of 16, or as the two 8-row
# micro-batches the ranks see (accumulated: each padded to its own length, as on the ranks).
AS_ONE_BATCH = ["train.micro_batch_size=16"]
AS_RANK_BATCHES = ["train.micro_batch_size=8", "train.gradient_accumulation_steps=2"]


def single_run(tmp_path_factory, extra, batches=AS_ONE_BATCH):
    """1 process on the same rows and optimizer steps as the 2-process runs."""
    out = tmp_path_factory.mktemp("single") / "run"
    p = run_cli([str(ROOT / "recipes" / "tiny_cpu_fsdp.yaml"), "distributed.strategy=single",
                 "distributed.num_processes=1", *batches, f"output.dir={out}", *COMMON, *extra],
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def single_strict(tmp_path_factory):
    return single_run(tmp_path_factory, STRICT)


@pytest.fixture(scope="module")
def single_default(tmp_path_factory):
    return single_run(tmp_path_factory, [], AS_RANK_BATCHES)


def rel_diff(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("version", [2, 1])
def test_fsdp_matches_one_process(tmp_path, single_strict, version):
    run = tmp_path / "fsdp"
    # Gradient checkpointing on, as in every GPU recipe (the reference runs without it: recomputation
    # must not change a number). FSDP1 gathers the adapter with rank0_only, as a GPU run does.
    log = launch(run, version, STRICT + ["model.gradient_checkpointing=true"])
    # The run really was sharded, through the same code a GPU run executes.
    assert f"fsdp: FSDP{version} over gloo, 2 processes" in log
    ref, got = losses(single_strict), losses(run)
    assert len(got) == len(ref) == STEPS
    assert got == pytest.approx(ref, abs=1e-2)
    a_ref = load_file(str(single_strict / "adapter" / "adapter_model.safetensors"))
    a_fsdp = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert a_ref.keys() == a_fsdp.keys() and len(a_ref) == 4 * 7 * 2
    for k in a_ref:
        assert a_fsdp[k].shape == a_ref[k].shape  # gathered to full shapes, not one rank's shard
        torch.testing.assert_close(a_fsdp[k], a_ref[k], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("version", [2, 1])
def test_fsdp_8bit_trains_like_one_process_and_resumes_exactly(tmp_path, single_default, version):
    run = tmp_path / "fsdp"
    launch(run, version)
    # The reference computes the ranks' two 8-row micro-batches in bf16 as the ranks do. (Against one 16-row
    # batch, bf16 rounding moves a moment across an 8-bit code and 20 steps at lr 2e-3 amplify it to 2-4%.)
    # FSDP2 shards each tensor by rows, here into whole 256-value blocks, so its sharded 8-bit state is the
    # same as one process's. With neither the chunked output head (train/loss.py) nor the memory-lean modules
    # (train/lean.py) the 20 losses are identical (measured: 0.0); each alone moves the 2-process losses by
    # rounding, which 8-bit moments amplify over 20 steps at lr 2e-3 (measured, worst step: lean modules
    # alone 0.46%, chunked head alone 1.03%, both 1.25%). Both are bit for bit the stock computation within
    # one process (tests/integration/test_loop_loss.py); under FSDP2 the same arithmetic rounds differently,
    # most likely because the operands are views into FSDP2's gathered buffers (not isolated further). FSDP1 flattens a layer's tensors into one flat
    # parameter whose 8-bit blocks and 4096-value threshold span tensors: the same moments quantised
    # differently (measured: at most 1.6% over the 20 steps).
    tolerance = 2e-2
    assert losses(run) == pytest.approx(losses(single_default), rel=tolerance)
    full = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    # Crash after the step-10 checkpoint: drop what came later, re-run the same command, which resumes.
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    shutil.rmtree(run / "adapter")
    log = launch(run, version)
    assert f"resume: from {run / 'checkpoints' / f'step-{SAVE}'} (step {SAVE})" in log
    # It resumed, not restarted: the second launch trained (and logged) exactly the steps after the checkpoint.
    trained = [int(n) for n in re.findall(r"^step=(\d+) .*\bloss=", log, re.M)]
    assert trained == list(range(SAVE + 1, STEPS + 1)), log[-3000:]
    resumed = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    for k in full:
        assert rel_diff(resumed[k], full[k]) <= 1e-3, k
    # The 8-bit optimizer state was checkpointed per rank, as uint8 for the large LoRA tensors.
    for rank in (0, 1):
        opt = torch.load(run / "checkpoints" / f"step-{STEPS}" / f"optimizer-rank{rank}.pt", weights_only=True)
        # bitsandbytes nests its tensors (state1/state2, absmax, qmap) under one key per parameter.
        dtypes = {v.dtype for st in opt["state"].values()
                  for v in st.get("__bnb_optimizer_quant_state__", st).values() if torch.is_tensor(v)}
        assert torch.uint8 in dtypes


def test_fsdp_adapter_loads_in_plain_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.weights.load.resolve import resolve_name

    run = tmp_path / "fsdp"
    launch(run, 2, ["train.max_steps=4", "train.save_every=4"])
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    # The adapter names its base portably (builtin:tiny-llama); finetune says where that lives on this machine.
    base = AutoModelForCausalLM.from_pretrained(resolve_name(cfg["base_model_name_or_path"]))
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, str(run / "adapter"))(ids).logits
    assert (after - before).abs().max() > 1e-3
