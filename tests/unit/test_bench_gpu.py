"""benchmarks/gpu/measure.py: argument handling, GPU-name lookup, the figures it derives and the report it writes.
(The measurement itself needs CUDA and is not run here.)"""
import glob
from pathlib import Path

import pytest

from benchmarks.gpu import measure as gpu
from finetune.plan.archs import from_config
from finetune.util.errors import RecipeError, RunError

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "tie_word_embeddings": False}
NO_GPU = not glob.glob("/dev/nvidia[0-9]*")
RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "llama3_8b_qlora.yaml")


def test_defaults_and_overrides():
    """Without flags the run it trains loads and times something: a warm-up window, then at least one whole
    window of timed steps, logged once a window, with no evaluation or checkpoint inside; the user's overrides
    apply, and ours win where they clash."""
    from finetune.recipe import load

    a = gpu.parse_args([RECIPE, "train.micro_batch_size=2", "train.max_steps=5", "train.eval_every=1"])
    rec = load(RECIPE, gpu.bench_overrides(a, "/tmp/x"))
    t = rec.train
    assert t.micro_batch_size == 2 and rec.output.dir == "/tmp/x"
    # the first logged window is the warm-up, left out of the figures; the steps after it are the timed ones
    timed = t.max_steps - t.log_every
    assert timed == a.steps >= t.log_every and timed % t.log_every == 0, (t.max_steps, t.log_every, a.steps)
    assert t.eval_every is None and t.save_every is None
    assert gpu.peak_tflops("NVIDIA L4", a.peak_tflops) == 121.0  # no --peak-tflops: the GPU's name decides


def test_timed_steps_round_up_to_whole_windows():
    assert gpu.parse_args(["r.yaml", "--steps", "25", "--warmup", "10"]).steps == 30
    assert gpu.parse_args(["r.yaml", "--steps", "5", "--warmup", "5"]).steps == 5


@pytest.mark.parametrize("args,fragment", [
    (["r.yaml", "--steps", "0"], "--steps must be at least 1"),
    (["r.yaml", "--warmup", "0"], "--warmup must be at least 1"),
    (["r.yaml", "--peak-tflops", "-3"], "--peak-tflops must be positive"),
    (["r.yaml", "max_steps"], "overrides are key=value"),
])
def test_bad_arguments_are_recipe_errors(args, fragment):
    with pytest.raises(RecipeError) as e:
        gpu.parse_args(args)
    assert fragment in e.value.render()


def test_several_processes_need_a_shared_run_dir(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RecipeError, match="--run-dir is required"):
        gpu.parse_args(["r.yaml"])
    assert gpu.parse_args(["r.yaml", "--run-dir", "/shared/run"]).run_dir.name == "run"


