"""`train.kernels: liger`: refused by name where it cannot run (no CUDA GPU, a family Liger or finetune does not
cover, the package missing), both by `validate` before any weights load and by the training path itself."""
from pathlib import Path

import pytest

from finetune import cli
from finetune.train import kernels
from finetune.util.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
MIXTRAL = str(ROOT / "recipes" / "mixtral_8x7b_qlora.yaml")


def _no_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")


def test_validate_refuses_liger_on_cpu_and_on_an_moe_family_naming_why(capsys):
    _no_cuda()
    assert cli.main(["validate", TINY, "train.kernels=liger"]) == 2
    out = capsys.readouterr().out
    assert "train.kernels: liger's kernels are Triton GPU kernels and this machine has no CUDA GPU" in out
    assert cli.main(["validate", MIXTRAL, "train.kernels=liger"]) == 2  # both reasons at once
    out = capsys.readouterr().out
    assert "liger does not apply to mixtral models: its MoE experts are finetune's packed 4-bit module" in out
    assert "no CUDA GPU" in out


def test_kernel_problems_name_the_family_and_the_missing_package():
    assert kernels.kernel_problems("none", "falcon", 0) == []
    falcon = kernels.kernel_problems("liger", "falcon", 1)
    assert falcon[0].path == "train.kernels" and "falcon models: Liger Kernel has no patch for it" in falcon[0].message
    if _installed():  # a GPU machine with the extra: llama on a GPU is fine
        assert kernels.kernel_problems("liger", "llama", 1) == []
    else:  # this machine: the extra is not installed
        (p,) = kernels.kernel_problems("liger", "llama", 1)
        assert "liger-kernel package, which is not installed" in p.message and "finetune[kernels]" in p.fix


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def test_the_training_path_refuses_liger_without_a_gpu_before_patching_anything():
    _no_cuda()
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert kernels.apply_kernels(model, "none") == 0
    with pytest.raises(RecipeError, match="train.kernels: liger's kernels are Triton GPU kernels"):
        kernels.apply_kernels(model, "liger")
    assert not [m for m in model.modules() if "forward" in vars(m)]  # nothing was patched
