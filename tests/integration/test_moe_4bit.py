"""MoE experts held 4-bit (weights/experts/module.py) on synthetic Qwen3-MoE and Mixtral checkpoints in the
hub's per-expert layout (2 layers, 16 experts, seeded random weights; moe4bit.py):

- every expert parameter of the loaded model is packed 4-bit bytes (at most 0.3x its bf16 size, the
  quantization state included) and, with `lora.target_parameters: auto`, carries an adapter whose every
  expert receives gradient (the silent skip other tools shipped);
- the 4-bit expert forward, with and without LoRA on the experts, gives the logits of transformers' own
  experts forward (`F.linear` per expert) over the dequantized experts with plain peft's ParamWrapper;
- the real training loop lowers the loss on one process.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from ..conftest import warm_launch
from .families import ROOT
from .moe4bit import BASES, EXPERTS, hub_layout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(BASES))
def family_dir(request, tmp_path_factory):
    return request.param, hub_layout(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _load(path, targets="auto"):
    from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=str(path), dtype="float32"), QuantizationSpec(), quiet=True)
    if targets is None:
        return model
    return apply_lora(model, LoraSpec(dropout=0.0, target_parameters=targets), seed=0)


def _packed(model):
    from finetune.weights.experts.module import PackedExperts

    return [m for m in model.modules() if isinstance(m, PackedExperts)]


def test_every_expert_is_4bit_and_adapted_with_gradient(family_dir):
    from finetune.weights.experts.expert_lora import PackedExpertsLora

    family, path = family_dir
    model = _load(path)
    packed = _packed(model)
    assert len(packed) == 2
    for m in packed:
        for name, (e, rows, cols) in m.shapes.items():
            stored = getattr(m, name).numel() * getattr(m, name).element_size()
            stored += sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n.startswith(name))
            assert e == EXPERTS and stored <= 0.3 * e * rows * cols * 2, (name, stored)
    _check_bytes_are_bitsandbytes(path, model, packed[0])
    # no dense 3-D expert tensor is left anywhere in the model
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    wrappers = [m for m in model.modules() if isinstance(m, PackedExpertsLora)]
    assert sorted(w.parameter_name for w in wrappers) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    ids = torch.randint(3, 384, (4, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    for w in wrappers:  # B starts at zero, so B's gradient is the one that flows first
        grad = w.lora_B["default"].weight.grad.reshape(w.out_features, -1, EXPERTS)
        per_expert = grad.abs().sum(dim=(0, 1))
        assert (per_expert > 0).all(), (w.parameter_name, per_expert)


def _check_bytes_are_bitsandbytes(path, model, m):
    """Layer 0's first and last experts: the packed bytes are bitsandbytes' quantize_4bit of the hub's
    per-expert weights (NF4, double quantization), and dequantize back as its dequantize_4bit does."""
    import bitsandbytes.functional as bf
    from safetensors.torch import load_file

    from finetune.plan.archs import per_expert_keys

    hub = load_file(path / "model.safetensors")
    for name in ("gate_up_proj", "down_proj"):
        keys = per_expert_keys(f"model.layers.0.mlp.experts.{name}", model.config.model_type, EXPERTS)
        size = m.per_expert(name)
        for e in (0, EXPERTS - 1):
            w = torch.cat([hub[k] for k in keys[e]]).float()
            want, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                        quant_storage=torch.float32)
            got = getattr(m, name).reshape(-1)[e * size:(e + 1) * size]
            assert torch.equal(got.view(torch.uint8), want.reshape(-1).view(torch.uint8))  # bytes, not floats
            assert torch.equal(m.dequantized(name, e), bf.dequantize_4bit(want, qs))
            # bf16 written by bitsandbytes directly is the fp32 dequantization rounded once: what the grouped
            # path and the per-expert loop rely on to skip the fp32 copy
            assert torch.equal(m.dequantized(name, e, torch.bfloat16), m.dequantized(name, e).bfloat16())


def _dense_reference(model, family):
    """A copy of `model` whose experts are transformers' own module over the dequantized experts."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from finetune.weights.experts.module import PackedExperts

    cls = {"qwen3moe": Qwen3MoeExperts, "mixtral": MixtralExperts}[family]
    ref = copy.deepcopy(model)
    ref.config._experts_implementation = "eager"  # transformers' loop: F.linear(x, W[e]) per routed expert
    for name, m in list(ref.named_modules()):
        if isinstance(m, PackedExperts):
            dense = cls(ref.config)
            for p in ("gate_up_proj", "down_proj"):
                w = torch.stack([m.dequantized(p, e) for e in range(m.num_experts)])
                setattr(dense, p, torch.nn.Parameter(w, requires_grad=False))
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, dense)
    return ref


