"""The branches a GPU run takes, executed on CPU (docs/gpu_paths.md lists each with its test): fp16 loss
scaling, inputs moved to where the model lives, a GPU that is present but unusable, a broken flash-attn
install, bf16 advice by compute capability, CUDA RNG restore with fewer GPUs."""
from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec, TrainSpec, load
from finetune.data.transfer import model_device
from finetune.train.keepers.checkpoint import restore_cuda_rng
from finetune.train.machine import bf16_native, cuda_unusable_reason
from finetune.train.precision import autocast
from finetune.train.scaling import LossScaler

from ..conftest import ROOT

# These are the GPU branches run on a CPU (a CPU standing in for the GPU, or a GPU that is absent or broken).
# On a host with a usable GPU they would test that host instead: they skip there, and the GPU checks
# (benchmarks/gpu/measure.py) run the real branches.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins for GPU branches; this host has CUDA")

FP16 = TrainSpec(mixed_precision="fp16")


def fp16_model():
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(gradient_checkpointing=False), QuantizationSpec(compute_dtype="float16"), quiet=True)
    return apply_lora(model, LoraSpec(r=8, alpha=16, dropout=0.0), seed=0)


def lora_b_grads_after(model, scaler: LossScaler, factor: float) -> torch.Tensor:
    """Backward of `factor` x the LM loss under fp16 autocast through `scaler`; the lora_B gradients."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    with autocast(FP16, "cpu"):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss * factor).backward()
    scaler.unscale(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0))
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_B" in n])


def test_fp16_loss_scaling_keeps_gradients_that_underflow_unscaled():
    # A loss 2^-26 times the LM loss: its gradients sit below fp16's smallest subnormal (2^-24) inside the
    # half-precision backward. Side by side, same model, same batch:
    model, factor = fp16_model(), 2.0 ** -26
    model.train()
    unscaled = lora_b_grads_after(model, LossScaler("no", "cpu", sharded=False), factor)
    scaled = lora_b_grads_after(model, LossScaler("fp16", "cpu", sharded=False), factor)
    assert int((unscaled != 0).sum()) == 0  # every LoRA gradient flushed to zero
    assert int((scaled != 0).sum()) > 0.5 * scaled.numel()  # scaled: kept, and divided back out
    assert torch.isfinite(scaled).all() and scaled.abs().max() < 1e-3


def test_fp16_inf_step_is_skipped_counted_and_logged(caplog):
    layer = torch.nn.Linear(4, 4)
    before = layer.weight.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler("fp16", "cpu", sharded=False)
    scaler.scale(layer(torch.ones(1, 4)).sum() * float("inf")).backward()
    scaler.unscale(opt)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert scaler.step(opt, step=7) is False
    assert scaler.skipped == 1 and torch.equal(layer.weight, before)
    assert "fp16: step 7 skipped (inf/nan gradients" in caplog.text
    # A finite step afterwards updates the weights and is not counted.
    opt.zero_grad()
    scaler.scale(layer(torch.ones(1, 4)).sum()).backward()
    scaler.unscale(opt)
    assert scaler.step(opt, step=8) is True and scaler.skipped == 1 and not torch.equal(layer.weight, before)


def test_fp16_run_counts_skipped_steps_in_metrics(tmp_path, monkeypatch, capsys):
    """The loop's own scaler, started at a loss scale that overflows fp16 (2^40): every step of the run is
    skipped, counted in metrics.jsonl and logged, and the adapter never moves."""
    from finetune.train import step as step_mod
    from finetune.train.loop import train

    monkeypatch.setattr(step_mod, "LossScaler", functools.partial(LossScaler, init_scale=2.0 ** 40))
    r = load(ROOT / "recipes" / "tiny_cpu.yaml",
             ["train.mixed_precision=fp16", "quantization.compute_dtype=float16", "train.max_steps=2",
              "train.warmup_steps=1", "train.log_every=1", "train.micro_batch_size=2", "data.eval_sources=[]",
              "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 16}]", "output.progress_bar=false",
              f"output.dir={tmp_path / 'run'}"])
    out = train(r, tmp_path / "run")
    assert out["skipped_steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["skipped_steps"] for x in rows if "loss" in x] == [1, 2]
    assert "fp16: step 1 skipped" in capsys.readouterr().err
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert all(not v.any() for k, v in adapter.items() if "lora_B" in k)  # B starts at zero and never stepped
    # The loss scale is checkpointed: a resumed run goes on from the halved scale (2^38 after two skips),
    # not from the scaler's initial 2^40, so its third skip ends at 2^37.
    assert [x["loss_scale"] for x in rows if "loss" in x] == [2.0 ** 39, 2.0 ** 38]
    out = train(r.model_copy(update={"train": r.train.model_copy(update={"max_steps": 3})}), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss_scale"] for x in rows if "loss" in x and x["step"] == 3] == [2.0 ** 37]


# ---------------------------------------------------------------------------------------------------
# Inputs go where the model lives


class Reached(Exception):
    pass


class ModelElsewhere(torch.nn.Module):
    """A model whose parameters live on another device than the CPU batches (the meta device): it records
    the device of every tensor it is called with, then stops the caller (meta tensors hold no values)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
        self.head = torch.nn.Linear(4, 4, device="meta")
        self.seen: list[torch.device] = []

    def get_output_embeddings(self):
        return self.head

    def _record(self, **kwargs):
        self.seen += [v.device for v in kwargs.values() if torch.is_tensor(v)]
        raise Reached

    def forward(self, **kwargs):
        self._record(**kwargs)

    def generate(self, **kwargs):
        self._record(**kwargs)


