"""`train.compile: true` (finetune.train.compiled): the decoder layers compiled train the eager losses, make
their graphs in step 1 and none after, fall back per layer with one line when a layer cannot compile, and a
resumed run compiles again and continues the same losses; also under 2-process FSDP2.

The backend is aot_eager (FINETUNE_COMPILE_BACKEND): the same dynamo capture, guards and AOT autograd
forward/backward split as inductor, with eager kernels, because inductor's C++ code generation takes minutes
on the 2-core CI machine (docs/gpu_paths.md). The CPU benchmark (benchmarks/cpu/compiled.py) runs inductor.
Compute is fp32 (mixed_precision no), where the compiled and eager losses must agree to rounding."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from finetune import recipe as R
from finetune.train import compiled
from finetune.train.loop import train

from ..conftest import ROOT, warm_launch

pytestmark = pytest.mark.slow
STRICT = {"mixed_precision": "no", "optimizer": "adamw_torch"}


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch.compiler.reset()  # each test compiles from nothing, as a new process does
    yield
    torch.compiler.reset()


def tiny(run_dir, compile: bool, steps: int, **train_kw):
    return R.from_dict({
        "model": {"gradient_checkpointing": False},
        "quantization": {"compute_dtype": "float32"},
        # rows of many lengths, dynamically padded: batches of new lengths must reuse the graphs
        "data": {"max_seq_len": 64, "max_samples": 96, "prompt_template": "raw"},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 4, "max_steps": steps, "learning_rate": 3e-3, "log_every": 1,
                  "compile": compile, **STRICT, **train_kw},
        "output": {"dir": str(run_dir), "progress_bar": False},
    })


def logged(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_compiled_layers_train_the_eager_losses_compile_only_in_step_1_and_again_on_resume(tmp_path, monkeypatch,
                                                                                          capsys):
    lengths = []
    mark = compiled._dynamic_lengths
    monkeypatch.setattr(compiled, "_dynamic_lengths", lambda a, k: (lengths.append(a[0].size(1)), mark(a, k)))
    eager = train(tiny(tmp_path / "eager", False, 50), tmp_path / "eager")
    assert not lengths and "recompiles" not in eager  # compile off: no layer went through the compiled path
    run = tmp_path / "compiled"
    recipe = tiny(run, True, 50, save_every=45)
    got = train(recipe, run)
    out = capsys.readouterr().out
    assert "compile: 4 of 4 decoder layers compiled (aot_eager) into 2 graphs" in out  # input needs grad or not
    assert len(set(lengths)) > 5  # batches of many lengths went through the compiled layers ...
    assert got["recompiles"] == 0 and [r["recompiles"] for r in logged(run)] == [0] * 50  # ... on 2 graphs
    ref, new = [r["loss"] for r in logged(tmp_path / "eager")], [r["loss"] for r in logged(run)]
    assert len(ref) == len(new) == 50
    assert new == pytest.approx(ref, abs=1e-4)
    assert got["eval_loss"] == pytest.approx(eager["eval_loss"], abs=1e-4)  # evaluation runs the layers eager

    # A resumed run (as after a crash past step 45) compiles the same graphs again and continues the same losses.
    shutil.rmtree(run / "checkpoints" / "step-50")
    shutil.rmtree(run / "adapter")
    torch.compiler.reset()  # a new process has no compiled graphs
    resumed = train(recipe, run)
    out = capsys.readouterr().out
    assert "resume: from" in out and "into 2 graphs; step 46 took" in out and "step=46 " in out
    assert resumed["recompiles"] == 0
    assert [r["loss"] for r in logged(run)][45:] == pytest.approx(new[45:], abs=1e-6)


def test_a_layer_that_cannot_compile_runs_eager_and_says_so(capsys):
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self, host_read: bool):
            super().__init__()
            self.lin, self.host_read = torch.nn.Linear(8, 8), host_read

        def forward(self, x):
            if self.host_read and float(x.detach().sum()) > 1e9:  # a value read on the host: a graph break
                return x
            return self.lin(x).relu()

    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(False), Layer(True), Layer(False)).train()
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = model(x)
    layers = compiled.CompiledLayers(model, "aot_eager")
    got = model(x)
    err = capsys.readouterr().err
    assert layers.eager.keys() == {1}
    assert err.count("runs eager") == 1 and "compile: decoder layer 1 (Layer) runs eager, it did not compile:" in err
    torch.testing.assert_close(got, want)
    assert compiled.graphs_made() >= 1  # the other two layers did compile
    got.sum().backward()  # and train
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.distributed
def test_fsdp2_two_processes_compiled_train_the_eager_losses(tmp_path):
    def launch(run_dir, compile: bool):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file",
               str(ROOT / "configs" / "cpu_fsdp.yaml"), "--num_processes", "2", "-m", "finetune",
               str(ROOT / "recipes" / "tiny_cpu_fsdp.yaml"), f"output.dir={run_dir}", "train.max_steps=4", "train.warmup_steps=1",
               "train.log_every=1", "train.save_every=4", "data.max_samples=64", "output.progress_bar=false",
               "train.mixed_precision=no", "quantization.compute_dtype=float32", "train.optimizer=adamw_torch",
               "model.gradient_checkpointing=true", f"train.compile={str(compile).lower()}", "eval.max_batches=1"]
        cmd, env = warm_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1", **{compiled.BACKEND_ENV: "aot_eager"}))
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout + p.stderr

    log = launch(tmp_path / "compiled", True)
    assert "fsdp: FSDP2 over gloo, 2 processes" in log
    assert "compile: 4 of 4 decoder layers compiled (aot_eager)" in log and "runs eager" not in log
    launch(tmp_path / "eager", False)
    got, ref = logged(tmp_path / "compiled"), logged(tmp_path / "eager")
    assert [r["recompiles"] for r in got] == [0] * 4
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], abs=1e-4)


def test_an_unpadded_batch_after_padded_ones_reuses_the_graphs(tiny_model_dir):
    """transformers hands the layers `attention_mask=None` for a batch without padding and a boolean mask for a
    padded one; the compiled layers see a mask either way, so the unpadded batch makes no graph (measured
    before: 2 more graphs at the first unpadded batch) and trains what eager trains."""
    from .conftest import tiny_lora_fp32

    model = tiny_lora_fp32(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(2, 9, dtype=torch.long)
    padded[1, 6:] = 0
    unpadded = torch.ones(2, 9, dtype=torch.long)

    def loss_and_grads(mask):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = loss_and_grads(unpadded)
    layers = compiled.CompiledLayers(model, "aot_eager")
    loss_and_grads(padded)
    layers.step_done(1)
    got = loss_and_grads(unpadded)
    assert layers.recompiles() == 0 and not layers.eager
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