@pytest.mark.parametrize("targets", [[], "auto"])
def test_4bit_expert_logits_equal_the_dequantized_reference(family_dir, targets):
    from peft import get_peft_model

    from finetune.recipe import LoraSpec
    from finetune.train.lora import peft_config

    family, path = family_dir
    base = _load(path, targets=None)
    ref = _dense_reference(base, family)
    ours = _load(path, targets=targets)
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(1))
    if targets:
        ref = get_peft_model(ref, peft_config(LoraSpec(dropout=0.0, target_parameters=targets), ref))
        g = torch.Generator().manual_seed(2)
        state = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in ours.state_dict().items() if "lora_" in k}
        ours.load_state_dict(state, strict=False)
        assert not ref.load_state_dict(state, strict=False).unexpected_keys
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, ref(input_ids=ids).logits
        if targets:  # the adapters on the experts move the logits: the comparison covers them
            with ours.disable_adapter():
                assert (ours(input_ids=ids).logits - got).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_experts_wait_on_the_device_once_per_layer_not_once_per_expert(family_dir):
    """Each PackedExperts call groups the router's picks with no device-dependent shape on the way (argsort,
    bincount) and reads the host once, for the per-expert counts (`.tolist()`, which torch's CPU dispatch
    does not show); the backward reads nothing. On a GPU each such read is a wait: picking each expert's rows
    with torch.unique and torch.where waited once per expert (2.4 s per step for 4 layers of 128 experts on
    an H100, benchmarks/RESULTS_GPU.md). Counted through torch's dispatch, as the loss's test counts its
    reads; the old code fails it with one nonzero per expert hit."""
    import inspect
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from finetune.weights.experts.module import PackedExperts

    experts_file = inspect.getfile(PackedExperts)

    _, path = family_dir
    model = _load(path, targets="auto")
    calls = []
    for m in model.modules():
        if isinstance(m, PackedExperts):
            m.register_forward_pre_hook(lambda *_: calls.append(1))
    waits = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default, torch.ops.aten.item.default}
    reads, ops = [], []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(fr.filename == experts_file for fr in traceback.extract_stack()):
                ops.append(func)
                if func in waits:
                    reads.append(str(func))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(3))
    with Reads():
        model(input_ids=ids).logits.float().pow(2).mean().backward()
    assert len(calls) == 2 and ops, calls  # 2 layers, and the mode saw the experts' work
    assert reads == [], reads
    assert ops.count(torch.ops.aten.bincount.default) == len(calls)  # the counts: once per call


@pytest.fixture(scope="module")
def trained(family_dir, tmp_path_factory):
    """(family, base dir, run dir): 8 steps of the real loop, every expert adapted."""
    from finetune.recipe import load
    from finetune.train.loop import train

    family, path = family_dir
    run_dir = tmp_path_factory.mktemp(f"{family}-run") / "run"
    recipe = load(ROOT / "recipes" / "tiny_cpu.yaml", [
        f"model.name={path}", "train.max_steps=8", "train.warmup_steps=0", "train.log_every=1",
        "data.max_samples=64", "data.max_seq_len=48", "output.progress_bar=false", "data.eval_sources=[]",
        "data.eval_split=0", "lora.dropout=0", f"output.dir={run_dir}"])
    train(recipe, run_dir)
    return family, path, run_dir


def test_training_lowers_the_loss_on_one_process(trained):
    run_dir = trained[2]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses


def test_merge_at_fp32_passes_parity_with_experts_as_training_held_them(trained):
    """`--target original` folds the expert adapters into the published experts; `--target nf4` into the
    experts dequantized exactly as training held them (each expert's 4-bit bytes), both within 1e-4 of
    base + adapter in logits. merged(nf4) - merged(original) is the training-time quantization error of
    each expert, read from the 4-bit model itself."""
    from safetensors.torch import load_file

    from finetune.merge.stream import merge
    from finetune.plan.archs import per_expert_keys

    family, path, run_dir = trained
    outs = {t: merge(run_dir, output=run_dir / f"merged-{t}", target=t, dtype="fp32") for t in ("original", "nf4")}
    for t, out in outs.items():
        parity = json.loads((out / "merge_info.json").read_text())["parity"]
        assert parity["status"] == "passed" and parity["kind"] == "logits" and parity["tolerance"] == 1e-4, (t, parity)
    merged = {t: {} for t in outs}
    for t, out in outs.items():
        for f in out.glob("*.safetensors"):
            merged[t].update(load_file(f))
    hub = load_file(path / "model.safetensors")
    m = _packed(_load(path, targets=None))[1]  # layer 1's experts, as training held them (fp32)
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    for name in ("gate_up_proj", "down_proj"):
        keys = per_expert_keys(f"model.layers.1.mlp.experts.{name}", model_type, EXPERTS)
        for e in (0, 7, EXPERTS - 1):
            got = torch.cat([merged["nf4"][k] - merged["original"][k] for k in keys[e]])
            want = m.dequantized(name, e) - torch.cat([hub[k] for k in keys[e]]).float()
            assert want.abs().max() > 1e-3  # the 4-bit error is there to see
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("version", ["2", "1"])
def test_fsdp_shards_the_packed_experts_and_the_loss_falls(tmp_path, version):
    """Two FSDP processes over gloo: training lowers the loss; under FSDP2 each rank holds its dim-0 chunk
    of the packed expert bytes (equal to a one-process load's, quantization state whole)."""
    import os
    import subprocess
    import sys

    dirs = {f: hub_layout(f, tmp_path / f / "model") for f in BASES}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "integration" / "moe4bit_worker.py"), str(tmp_path), version,
           *(f"{f}={d}" for f, d in dirs.items())]
    cmd, env = warm_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for family in BASES:
        losses = [json.loads(line)["loss"] for line in (tmp_path / family / "metrics.jsonl").read_text().splitlines()
                  if "loss" in json.loads(line)]
        assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, (family, losses)
        for rank in (0, 1) if version == "2" else ():
            shards = json.loads((tmp_path / f"{family}.{rank}.json").read_text())["shards"]
            assert len(shards) == 4, shards
            for name, (same, local, whole) in shards.items():
                assert same and 0 < local and 2 * local <= whole + 1, (family, rank, name, local, whole)