@pytest.fixture(scope="module")
def tok():
    from finetune.weights.load.resolve import load_tokenizer

    return load_tokenizer(ModelSpec())


def _generate(model, tok):
    from finetune.train.inference import greedy

    greedy(model, tok, ["reverse: a b c"], max_new_tokens=2)


def _eval_loss(model, tok):
    from finetune.data.prepare import prepare
    from finetune.train.inference import heldout_loss

    # No autocast: torch has none for the meta device (a GPU run autocasts on "cuda", the model's device type).
    r = load(ROOT / "recipes" / "tiny_cpu.yaml", ["data.sources=[{path: 'builtin:tiny-instruct', max_samples: 8}]",
                                                  "train.mixed_precision=no"])
    # The real path: heldout_loss -> loss_totals -> token_loss_sum, up to the model's forward. What depends
    # on the labels' values (rows, targets) is worked out on the host before the move (loss.device_batch),
    # so nothing reads a meta tensor's values before the model records its inputs.
    heldout_loss(model, prepare(r.data, tok).eval[:4], r)


def _merge_check(model, tok):
    from finetune.merge.check import _logits

    _logits(model, tok, ["The quick brown fox"])


@pytest.mark.parametrize("call", [_generate, _eval_loss, _merge_check], ids=["generate", "eval", "merge-check"])
def test_inputs_are_moved_to_the_models_device(call, tok):
    model = ModelElsewhere()
    assert model_device(model).type == "meta"
    with pytest.raises(Reached):
        call(model, tok)
    assert model.seen and {d.type for d in model.seen} == {"meta"}


# ---------------------------------------------------------------------------------------------------
# Devices


def test_gpu_present_but_unusable_is_refused_with_the_reason(monkeypatch, capsys, tmp_path):
    from finetune import cli
    from finetune.recipe import DistributedSpec, FsdpSpec
    from finetune.train import machine as device
    from finetune.train import parallel as distributed
    from finetune.train import preflight
    from finetune.util.errors import RunError, exit_code

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_unusable_reason(nodes=[]) is None  # no GPU installed: CPU training is the plan
    why = cuda_unusable_reason(nodes=["/dev/nvidia0"])
    assert "/dev/nvidia0" in why and "Fix:" in why
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert cuda_unusable_reason(nodes=["/dev/nvidia0"]) is None  # hidden on purpose
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # make_accelerator stops (exit 3 through RunError: the recipe is fine, this machine is not) instead of
    # training on the CPU.
    monkeypatch.setattr(device, "gpu_device_nodes", lambda: ["/dev/nvidia0"])

    def accelerator(argv):
        distributed.make_accelerator(DistributedSpec(strategy="single"), FsdpSpec(), TrainSpec(), "float32")

    with pytest.raises(RunError, match="GPU is installed"):
        accelerator([])
    assert exit_code(accelerator, []) == 3
    assert "GPU is installed" in capsys.readouterr().err
    # The train verb's preflight finds it first, before any weights load: exit 3 too (bad input would be 2).
    monkeypatch.setattr(preflight, "gpu_nodes_present", lambda: True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the verb sets it for the process; the monkeypatch restores it
    tiny = str(ROOT / "recipes" / "tiny_cpu.yaml")
    assert cli.main([tiny, f"output.dir={tmp_path / 'run'}"]) == 3
    err = capsys.readouterr().err
    assert "/dev/nvidia0" in err and "Traceback" not in err and not (tmp_path / "run").exists()
    # ... unless the recipe is wrong as well: bad input comes first (2), naming both
    assert cli.main([tiny, f"output.dir={tmp_path / 'run'}", "distributed.backend=nccl"]) == 2
    err = capsys.readouterr().err
    assert "distributed.backend" in err and "/dev/nvidia0" in err


def test_broken_flash_attn_falls_back_to_sdpa_with_the_reason(tmp_path, monkeypatch, capsys):
    from finetune.weights.load.resolve import resolve_attention
    from finetune.util.log import log

    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "flash_attn", raising=False)
    assert log.name == "finetune"
    assert resolve_attention("flash_attention_2") == "sdpa"
    line = capsys.readouterr().out
    assert "flash-attn is installed but fails to import: flash_attn_2_cuda.so: undefined symbol" in line


