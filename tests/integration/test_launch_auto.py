"""`accelerate launch -m finetune RECIPE` with no accelerate config file anywhere, the way the README starts a
run: 1 process trains as `single`, and 2 processes (`--multi_gpu --num_processes 2`, the fewest flags
accelerate needs on CPU) train the same recipe, `distributed.strategy: auto`, as FSDP2 and say so.

Both runs hold the base in bf16 with fp32 LoRA adapters (the 70B setting) and see the same micro-batches:
1 process accumulates 4 micro-batches of 2 rows; 2 processes accumulate 2 each (FSDP2's gradient sync is
off on the first), so the FSDP2 run must match the 1-process run."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 6
COMMON = [f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.log_every=1", "train.save_every=3",
          "train.micro_batch_size=2", "train.optimizer=adamw_torch", "model.dtype=bfloat16",
          "lora.dtype=float32", "eval.max_batches=1", "output.progress_bar=false"]


def accelerate_launch(tmp_path, flags, run_dir, extra):
    """`accelerate launch` with HF_HOME (where its default config lives) pointing at an empty directory."""
    home = tmp_path / "hf_home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HF_HOME=str(home), XDG_CACHE_HOME=str(home), OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_CONFIG_FILE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", "0", "-m", "finetune",
           str(ROOT / "recipes" / "tiny_cpu.yaml"), f"output.dir={run_dir}", *COMMON, *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert not list(home.rglob("default_config.*"))  # really no config anywhere
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    log = accelerate_launch(tmp, [], tmp / "run", ["train.gradient_accumulation_steps=4"])
    return tmp / "run", log


def test_accelerate_launch_without_a_config_trains(one_process):
    run, log = one_process
    # accelerate's default mixed_precision "no" is not a conflict with the recipe's bf16: the recipe decides.
    assert "distributed.strategy: auto -> single for 1 process" in log
    assert len(losses(run)) == STEPS
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


def test_two_process_launch_of_an_auto_recipe_is_fsdp2_and_matches(tmp_path, one_process):
    ref, _ = one_process
    run = tmp_path / "run"
    log = accelerate_launch(tmp_path, ["--multi_gpu", "--num_processes", "2"], run,
                            ["train.gradient_accumulation_steps=2"])
    assert "distributed.strategy: auto -> fsdp (FSDP2) for 2 processes" in log
    assert "fsdp: FSDP2 over gloo, 2 processes" in log
    # bf16 autocast over a bf16 base: what differs is reduction order and bf16 rounding of the summed
    # gradients (measured: see docs/gpu_paths.md).
    assert losses(run) == pytest.approx(losses(ref), rel=2e-3)
    a_ref = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    a_got = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert a_ref.keys() == a_got.keys()
    for k in a_ref:
        assert a_got[k].dtype == torch.float32 and a_got[k].shape == a_ref[k].shape
        assert float((a_got[k] - a_ref[k]).norm() / a_ref[k].norm()) <= 2e-2, k
