"""The load's per-weight collection stays cheap: Python's cycle collector is narrowed to what loading makes
(weights/heap.loading_objects_only) only after the skeleton, whose lazy imports of the model's modules and
bitsandbytes' integration leave ~100k objects that every one of the fill's collections would rescan."""
import gc

from finetune.recipe import ModelSpec, QuantizationSpec


def test_whole_load_collects_only_what_loading_made(monkeypatch):
    from finetune.weights import heap
    from finetune.weights.load import model, skeleton

    depth_at_skeleton, scanned = [], []
    build, release = skeleton.skeleton, skeleton.release_freed_memory

    def traced_skeleton(*args, **kwargs):
        depth_at_skeleton.append(heap._frozen_depth)
        return build(*args, **kwargs)

    def traced_release():
        scanned.append((heap._frozen_depth, len(gc.get_objects())))  # frozen objects are not listed
        release()
    monkeypatch.setattr(skeleton, "skeleton", traced_skeleton)
    monkeypatch.setattr(skeleton, "release_freed_memory", traced_release)
    loaded = model.load_model(ModelSpec(gradient_checkpointing=False), QuantizationSpec(), quiet=True)
    assert depth_at_skeleton == [0]  # the imports happen before the freeze, so they are frozen with it
    assert len(scanned) == len(list(loaded.parameters())) > 10  # once a weight
    assert all(depth > 0 for depth, _ in scanned)
    assert max(n for _, n in scanned) < 20_000, scanned  # measured: a few hundred; ~97k before the fix
    assert heap._frozen_depth == 0
