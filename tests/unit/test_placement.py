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