def test_a_finished_run_loads_for_eval_with_its_expert_adapters(trained):
    """`finetune eval` / `generate` (train/inference.load_run): the 4-bit base, the saved adapter in peft,
    and every expert adapter running through PackedExpertsLora."""
    from finetune.train.inference import load_run
    from finetune.weights.experts.expert_lora import PackedExpertsLora

    _, _, run_dir = trained
    _, _, model = load_run(run_dir)
    assert len([m for m in model.modules() if isinstance(m, PackedExpertsLora)]) == 4
    ids = torch.randint(3, 384, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.isfinite(adapted).all() and (adapted - base).abs().max() > 1e-4


def test_the_plan_counts_the_experts_bytes_and_workspace_as_loaded(family_dir):
    """plan/quantized.py against the loaded model: the packed expert bytes and their quantization state
    exactly, and the dequantization workspace as one parameter's experts dequantized together (the grouped
    layout, weights/experts/grouped.py), written by bitsandbytes in the compute dtype (bf16) directly."""
    from finetune.plan import estimate as E
    from finetune.plan.archs import from_config
    from finetune.plan.quantized import expert_weight_bytes, expert_workspace_bytes

    _, path = family_dir
    model = _load(path, targets=None)
    packed = _packed(model)
    arch = from_config(model.config.to_dict(), str(path))
    s = E.Setup(model=str(path), model_dtype="float32", quant_storage="float32", mixed_precision="bf16")
    stored = sum(getattr(m, n).numel() * getattr(m, n).element_size() for m in packed for n in m.shapes)
    state = sum(b.numel() * b.element_size() for m in packed for b in m.buffers())
    assert expert_weight_bytes(arch, s) == (stored, state)
    biggest = max(m.num_experts * m.dequantized(n, 0).numel() for m in packed for n in m.shapes)
    assert expert_workspace_bytes(arch, s) == biggest * 2  # the grouped layout: a parameter's experts, bf16


@pytest.mark.parametrize("targets", ["auto", []], ids=["experts-adapted", "experts-frozen"])
def test_the_plans_activations_are_within_15_percent_of_what_autograd_keeps(family_dir, targets):
    """plan/activations.py against the bytes autograd saves in one forward of the 4-bit expert model
    (saved-tensor hooks, benchmarks/cpu/memcheck.py), over seq x micro-batch x checkpointing: the routed
    tokens' indices, inputs, the weighted outputs index_add_ keeps, each expert's cast adapter slices."""
    from benchmarks.cpu import memcheck
    from finetune.plan import estimate as E
    from finetune.plan.archs import from_config
    from finetune.train import lean

    _, path = family_dir
    model = _load(path, targets)
    lean.apply(model)  # as training sets the model up (train.loss.setup_forward)
    arch = from_config(model.config.to_dict(), str(path))
    per_layer, rows = {}, []
    whole = [x for x in memcheck.SWEEP if x[2] is True or x[2] is False]  # the partial layouts: memcheck's own
    for seq, batch, ck in sorted(whole, key=lambda x: x[2]):  # without checkpointing first
        got = memcheck.measure_activations(model, batch, seq, ck)
        if not ck:
            per_layer[(seq, batch)] = got["per_layer"]
        # with checkpointing the peak is what the checkpoints keep plus one layer recomputed in backward
        measured = got["total"] + (per_layer[(seq, batch)] if ck else 0)
        s = E.Setup(model=str(path), seq_len=seq, micro_batch=batch, lora_dropout=0.0, lora_expert_targets=targets,
                    model_dtype="float32", quant_storage="float32", optimizer="adamw_8bit", checkpointing=ck,
                    device="cpu", loss="transformers")  # measured through model(labels=...)
        terms = E.activation_terms(arch, s)
        planned = terms["activations"] - terms["_transient"] + terms["_head_saved"]  # saved tensors only
        rows.append((seq, batch, ck, planned, measured, abs(planned - measured) / measured))
    assert len(rows) == 12
    assert all(r[5] <= 0.15 for r in rows), rows