def test_main_rejects_bad_recipe_before_anything_loads(capsys):
    assert gpu.main([RECIPE, "train.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert gpu.main(["does/not/exist.yaml"]) == 2


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: main would really train")
def test_main_without_gpu_exits_2_with_a_message(capsys, tmp_path):
    out = tmp_path / "R.md"
    assert gpu.main([RECIPE, "--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_main_exits_3_when_the_run_itself_stops(monkeypatch, capsys, tmp_path):
    """A valid recipe whose training cannot go on (diverged, run dir in use): finetune's exit 3, not bad input."""
    def stopped(a, argv, run_dir):  # the training, on a machine this test does not have
        raise RunError(["train.learning_rate: training diverged at step 3"])
    monkeypatch.setattr(gpu, "gpu_available", lambda: True)
    monkeypatch.setattr(gpu, "measure", stopped)
    assert gpu.main([RECIPE, "--out", str(tmp_path / "R.md")]) == 3
    err = capsys.readouterr().err
    assert "diverged at step 3" in err and "Traceback" not in err and not (tmp_path / "R.md").exists()


@pytest.mark.parametrize("name,peak", [("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA L40S", 362.1),
                                       ("NVIDIA L4", 121.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA L40", None), ("Some Future GPU", None)])
def test_peak_from_gpu_name(name, peak):
    assert gpu.peak_tflops(name) == peak


def test_explicit_peak_wins():
    assert gpu.peak_tflops("NVIDIA GeForce RTX 4090", 100.0) == 100.0


def _records():
    # What the loop writes with log_every=10 over 30 steps: windows 2-10, 11-20, 21-30.
    return [{"step": 1, "time": 0.5, "tokens_per_s": 10.0}, {"step": 10, "time": 3.0, "tokens_per_s": 900.0},
            {"step": 20, "time": 5.0, "tokens_per_s": 1000.0}, {"step": 30, "time": 7.0, "tokens_per_s": 1200.0}]


def test_summarize_throughput_memory_and_mfu():
    arch = from_config(TINY)
    peaks = [{"allocated": 3 * 2**30, "reserved": 4 * 2**30}, {"allocated": 2**30, "reserved": 2 * 2**30}]
    r = gpu.summarize(_records(), peaks, warmup=10, world=2, arch=arch, lora_r=16, lora_targets="all-linear",
                      seq=64, checkpointing=True, tokens_per_trained=3.0, gpu_name="NVIDIA L4", tflops=121.0)
    assert r["tokens_per_s"] == pytest.approx(1100.0)  # (1000*2 + 1200*2) / 4 s; the warm-up window is left out
    assert r["tokens_per_s_per_gpu"] == pytest.approx(550.0)
    assert r["processed_tokens_per_s_per_gpu"] == pytest.approx(1650.0)
    assert r["s_per_step"] == pytest.approx(0.2)
    assert r["peak_allocated_gib"] == [3.0, 1.0] and r["peak_reserved_gib"] == [4.0, 2.0]
    assert r["mfu"] == pytest.approx(1650.0 * r["flops_per_token_model"] / 121e12)
    assert r["flops_per_token_hardware"] > r["flops_per_token_model"]  # recomputation is not useful work
    assert r["hfu"] > r["mfu"]


def test_summarize_without_known_peak_has_no_mfu():
    r = gpu.summarize(_records(), [{"allocated": 1, "reserved": 2}], warmup=10, world=1, arch=from_config(TINY),
                      lora_r=8, lora_targets=["q_proj", "v_proj"], seq=32, checkpointing=False,
                      tokens_per_trained=1.0, gpu_name="x", tflops=None)
    assert r["mfu"] is None and r["hfu"] is None and r["tokens_per_s_per_gpu"] == pytest.approx(1100.0)


def _result(**kw):
    r = gpu.summarize(_records(), [{"allocated": int(6.5 * 2**30), "reserved": 7 * 2**30}], warmup=10, world=1,
                      arch=from_config(TINY), lora_r=16, lora_targets="all-linear", seq=64, checkpointing=True,
                      tokens_per_trained=2.0, gpu_name="NVIDIA GeForce RTX 4090", tflops=165.2)
    return {**r, "command": "python -m benchmarks.gpu.measure recipes/llama3_8b_qlora.yaml", "date": "2026-11-22",
            "commit": "abc123", "recipe": "recipes/llama3_8b_qlora.yaml", "model": "meta-llama/Llama-3.1-8B",
            "method": "NF4 + LoRA", "seq_len": 2048, "micro_batch": 2, "grad_accum": 8, "packing": True,
            "checkpointing": True, "versions": {"torch": "2.13.0"}, **kw}


def test_report_puts_ours_next_to_published():
    text = gpu.report(_result())
    ours = next(line for line in text.splitlines() if line.startswith("| finetune"))
    assert "6.50 GiB / 7.00 GiB" in ours and "1,100" in ours and "RTX 4090" in ours
    mfu = next(line for line in gpu.report(_result(mfu=0.4567)).splitlines() if line.startswith("| finetune"))
    mfu = mfu.split("|")[-2]  # the last column: MFU (and HFU) in percent
    assert float(mfu.split("%")[0]) == pytest.approx(45.67, abs=0.05), mfu
    published = next(line for line in text.splitlines() if line.startswith("| torchtune"))
    assert "7.4 GiB" in published and "2,413" in published and "Llama 3.1 8B" in published
    assert "sequence length 2048" in text and "commit `abc123`" in text


def test_report_says_when_mfu_is_unknown():
    text = gpu.report(_result(mfu=None, hfu=None, peak_tflops=None))
    assert "n/a (unknown GPU: pass --peak-tflops)" in text
