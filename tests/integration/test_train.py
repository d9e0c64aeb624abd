"""Real single-process QLoRA runs on the builtin tiny model (CPU, bitsandbytes' CPU backend)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from finetune import recipe as R
from finetune.train.loop import train

from ..conftest import run_cli
from .procs import trained_steps

pytestmark = pytest.mark.slow


def tiny(tmp_path, name="run", **sections):
    base = {
        "model": {"gradient_checkpointing": False},
        "data": {"eval_sources": [{"path": "builtin:tiny-instruct", "split": "eval"}], "max_seq_len": 64,
                 "max_samples": 256, "prompt_template": "raw"},  # the layout the tiny base knows, as its recipes
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 8, "max_steps": 4, "learning_rate": 3e-3, "log_every": 1},
        "eval": {"max_batches": 2},
        "output": {"dir": str(tmp_path / name), "progress_bar": False},
    }
    for sec, vals in sections.items():
        base.setdefault(sec, {}).update(vals)
    return R.from_dict(base)


def losses(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def adapter(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_the_first_loss_is_the_bases_token_loss_and_falls(tmp_path):
    """Step 1's logged loss is the untrained model's mean cross-entropy over the step's trained tokens (a fresh
    adapter changes nothing: lora_B is zero), recomputed here with transformers' own loss, one row at a time;
    then the loss falls. 8 rows and micro-batch 8: step 1 is every row."""
    from finetune.data import encode
    from finetune.data.prepare import prepare
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer

    # bf16 named: on a CPU without native bf16 the default would be fp32 compute (train/precision.py).
    r = tiny(tmp_path, data={"max_samples": 8}, train={"max_steps": 6, "mixed_precision": "bf16"})
    train(r, tmp_path / "run")
    got = losses(tmp_path / "run")
    rows = prepare(r.data, load_tokenizer(r.model)).train
    assert len(rows) == r.train.micro_batch_size
    base = load_model(r.model, r.quantization, quiet=True).eval()
    total = count = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for e in rows:
            ids, labels = torch.tensor([e["input_ids"]]), torch.tensor([e["labels"]])
            n = int((labels[:, 1:] != encode.IGNORE).sum())
            total, count = total + float(base(input_ids=ids, labels=labels).loss) * n, count + n
    assert got[0] == pytest.approx(total / count, rel=2e-3), (got[0], total / count)
    assert min(got[1:]) < got[0] - 0.2


def test_trainable_params_change_and_frozen_do_not(tmp_path):
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    r = tiny(tmp_path)
    fresh = apply_lora(load_model(r.model, r.quantization), r.lora, seed=r.train.seed)
    trained = train(r, tmp_path / "run", return_model=True)["model"]
    before = dict(fresh.named_parameters())
    n_trainable = n_frozen = 0
    for name, p in trained.named_parameters():
        # Compare raw bytes: packed 4-bit storage viewed as floats can hold NaNs.
        same = torch.equal(p.detach().view(torch.uint8), before[name].detach().view(torch.uint8))
        if p.requires_grad:
            n_trainable += 1
            assert "lora_" in name and not same, name
        else:
            n_frozen += 1
            assert same, name
    assert n_trainable == 4 * 7 * 2 and n_frozen > 0
    assert set(adapter(tmp_path / "run")) == {k.replace(".default", "") for k, p in trained.named_parameters()
                                              if p.requires_grad}


STRICT = {"mixed_precision": "no", "optimizer": "adamw_torch", "adam_epsilon": 1.0}
DEFAULT = {"mixed_precision": "bf16"}  # the GPU default, named: a CPU without native bf16 would compute in fp32


@pytest.mark.parametrize("settings,rel", [
    # fp32 everywhere and a large Adam epsilon (updates linear in the gradient, like SGD): any difference in
    # the accumulated gradient shows up; Adam's near-sign updates would otherwise amplify rounding noise.
    (STRICT, 1e-5),
    # The default: bf16 matmuls of other shapes and 8-bit state quantisation, equal to rounding.
    (DEFAULT, 1e-2),
], ids=["fp32-strict", "default"])
def test_micro_batch_times_accumulation_is_invariant(tmp_path, settings, rel):
    q = {"compute_dtype": "float32"} if settings is STRICT else {}
    a = tiny(tmp_path, "a", quantization=q, train={"micro_batch_size": 8, "gradient_accumulation_steps": 1,
                                                    **settings})
    b = tiny(tmp_path, "b", quantization=q, train={"micro_batch_size": 4, "gradient_accumulation_steps": 2,
                                                    **settings})
    train(a, tmp_path / "a")
    train(b, tmp_path / "b")
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la[0] == pytest.approx(lb[0], rel=1e-6)  # identical weights, identical tokens
    assert la == pytest.approx(lb, rel=rel)
    if settings is STRICT:  # adapters too; in the default setting 8-bit state rounds a few elements apart
        wa, wb = adapter(tmp_path / "a"), adapter(tmp_path / "b")
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def test_quantized_layers_are_really_4bit(tmp_path):
    import bitsandbytes as bnb

    from finetune.weights.bnb import quantized_bytes_per_param
    from finetune.weights.load.model import load_model

    r = tiny(tmp_path)
    m = load_model(r.model, r.quantization)
    layers = [x for x in m.modules() if isinstance(x, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7  # q k v o gate up down in each of 4 layers
    assert quantized_bytes_per_param(m) == pytest.approx(0.5, rel=0.01)
    assert layers[0].weight.quant_state.quant_type == "nf4" and layers[0].weight.quant_state.nested


def test_adapter_loads_in_plain_peft_and_changes_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.weights.load.resolve import resolve_name

    train(tiny(tmp_path, train={"max_steps": 8}), tmp_path / "run")
    cfg = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    # The adapter names its base portably (builtin:tiny-llama); finetune says where that lives on this machine.
    base = AutoModelForCausalLM.from_pretrained(resolve_name(cfg["base_model_name_or_path"]))
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "adapter")
    ids = tok("reverse: red cat blue\n", return_tensors="pt")
    with torch.no_grad():
        before = base(**ids).logits
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter"))
        after = peft_model(**ids).logits
    assert (after - before).abs().max() > 1e-2


def test_resume_ends_with_the_same_adapter(tmp_path, capsys):
    """A run that crashed after its step-3 checkpoint, run again, resumes: it says so, trains steps 4-6 only,
    from the checkpoint's state (step 4's learning rate and loss are the uninterrupted run's: the schedule,
    the adapter and the data position were restored) and ends with the uninterrupted run's adapter (the
    optimizer's moments too)."""
    import shutil

    full = tiny(tmp_path, "full", train={"max_steps": 6, "save_every": 3})
    train(full, tmp_path / "full")
    # As a crash after step 3 leaves the same run: the later checkpoint and the final adapter never written.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-6")
    shutil.rmtree(part / "adapter")
    capsys.readouterr()
    train(tiny(tmp_path, "part", train={"max_steps": 6, "save_every": 3}), part)
    out = capsys.readouterr().out
    assert f"resume: from {part / 'checkpoints' / 'step-3'} (step 3)" in out, out[-2000:]
    assert trained_steps(out) == [4, 5, 6], out[-2000:]  # resumed, not restarted
    rows = {name: {r["step"]: r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                   if "loss" in r} for name in ("full", "part")}
    assert sorted(rows["part"]) == [1, 2, 3, 4, 5, 6]
    assert rows["part"][4]["lr"] == rows["full"][4]["lr"] != rows["full"][1]["lr"]
    assert rows["part"][4]["loss"] == pytest.approx(rows["full"][4]["loss"], rel=1e-6)
    wa, wb = adapter(tmp_path / "full"), adapter(part)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7)


