"""A GPU recipe on the machine it is started on: the weights must be in the local cache (training
reads them offline; the download command is printed), and a model too large for CPU training is refused on a
machine without a GPU unless FINETUNE_ALLOW_CPU=1 says so."""
from pathlib import Path

import pytest

from finetune.recipe import load
from finetune.train.preflight import cuda_facts, here_problems, weights_problem

from ..conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "recipes" / "qwen2.5_7b_qlora.yaml"


def test_weights_missing_from_the_cache_name_the_download_command(tmp_path):
    p = weights_problem(load(QWEN), cache_dir=str(tmp_path))
    assert p is not None and p.path == "model.name" and p.level == "error"
    assert "not in the local Hugging Face cache" in p.message
    assert "hf download Qwen/Qwen2.5-7B-Instruct" in p.fix
    snap = tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "refs" / "main").write_text("abc")
    (snap / "config.json").write_text("{}")
    assert weights_problem(load(QWEN), cache_dir=str(tmp_path)) is not None  # a config alone is not the weights
    (snap / "model-00001-of-00004.safetensors").write_bytes(b"")
    assert weights_problem(load(QWEN), cache_dir=str(tmp_path)) is None
    assert weights_problem(load(ROOT / "recipes" / "tiny_cpu.yaml")) is None  # builtin: nothing to fetch


@pytest.mark.skipif(cuda_facts()[0] > 0, reason="the refusal is for machines without a GPU")
def test_a_large_model_is_refused_on_cpu_unless_allowed():
    device = [p for p in here_problems(load(QWEN), env={}) if p.path == "device"]
    assert device and "no GPU here, and Qwen/Qwen2.5-7B-Instruct has 7.6B parameters" in device[0].message
    assert "FINETUNE_ALLOW_CPU=1" in device[0].fix
    assert not [p for p in here_problems(load(QWEN), env={"FINETUNE_ALLOW_CPU": "1"}) if p.path == "device"]
    assert here_problems(load(ROOT / "recipes" / "tiny_cpu.yaml"), env={}) == []


def test_training_a_gpu_recipe_without_its_weights_stops_at_once_with_the_fix(tmp_path):
    res = run_cli([str(QWEN), f"output.dir={tmp_path / 'run'}"], env={"HF_HOME": str(tmp_path / "hf")}, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    assert "hf download Qwen/Qwen2.5-7B-Instruct" in res.stderr
