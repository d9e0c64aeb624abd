"""Synthetic model names with `device=cuda`: the option is parsed, kept in the cache key, and refused with the
fix where there is no CUDA (the CPU side of docs/gpu_paths.md's row; the GPU side ran in the GPU proof)."""
import pytest
import torch

from finetune.util import synthetic_names
from finetune.util.errors import RecipeError

NAME = "synthetic:meta-llama/Llama-3.1-8B-Instruct?layers=2&device=cuda"


def test_the_draw_device_is_parsed_and_part_of_the_cache_key():
    assert synthetic_names.draw_device(NAME) == "cuda"
    assert synthetic_names.draw_device(NAME.replace("&device=cuda", "")) == "cpu"
    assert synthetic_names.cache_dir(NAME) != synthetic_names.cache_dir(NAME.replace("&device=cuda", ""))
    base, overrides, _ = synthetic_names.parse(NAME)
    assert base == "meta-llama/Llama-3.1-8B-Instruct" and overrides == {"num_hidden_layers": 2}
    with pytest.raises(RecipeError, match="device='tpu'; known: cpu, cuda"):
        synthetic_names.parse(NAME.replace("cuda", "tpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host draws the weights instead")
def test_drawing_on_cuda_without_a_gpu_is_refused_with_the_fix():
    from finetune.weights.built.synthetic import synthetic_dir

    with pytest.raises(RecipeError, match="Fix: drop device=cuda"):
        synthetic_dir(NAME)
