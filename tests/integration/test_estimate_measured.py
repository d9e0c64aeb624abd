"""The plan against measurement on the tiny model in 4-bit NF4 (double quant, fp32 storage) + LoRA on every
linear, on CPU. Weights, gradients and optimizer state are counted from the live tensors; activations are
what autograd saves for backward, caught with torch.autograd.graph.saved_tensors_hooks (benchmarks/cpu/memcheck.py)."""
import pytest

from benchmarks.cpu import memcheck

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows():
    # r=16 puts every adapter tensor at >= 4096 elements (8-bit optimizer state); r=4 keeps them all in
    # 32-bit state and runs without dropout, so both layouts of the planner are exercised.
    return {"r16": memcheck.compare(r=16, dropout=0.05),
            "r4": memcheck.compare(r=4, dropout=0.0, sweep=[(64, 2, False), (64, 2, True)])}


@pytest.mark.parametrize("case", ["r16", "r4"])
def test_weights_gradients_optimizer_exact(rows, case):
    static = [r for r in rows[case] if not r["what"].startswith("activations")]
    assert {r["what"] for r in static} >= {"base_4bit", "quant_constants", "lora", "gradients",
                                          "optimizer_8bit", "optimizer_32bit"}
    for r in static:
        assert r["error"] <= 0.02, r


@pytest.mark.parametrize("case", ["r16", "r4"])
def test_activations_within_15_percent_over_the_sweep(rows, case):
    act = [r for r in rows[case] if r["what"].startswith("activations")]
    # seq {32,128,256} x micro-batch {1,4} x checkpointing, and 2 of the 4 layers at two lengths
    assert len(act) == (14 if case == "r16" else 2)
    for r in act:
        assert r["measured"] > 0 and r["error"] <= 0.15, r


def test_optimizer_layout_differs_between_ranks(rows):
    by = {case: {r["what"]: r["measured"] for r in rows[case]} for case in rows}
    assert by["r16"]["optimizer_8bit"] > 0 and by["r4"]["optimizer_8bit"] == 0


def test_checkpointing_measurably_saves_memory(rows):
    act = {r["what"]: r["measured"] for r in rows["r16"]}
    assert act["activations seq=128 batch=4 checkpointing=on"] < act["activations seq=128 batch=4 checkpointing=off"] / 2


def test_partial_checkpointing_measures_between_none_and_all(rows):
    act = {r["what"]: r["measured"] for r in rows["r16"]}
    on, off = act["activations seq=256 batch=4 checkpointing=on"], act["activations seq=256 batch=4 checkpointing=off"]
    assert on < act["activations seq=256 batch=4 checkpointing=2 of 4"] < off
