"""`finetune merge` on the tiny model: parity with plain peft, the nf4 target, FSDP/QLoRA-style adapters,
multi-shard output, refusal of unsupported adapters, and crash safety."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from finetune import cli
from finetune.merge import stream as merge_mod
from finetune.merge.check import check_prompts, parity_check
from finetune.merge.source import four_bit_weights, resolve_source
from finetune.merge.stream import merge

pytestmark = pytest.mark.slow


def _peft(run, four_bit=False):
    from peft import PeftModel

    kw = {}
    if four_bit:  # as the fixture's training setup: nf4, double quant, fp32 storage
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    src = resolve_source(run)
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src.base_dir, dtype=torch.float32, **kw),
                                     src.adapter_dir)


def _logits(model, tok, prompts):
    with torch.no_grad():
        return [model(**tok(p, return_tensors="pt")).logits[0].float() for p in prompts]


def _rel(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / max(w.abs().max().item() for w in want)


def _greedy(model, tok, prompts, n=12):
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_merged_model_matches_plain_peft(tiny_run, tmp_path, dtype, tol):
    out = merge(tiny_run, output=tmp_path / "m", dtype=dtype)
    tok = AutoTokenizer.from_pretrained(out)  # plain transformers, nothing of ours
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ref = _peft(tiny_run).eval()
    prompts = check_prompts(resolve_source(tiny_run))
    assert _rel(_logits(merged.float(), tok, prompts), _logits(ref, tok, prompts)) < tol
    base = AutoModelForCausalLM.from_pretrained(resolve_source(tiny_run).base_dir).eval()
    assert _rel(_logits(base, tok, prompts), _logits(ref, tok, prompts)) > 0.1  # the merge was not a no-op
    if dtype == "fp32":  # bf16 rounding may flip near-ties of this random model's flat distribution
        assert _greedy(merged, tok, prompts) == _greedy(ref, tok, prompts)
    info = json.loads((out / "merge_info.json").read_text())
    assert info["parity"]["status"] == "passed" and info["stats"]["merged_weights"] == 28
    assert "**passed**" in (out / "README.md").read_text()


def test_nf4_target_reproduces_the_4bit_model_and_adapter(qlora_run, tmp_path):
    """An adapter saved by plain peft from a 4-bit model (what FSDP/QLoRA runs write) merges in one CPU
    process; merged into the NF4-dequantized weights it computes what base(4-bit) + adapter computed."""
    assert cli.main(["merge", str(qlora_run), "--output", str(tmp_path / "nf4"), "--target", "nf4", "--dtype", "fp32"]) == 0
    assert cli.main(["merge", str(qlora_run), "--output", str(tmp_path / "orig"), "--dtype", "fp32"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "nf4")
    prompts = check_prompts(resolve_source(qlora_run))
    # train() mode: bitsandbytes' eval-mode CPU kernel computes in bf16; training dequantizes and matmuls
    # in the compute dtype, and the fixture's LoRA has no dropout, so train() is a deterministic forward.
    want = _logits(_peft(qlora_run, four_bit=True).train(), tok, prompts)
    nf4 = _rel(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "nf4").eval(), tok, prompts), want)
    orig = _rel(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "orig").eval(), tok, prompts), want)
    assert nf4 < 1e-5  # tighter than any bf16 tolerance: the same weights, only summed in another order
    assert orig > 100 * nf4  # the original target carries the quantization error the adapter trained on


def test_four_bit_weights_and_roundtrip_match_bitsandbytes_loader(tiny_run):
    src = resolve_source(tiny_run)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(src.base_dir, quantization_config=cfg, dtype=torch.bfloat16)
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from safetensors import safe_open

    from finetune.merge.plan import QuantSpec, quant_roundtrip

    loaded = {n + ".weight": m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert four_bit_weights(src.base_dir) == set(loaded)
    name = "model.layers.2.self_attn.k_proj.weight"
    with safe_open(str(src.base_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name)
    p = loaded[name].weight
    assert torch.equal(quant_roundtrip(w, QuantSpec(dtype=torch.bfloat16)), bnbf.dequantize_4bit(p.data, p.quant_state))


def test_multi_shard_output_plain_adapter_dir_and_layer_check(tiny_run, tmp_path):
    one = merge(tiny_run, output=tmp_path / "one", dtype="fp32", check=False)
    many = merge(tiny_run / "adapter", output=tmp_path / "many", dtype="fp32", max_shard_size="1MB", check=False)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(many.glob("model-*-of-*.safetensors"))) > 5
    a = AutoModelForCausalLM.from_pretrained(one).state_dict()
    b = AutoModelForCausalLM.from_pretrained(many).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the big-model policy: per-layer check against peft's LoRA layer, on the written shards
    src = resolve_source(tiny_run)
    res = parity_check(src, many, "original", full_limit_bytes=0)
    assert res["kind"] == "layer" and res["status"] == "passed", res
    from safetensors.torch import load_file, save_file

    name = "model.layers.0.mlp.down_proj.weight"  # the first LoRA pair in order: always among those checked
    shard = many / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name] + 0.05 * tensors[name].abs().max()
    save_file(tensors, shard, metadata={"format": "pt"})
    assert parity_check(src, many, "original", full_limit_bytes=0)["status"] == "failed"


def test_failed_check_leaves_nothing_and_detects_a_wrong_scale(tiny_run, tmp_path, monkeypatch):
    real = merge_mod.lora_delta
    monkeypatch.setattr(merge_mod, "lora_delta", lambda a, b, s: real(a, b, 2 * s))  # a scaling bug
    out = tmp_path / "bad"
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--max-shard-size", "2MB"]) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no output, no temp dir left


def test_output_safety_and_idempotence(tiny_run, tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check", "--force"]) == 2
    assert "not written by finetune merge" in capsys.readouterr().err and (out / "notes.txt").exists()
    (out / "notes.txt").unlink()  # an empty directory may be written into
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check"]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check"]) == 0  # same inputs: up to date
    assert "up to date" in capsys.readouterr().out
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check", "--force"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # byte-identical re-run
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check", "--dtype", "fp32"]) == 2  # different merge
    assert "--force" in capsys.readouterr().err


def test_default_output_is_run_dir_merged(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    assert cli.main(["merge", str(run), "--no-check"]) == 0
    assert (run / "merged" / "model.safetensors").is_file()


def test_unsupported_adapters_are_refused(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    assert cli.main(["merge", str(run), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert "modules_to_save" in err and "Traceback" not in err and not (run / "merged").exists()
    # DoRA merges (test_adapter_methods.py), but a config that says DoRA over tensors without magnitudes
    # would merge as plain LoRA, silently wrong: refused.
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    assert cli.main(["merge", str(run), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert "DoRA magnitude" in err and "Traceback" not in err and not (run / "merged").exists()
    assert cli.main(["merge", str(tmp_path / "nowhere")]) == 2


def test_rslora_scaling_matches_peft(tmp_path):
    from .conftest import make_run_dir

    run = make_run_dir(tmp_path, recipe={"lora": {"r": 8, "alpha": 16}}, lora_kwargs={"use_rslora": True})
    out = merge(run, output=tmp_path / "m", dtype="fp32")
    info = json.loads((out / "merge_info.json").read_text())
    assert info["stats"]["scales"] == [16 / 8 ** 0.5] and info["parity"]["rel_diff"] < 1e-5
