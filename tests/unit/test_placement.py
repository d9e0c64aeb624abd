"""Where a whole model loads outside training (eval, generate, quantize, the merge's check): on the GPU when
there is one, as transformers' from_pretrained puts a 4-bit model, never silently on the CPU."""
import torch

from finetune.recipe import ModelSpec, QuantizationSpec


def test_whole_model_loads_on_the_gpu_when_there_is_one(monkeypatch):
    from finetune.weights import model, placement, skeleton

    got = []

    class Loaded(Exception):
        pass

    def load_base(path, config, dtype, bnb, where, *rest):
        got.append(where)
        raise Loaded
    monkeypatch.setattr(skeleton, "load_base", load_base)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    try:
        model.load_model(ModelSpec(gradient_checkpointing=False), QuantizationSpec(), quiet=True)
    except Loaded:
        pass
    assert [(p.mode, p.device) for p in got] == [("whole", torch.device("cuda", 0))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.default_placement().device == torch.device("cpu")


def test_a_launched_cpu_rank_places_without_copying():
    """Accelerate calls the CPU `cpu:0` under a launcher, and torch copies a tensor moved from `cpu` to
    `cpu:0`: a rank receiving a broadcast 1 GiB table then held it twice (issue 33, benchmarks/cpu/phase_rss.py).
    The placement a real Accelerator gives keeps the CPU without an index, so moving there is free."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from finetune.weights.placement import placement_for

    # what Accelerate's state.set_device gives a launched CPU rank: torch.device("cpu", local index % 1)
    acc = SimpleNamespace(device=torch.device("cpu", 0), distributed_type=DistributedType.MULTI_CPU,
                          process_index=0, num_processes=1, local_process_index=0)
    pl = placement_for(acc)
    t = torch.empty(4)
    assert pl.device.type == "cpu" and t.to(pl.device).data_ptr() == t.data_ptr()
    assert t.to(torch.device("cpu", 0)).data_ptr() != t.data_ptr()  # why: the copy this avoids (torch 2.13)