def test_cli_overrides_and_bad_input(tmp_path):
    out = tmp_path / "x"
    p = run_cli(["recipes/tiny_cpu.yaml", "train.max_steps=2", "train.warmup_steps=0", f"output.dir={out}",
                 "data.max_samples=64",
                 "output.progress_bar=false"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(losses(out)) >= 1 and json.loads((out / "metrics.jsonl").read_text().splitlines()[-2])["step"] == 2
    assert R.load(out / "recipe.yaml").train.max_steps == 2
    # A first run's output holds no library warning the user cannot act on (train and eval, as the README runs them).
    ev = run_cli(["eval", str(out), "--json"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    # Nothing at all on stderr: a library notice need not say "Warning" (bitsandbytes' "Failed to load CPU
    # gemm_4bit_forward from kernels-community" on CPUs with AVX512-BF16 did not).
    for text in (p.stderr, ev.stderr):
        assert text.strip() == "", text[-2000:]
    bad = tmp_path / "bad.yaml"
    cases = {
        "missing": (["does/not/exist.yaml"], "no such file"),
        "broken": (["BROKEN"], "invalid YAML"),
        "empty": (["EMPTY"], "empty"),
        "misspelt": (["recipes/tiny_cpu.yaml", "train.max_stesp=3"], "did you mean 'max_steps'"),
        "section": (["UNKNOWN"], "unknown section"),
        "type": (["recipes/tiny_cpu.yaml", "train.micro_batch_size=lots"], "train.micro_batch_size"),
    }
    texts = {"BROKEN": "model: {name: [\n", "EMPTY": "", "UNKNOWN": "modle:\n  name: x\n"}
    for name, (args, needle) in cases.items():
        if args[0] in texts:
            bad.write_text(texts[args[0]])
            args = [str(bad)] + args[1:]
        p = run_cli(args)
        assert p.returncode == 2, (name, p.stderr)
        assert needle in p.stderr, (name, p.stderr)
        assert "Traceback" not in p.stderr, name


def test_gradient_checkpointing_recomputes_the_same_training(tmp_path, capsys):
    """Checkpointing recomputes each layer in backward, attention included: on CPU in bf16 the loop holds
    the math kernel over backward too (train.loss.batch_kernels), so the recomputation matches the forward and
    training is the same as without checkpointing."""
    runs = {}
    for ck in (False, True):
        r = tiny(tmp_path, name=f"ck-{ck}", model={"gradient_checkpointing": ck},
                 train={"max_steps": 3, "mixed_precision": "bf16"})
        train(r, tmp_path / f"ck-{ck}")
        runs[ck] = (losses(tmp_path / f"ck-{ck}"), adapter(tmp_path / f"ck-{ck}"))
    assert "math kernel" in capsys.readouterr().out  # the CPU bf16 kernel choice was in force
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-4)
    for k, v in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], v, rtol=1e-3, atol=1e-5)


def test_one_device_read_per_optimizer_step(tmp_path, monkeypatch):
    """On a GPU every read of a device value waits for the queue to drain. The step keeps its loss on the
    device and reads it with the gradient norm once, at the end; the stop flag and the token count are host
    values (tests/integration/test_signals.py and test_distributed_faults.py keep the stop latency at one
    micro-batch). Counted here as the tensor-to-Python conversions made by step.py and stop.py themselves."""
    import sys as _sys

    counted = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, _name=name, **k):
            caller = _sys._getframe(1).f_code.co_filename
            if caller.endswith(("finetune/train/step.py", "finetune/train/stop.py")):
                counted.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    steps = 3
    train(tiny(tmp_path, train={"max_steps": steps, "gradient_accumulation_steps": 4, "micro_batch_size": 2,
                                "max_grad_norm": 1.0}), tmp_path / "run")
    assert counted == ["tolist"] * steps, counted
