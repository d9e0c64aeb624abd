"""The chunked loss takes the output head that FSDP2 has sharded: fully_shard re-classes a module it wraps
(FSDPLinear, a subclass of Linear with Linear's forward), and an exact type check once sent every FSDP2 run to
the full-logits path (found on an H200: 1.96 GiB of fp32 logits at 2 x 2048, benchmarks/RESULTS_GPU.md)."""
import socket

import pytest
import torch
import torch.distributed as dist

from finetune.train.loss import chunkable


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_head_sharded_by_fsdp2_is_still_chunkable(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _tiny_llama()
    assert chunkable(model)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.lm_head) is not torch.nn.Linear  # FSDP2 re-classed it
    assert chunkable(model)


def test_a_head_with_its_own_forward_is_not_chunkable():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = _tiny_llama()
    model.lm_head = Scaled(16, 64, bias=False)
    assert not chunkable(model)
