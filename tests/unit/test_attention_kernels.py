"""finetune.train.sdpa: on CUDA, SDPA runs only its memory-linear kernels (flash, memory-efficient) when
a probe of the run's attention shape finds one that accepts it, and falls back to torch's choice with one
warning when none does; CPU keeps torch's choice. The probe and the kernel flags are torch's public API, so
they run here; the CUDA kernels themselves need a GPU."""
import logging

import pytest
import torch

from finetune.train import sdpa as attention
from finetune.train.loss import attention_kernels


@pytest.fixture(autouse=True)
def _restore():
    before = dict(attention._state)
    yield
    attention._state.update(before)


def _enabled():
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}


def test_cuda_batches_allow_only_the_memory_linear_kernels_that_accept_the_run():
    rec = attention.cuda_record("sdpa", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
    assert rec["sdpa_backends_allowed"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"]
    assert rec["sdpa_backend_preferred"] == "FLASH_ATTENTION"
    with attention_kernels("cuda", "bf16", 131072):
        assert _enabled() == {"flash": True, "efficient": True, "math": False}
    assert _enabled()["math"]  # restored after the batch
    with attention_kernels("cpu", "no", 131072):  # CPU keeps torch's choice
        assert _enabled()["math"]


def test_no_accepting_kernel_falls_back_to_torchs_choice_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="finetune"):
        rec = attention.cuda_record("sdpa", [])
    assert rec["sdpa_backends_allowed"] == "torch's choice" and rec["sdpa_backend_preferred"] is None
    assert len([r for r in caplog.records if "attention:" in r.getMessage()]) == 1
    with attention_kernels("cuda", "bf16", 131072):
        assert _enabled()["math"]


def test_the_probe_tries_each_kernel_alone():
    # torch's CPU build has a (blockwise) flash kernel and no memory-efficient one
    assert attention.accepting(torch.device("cpu"), torch.float32, 4, 16) == ["FLASH_ATTENTION"]
