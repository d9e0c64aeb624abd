"""Artifacts other clients load, on one real tiny training run (shared by every test here):
- the adapter and merged tokenizer/adapter files are portable (artefacts/tokenizer.py and artefacts/adapter.py), and transformers 4.57 reads
  them with the same token ids as the pinned 5.x (only where scripts/check_tf4_tokenizer.sh built its venv);
- `finetune export --format gguf` with llama.cpp's own converter (only where scripts/setup.sh fetched it):
  tensors read back equal the merged weights (f32 exactly, f16 to rounding, q8_0 within its step), the LoRA-only
  GGUF equals the adapter, and with llama-cpp-python installed llama.cpp's greedy outputs equal transformers'.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from finetune import cli
from finetune import recipe as R
from finetune.gguf import converter
from finetune.gguf.write import PRE_TOKENIZERS
from finetune.util.builtin import builtin_dir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TF4_VENV = Path(os.environ.get("FINETUNE_TF4_VENV", Path.home() / ".cache" / "finetune" / "tf4-venv"))
needs_converter = pytest.mark.skipif(
    not (converter.converter_dir() / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp's converter is not fetched ({converter.converter_dir()}); `{converter.FETCH_COMMAND}`")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from finetune.train.loop import train

    out = tmp_path_factory.mktemp("export") / "run"
    recipe = R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"eval_sources": [{"path": "builtin:tiny-instruct", "split": "eval"}], "max_seq_len": 64,
                 "max_samples": 128},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 8, "max_steps": 4, "learning_rate": 3e-3, "log_every": 1},
        "eval": {"max_batches": 1},
        "output": {"dir": str(out), "progress_bar": False}})
    train(recipe, out)
    return out


@pytest.fixture(scope="module")
def merged(run):
    from finetune.merge.stream import merge

    return merge(run)


def test_trained_adapter_and_merge_write_portable_files(run, merged):
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "builtin:tiny-llama"  # not this machine's cache path
    builtin = AutoTokenizer.from_pretrained(builtin_dir("builtin:tiny-llama"))
    for d in (run / "adapter", merged):
        tc = json.loads((d / "tokenizer_config.json").read_text())
        assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["add_bos_token"] is False
        assert isinstance(tc["additional_special_tokens"], list) and "extra_special_tokens" not in tc
        assert tc["chat_template"] == (d / "chat_template.jinja").read_text()
        tok = AutoTokenizer.from_pretrained(d)
        for s in ("reverse the words: a b c", "<|user|>\nhi<|end|>\n<|assistant|>\n", "héllo 🦙 33"):
            assert tok(s)["input_ids"] == builtin(s)["input_ids"]


@pytest.mark.skipif(not (TF4_VENV / "bin" / "python").is_file(),
                    reason=f"no transformers 4.57 venv at {TF4_VENV}: bash scripts/check_tf4_tokenizer.sh builds it")
def test_transformers_4_reads_adapter_and_merged_tokenizers_with_the_same_ids(run, merged):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tokenizer_ids.py"), "--compare",
                           str(TF4_VENV / "bin" / "python"), str(run / "adapter"), str(merged)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 2 and "vs 4.57" in proc.stdout


def _gguf_fields(path: Path) -> dict:
    from finetune.gguf.readback import gguf_module

    reader = gguf_module(converter.converter_dir()).GGUFReader(str(path))
    keys = ("tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token", "general.architecture")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


@needs_converter
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_export_gguf_tensors_equal_the_merged_weights(run, merged, outtype, capsys):
    assert cli.main(["export", str(run), "--outtype", outtype, "--greedy-prompts", "0"]) == 0
    assert "tensors equal their source" in capsys.readouterr().out
    out = run / "gguf" / f"model-{outtype}.gguf"
    report = json.loads(out.with_name(out.name + ".json").read_text())
    t = report["tensors"]
    assert t["mismatched"] == [] and t["checked"] == t["tensors"] == 39  # 4 layers x 9 + embed, norm, head
    if outtype == "f32":
        assert t["max_abs_diff"] == {"F32": 0.0}
    assert set(t["types"]) == {"F32", {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[outtype]}
    fields = _gguf_fields(out)
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # registered for the builtin (gguf/write.py)
    assert fields["tokenizer.ggml.add_bos_token"] is False  # as training saw the prompts
    _check_modelfile(out, merged)


@needs_converter
def test_q4_k_m_without_llama_quantize_keeps_the_checked_f16_and_names_the_command(run, merged, monkeypatch, capsys):
    # No llama-quantize anywhere: the f16 GGUF is still written and checked, and exit 3 names the commands.
    from finetune.gguf import quantizer

    monkeypatch.setenv("FINETUNE_LLAMA_QUANTIZE", str(run / "no-such-binary"))
    assert quantizer.find() is None
    assert cli.main(["export", str(run), "--outtype", "q4_k_m", "--greedy-prompts", "0"]) == 3
    err = capsys.readouterr().err
    f16, q4 = run / "gguf" / "model-f16.gguf", run / "gguf" / "model-q4_k_m.gguf"
    assert f"wrote and checked {f16}" in err and quantizer.BUILD_COMMAND in err
    assert f"llama-quantize {f16} {q4} Q4_K_M" in err and "Traceback" not in err
    assert json.loads(f16.with_name(f16.name + ".json").read_text())["tensors"]["mismatched"] == []
    assert not q4.exists()


@needs_converter
@pytest.mark.skipif(__import__("finetune.gguf.quantizer", fromlist=["find"]).find() is None,
                    reason="no llama-quantize (python -m finetune.gguf.quantizer --build compiles one, ~25 min)")
def test_q4_k_m_through_llama_quantize_reads_back_within_its_bounds(run, merged, capsys):
    assert cli.main(["export", str(run), "--outtype", "q4_k_m", "--greedy-prompts", "0"]) == 0
    out = run / "gguf" / "model-q4_k_m.gguf"
    printed = capsys.readouterr().out
    assert "are within their type's error bound of their source" in printed, printed
    t = json.loads(out.with_name(out.name + ".json").read_text())["tensors"]
    assert t["mismatched"] == [] and t["checked"] == t["tensors"] == 39
    # The tiny model's 64-wide rows are too short for K blocks (256): llama-quantize falls back per tensor;
    # whatever it picked is 4 to 6 bits, and the norms stay F32.
    assert "F32" in t["types"] and set(t["types"]) - {"F32"} <= {"Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0",
                                                                 "Q5_1", "Q8_0"}, t["types"]
    assert out.stat().st_size < (run / "gguf" / "model-f16.gguf").stat().st_size / 2
    _check_modelfile(out, merged)


def _check_modelfile(gguf: Path, merged: Path):
    """The Ollama Modelfile beside the GGUF: FROM it, the stop token, and a TEMPLATE that renders a two-turn chat
    exactly as the run's Jinja template does (through tests/gotemplate.py, a Go-template-subset renderer)."""
    import re

    from finetune.data.encode import render_chat
    from tests.gotemplate import render

    text = gguf.with_suffix(".Modelfile").read_text()
    assert f"\nFROM ./{gguf.name}\n" in text and f"ollama create NAME -f {gguf.with_suffix('.Modelfile')}" in text
    assert re.findall(r"^PARAMETER stop (.*)$", text, re.M) == ['"<|end|>"']  # the builtin's eos ends its turns
    template = re.search(r'^TEMPLATE """(.*?)"""$', text, re.M | re.S)[1]
    tok = AutoTokenizer.from_pretrained(merged)
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "reverse the words: a b"},
            {"role": "assistant", "content": "b a"}, {"role": "user", "content": "and: x y z"}]
    assert render(template, chat) == render_chat(tok, chat, tok.chat_template, gen=True)