def test_bf16_advice_keys_on_compute_capability():
    assert not bf16_native((7, 5))  # T4: torch.cuda.is_bf16_supported() says True (emulated)
    assert not bf16_native((7, 0)) and not bf16_native(None)
    assert bf16_native((8, 0)) and bf16_native((9, 0))


def test_cuda_rng_restore_without_cuda_restores_nothing():
    # With CUDA it restores min(saved, visible) devices (the GPU check covers that); here: no crash.
    assert restore_cuda_rng([torch.ByteTensor(16)] * 4) == 0


# ---------------------------------------------------------------------------------------------------
# Preemption under torchrun: workers are killed ~30 s after SIGTERM, so the flag is read per micro-batch


def test_stop_between_micro_batches_abandons_the_step_and_checkpoints_the_last(tmp_path, capsys):
    import os
    import signal

    from finetune.train.keepers import checkpoint
    from finetune.train.loop import train

    forwards = []

    def preempt_in_step_2(module, args, output):
        if type(module).__name__ == "LlamaForCausalLM":
            forwards.append(1)
            if len(forwards) == 6:  # step 2's second of 4 micro-batches
                os.kill(os.getpid(), signal.SIGTERM)

    r = load(ROOT / "recipes" / "tiny_cpu.yaml",
             ["train.max_steps=4", "train.warmup_steps=1", "train.log_every=1", "train.micro_batch_size=2",
              "train.gradient_accumulation_steps=4", "train.save_every=10", "data.eval_sources=[]",
              "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 64}]", "output.progress_bar=false",
              f"output.dir={tmp_path / 'run'}"])
    handle = torch.nn.modules.module.register_module_forward_hook(preempt_in_step_2)
    try:
        out = train(r, tmp_path / "run")
    finally:
        handle.remove()
    assert out["stopped"] and out["step"] == 1 and len(forwards) == 6  # no further forward after the signal
    assert "during step 2, which was abandoned: checkpoints/step-1;" in capsys.readouterr().out
    state = checkpoint.verify(tmp_path / "run" / "checkpoints" / "step-1", 1)
    # The position is the end of step 1 (4 micro-batches), not where step 2 was cut off (6): resuming
    # replays step 2 whole.
    assert state["step"] == 1 and state["data"] == {"epoch": 0, "cursor": 4}


def test_gloo_backend_on_gpus_is_refused_with_the_fix(monkeypatch):
    from finetune.recipe import DistributedSpec, FsdpSpec
    from finetune.train import parallel as distributed
    from finetune.util.errors import RecipeError

    # The device check comes first and builds nothing, so the GPU side of it runs here.
    monkeypatch.setattr(distributed, "has_accelerator_device", lambda: True)
    with pytest.raises(RecipeError, match="Fix: use distributed.backend: auto"):
        distributed.make_accelerator(DistributedSpec(strategy="single", backend="gloo"), FsdpSpec(), TrainSpec(),
                                     "float32")


def test_validate_names_an_unusable_gpu_before_any_weights_load(monkeypatch):
    from finetune.train import preflight
    from finetune.train import machine as device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(preflight, "gpu_nodes_present", lambda: True)
    monkeypatch.setattr(device, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    problems = preflight.preflight(load(ROOT / "recipes" / "tiny_cpu.yaml"), env={}, launched=False)
    [p] = [p for p in problems if p.path == "device"]
    assert p.level == "error" and "/dev/nvidia0" in p.message and "CUDA_VISIBLE_DEVICES=-1" in p.fix
