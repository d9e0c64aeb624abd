"""On a CPU without native bf16 the default precision becomes fp32 compute (train/precision.py resolve_cpu_precision):
what a recipe sets itself is kept, a bf16 base is left alone, GPUs and bf16-capable CPUs see no change."""
from finetune import recipe as R
from finetune.train.precision import resolve_cpu_precision


def test_defaults_become_fp32_compute_on_a_cpu_without_bf16():
    r = R.from_dict({})
    got, note = resolve_cpu_precision(r, on_cpu=True, native_bf16=False)
    assert (got.train.mixed_precision, got.quantization.compute_dtype) == ("no", "float32")
    assert "fp32" in note and "train.mixed_precision" in note
    # everything else is the recipe as given, and the original is not changed
    assert got.train.learning_rate == r.train.learning_rate and got.model == r.model
    assert (r.train.mixed_precision, r.quantization.compute_dtype) == ("bf16", "bfloat16")


def test_nothing_changes_on_gpus_and_bf16_cpus():
    r = R.from_dict({})
    for on_cpu, native in ((False, False), (True, True)):
        got, note = resolve_cpu_precision(r, on_cpu=on_cpu, native_bf16=native)
        assert got is r and note is None


def test_what_the_recipe_sets_is_kept():
    explicit = R.from_dict({"train": {"mixed_precision": "bf16"}})
    got, note = resolve_cpu_precision(explicit, on_cpu=True, native_bf16=False)
    assert got is explicit and "kept" in note and "10x slower" in note
    # mixed_precision: no named alone: the 4-bit layers still follow it into fp32
    got, _ = resolve_cpu_precision(R.from_dict({"train": {"mixed_precision": "no"}}), True, False)
    assert got.quantization.compute_dtype == "float32"
    pinned = R.from_dict({"quantization": {"compute_dtype": "bfloat16"}})
    got, _ = resolve_cpu_precision(pinned, True, False)
    assert (got.train.mixed_precision, got.quantization.compute_dtype) == ("no", "bfloat16")


def test_a_bf16_base_keeps_bf16_compute():
    r = R.from_dict({"model": {"dtype": "bfloat16"}})
    got, note = resolve_cpu_precision(r, on_cpu=True, native_bf16=False)
    assert got is r and "model.dtype: float32" in note