@needs_converter
def test_builtin_tokenizer_hash_is_the_registered_one(merged):
    sys.path[:0] = [str(converter.converter_dir()), str(converter.converter_dir() / "gguf-py")]
    try:
        from conversion.base import TextModel

        from finetune.gguf.llama_shim import chkhsh, probe_text
        h = chkhsh(AutoTokenizer.from_pretrained(merged), probe_text(TextModel.get_vocab_base_pre))
    finally:
        del sys.path[:2]
    assert PRE_TOKENIZERS.get(h) == "gpt-2"


@needs_converter
def test_export_adapter_only_equals_the_adapter(run):
    assert cli.main(["export", str(run), "--adapter-only", "--outtype", "f32"]) == 0
    assert not (run / "gguf" / "adapter-f32.Modelfile").exists()  # Ollama needs a base GGUF this export lacks
    report = json.loads((run / "gguf" / "adapter-f32.gguf.json").read_text())
    t = report["tensors"]
    assert t["mismatched"] == [] and t["checked"] == t["tensors"] == 4 * 7 * 2  # layers x modules x (A, B)
    assert t["max_abs_diff"] == {"F32": 0.0}


@needs_converter
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (compiles llama.cpp; see docs/deploy.md)")
def test_llama_cpp_greedy_outputs_equal_transformers(run, merged, tmp_path):
    from finetune.gguf.write import export_gguf

    res = export_gguf(run, "f32", output=str(tmp_path / "m.gguf"), greedy_prompts=20)
    g = res["greedy"]
    assert g["status"] == "passed" and g["prompts"] == 20, g


@needs_converter
def test_an_rslora_adapter_runs_in_llama_cpp_at_peft_s_scale_and_dora_is_refused(tmp_path, capsys):
    # rsLoRA scales by alpha/sqrt(r); llama.cpp by the GGUF's alpha / r. Written as it was, rank 16 ran 4x weak.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.gguf.readback import gguf_module, read_tensor
    from finetune.util import builtin as tiny
    from tests.integration.conftest import make_run_dir

    run = make_run_dir(tmp_path / "rs", lora_kwargs={"use_rslora": True})
    assert cli.main(["export", str(run), "--adapter-only", "--outtype", "f32", "--greedy-prompts", "0"]) == 0
    out = run / "gguf" / "adapter-f32.gguf"
    assert json.loads(out.with_name(out.name + ".json").read_text())["scaling"]["max_rel_diff"] < 1e-6
    gguf = gguf_module(converter.converter_dir())
    reader = gguf.GGUFReader(str(out))
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    t = {x.name: read_tensor(gguf, x) for x in reader.tensors}
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny.model_dir()), run / "adapter")
    for layer, hf, ll in ((0, "self_attn.v_proj", "attn_v"), (3, "mlp.down_proj", "ffn_down")):
        a, b = t[f"blk.{layer}.{ll}.weight.lora_a"], t[f"blk.{layer}.{ll}.weight.lora_b"]
        llama_cpp = alpha / a.shape[0] * (b @ a)  # what llama-adapter.cpp adds to the weight
        module = peft.get_submodule(f"base_model.model.model.layers.{layer}.{hf}")
        want = module.get_delta_weight("default")
        assert torch.allclose(llama_cpp, want, rtol=1e-5, atol=1e-7), (layer, hf)
    # DoRA's magnitudes: refused up front by the reason, nothing written (it used to end in the converter's log)
    dora = make_run_dir(tmp_path / "dora", lora_kwargs={"use_dora": True})
    capsys.readouterr()
    assert cli.main(["export", str(dora), "--adapter-only", "--greedy-prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert "DoRA (use_dora)" in err and "without --adapter-only" in err and "Traceback" not in err
    assert not (dora / "gguf" / "adapter-f16.gguf").exists()
