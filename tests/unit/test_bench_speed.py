"""benchmarks/gpu/speed.py: which arms run. An arm whose setting this checkout's schema does not take is skipped
with the schema's words (so the stage runs before and after a setting lands); any other refusal is the stage's
own bug and raises. (The arms themselves run in the GPU proof's dry run: tests/integration/test_gpu_proof.py.)"""
import pytest
from pydantic import ValidationError

from benchmarks.gpu import speed
from benchmarks.gpu.harness import shapes


def test_an_arm_the_schema_does_not_take_is_skipped_with_the_reason(tmp_path):
    sh_ = shapes(dry=True)
    assert speed.unavailable(speed.arm_recipe(sh_, tmp_path, "today", {}), {}) is None
    rec = speed.arm_recipe(sh_, tmp_path, "x", {"train.no_such_setting": True})
    assert speed.unavailable(rec, {"train.no_such_setting": True}) == \
        "train.no_such_setting: Extra inputs are not permitted"
    kernels = speed.arm_recipe(sh_, tmp_path, "kernels", speed.ARMS["kernels"])
    assert kernels["train"]["kernels"] == "liger" and speed.unavailable(kernels, speed.ARMS["kernels"]) is None


def test_a_refusal_outside_the_arms_settings_raises(tmp_path):
    rec = speed.arm_recipe(shapes(dry=True), tmp_path, "x", {"train.no_such_setting": True})
    rec["train"]["max_steps"] = 0  # the stage's own recipe broken: not an arm to skip
    with pytest.raises(ValidationError, match="max_steps"):
        speed.unavailable(rec, {"train.no_such_setting": True})


def test_the_dry_run_leaves_out_kernels_and_compile_and_skips_what_is_left_of_no_use(monkeypatch):
    monkeypatch.delenv(speed.DRY_COMPILE, raising=False)
    plans = {name: speed.arm_plan(name, s, True, []) for name, s in speed.ARMS.items()}
    assert plans["today"] == ({}, None) and plans["auto"] == (speed.ARMS["auto"], None)
    assert plans["kernels"] == ({}, "GPU only: liger's Triton kernels need a CUDA GPU")
    assert plans["compile"][1].startswith("not compiled in the dry run")
    kept, why = plans["all"]  # what is left of `all` is the auto arm's setting: not run twice
    assert kept == speed.ARMS["auto"] and why.endswith("(the rest is arm auto)") and "GPU only" in why
    monkeypatch.setenv(speed.DRY_COMPILE, "1")
    assert speed.arm_plan("all", speed.ARMS["all"], True, []) == (
        {"model.gradient_checkpointing": "auto", "train.compile": True}, None)
    for name, settings in speed.ARMS.items():  # on a GPU every arm runs as written, unless left out by name
        assert speed.arm_plan(name, settings, False, []) == (settings, None)
    assert speed.arm_plan("auto", speed.ARMS["auto"], False, ["today"])[1] == f"not in {speed.ONLY}"
