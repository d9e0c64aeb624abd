"""The tokenizer and adapter files finetune writes are in the form transformers 4 and 5 both read
(artefacts/tokenizer.py and artefacts/adapter.py): the written fields, and transformers 5 reloading them with identical token ids.
(The transformers 4.57 load itself: tests/integration/test_export_gguf.py and scripts/check_tf4_tokenizer.sh.)"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from finetune import cli
from finetune.gguf.readback import unpermute
from finetune.artefacts.adapter import base_reference
from finetune.artefacts.tokenizer import adds_bos_eos, save_tokenizer
from finetune.util.builtin import builtin_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tokenizer_ids", ROOT / "scripts" / "tokenizer_ids.py")
tokenizer_ids = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tokenizer_ids)


@pytest.fixture(scope="module")
def builtin_tok():
    return AutoTokenizer.from_pretrained(builtin_dir("builtin:tiny-llama"))


def _written(tok, out: Path) -> dict:
    save_tokenizer(tok, out)
    return json.loads((out / "tokenizer_config.json").read_text())


def test_written_config_has_the_portable_fields(builtin_tok, tmp_path):
    cfg = _written(builtin_tok, tmp_path)
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # not transformers 5's TokenizersBackend
    assert "extra_special_tokens" not in cfg  # the list form 4.57 cannot read
    assert cfg["additional_special_tokens"] == ["<|system|>", "<|user|>", "<|assistant|>"]
    # The builtin's post-processor adds nothing: training never saw a BOS, and the file says so.
    assert builtin_tok("a b")["input_ids"][0] != builtin_tok.bos_token_id
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert cfg["chat_template"] == (tmp_path / "chat_template.jinja").read_text() == builtin_tok.chat_template
    assert not {"is_local", "local_files_only"} & set(cfg)


def test_transformers_5_reloads_with_identical_ids(builtin_tok, tmp_path):
    save_tokenizer(builtin_tok, tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for s in tokenizer_ids.probe_strings():
        assert again(s)["input_ids"] == builtin_tok(s)["input_ids"], s
        assert again.decode(again(s)["input_ids"]) == builtin_tok.decode(builtin_tok(s)["input_ids"])
    for conv in tokenizer_ids.CONVERSATIONS:
        assert (again.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                == builtin_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))
    assert again.all_special_tokens == builtin_tok.all_special_tokens
    assert again.extra_special_tokens == builtin_tok.extra_special_tokens


def test_a_tokenizer_that_adds_bos_says_so_and_keeps_doing_it(builtin_tok, tmp_path):
    from tokenizers import processors

    tok = AutoTokenizer.from_pretrained(builtin_dir("builtin:tiny-llama"))
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
    assert adds_bos_eos(tok) == (True, False)
    cfg = _written(tok, tmp_path)
    assert cfg["add_bos_token"] is True
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("a b")["input_ids"] == tok("a b")["input_ids"] == [tok.bos_token_id] + builtin_tok("a b")["input_ids"]


@pytest.mark.parametrize("name,loaded,want", [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", ("meta-llama/Llama-3.1-8B", None)),
    ("builtin:tiny-llama", "/home/u/.cache/finetune/tiny-llama-v4", ("builtin:tiny-llama", None)),
    ("synthetic:llama3_8b?layers=2", "/x/synthetic-v1-abc", ("synthetic:llama3_8b?layers=2", None)),
    ("/hf/hub/models--Qwen--Qwen2.5-7B/snapshots/" + "a" * 40, None, ("Qwen/Qwen2.5-7B", "a" * 40)),
])
def test_base_reference_is_portable(name, loaded, want):
    assert base_reference(name, loaded) == want


def test_a_local_base_is_never_written_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "my-base").mkdir()
    assert base_reference(str(tmp_path / "my-base"), str(tmp_path / "my-base")) == ("my-base", None)
    monkeypatch.chdir(tmp_path)
    assert base_reference("my-base", str(tmp_path / "my-base")) == ("my-base", None)


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp's LlamaModel.permute (conversion/llama.py), written out
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 64, 32)
    assert not torch.equal(permute(w, 4), w)
    assert torch.equal(unpermute(permute(w, 4), 4), w)


def test_export_without_the_converter_is_exit_2_with_the_fetch_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FINETUNE_LLAMA_CPP_CONVERTER", str(tmp_path / "none"))
    assert cli.main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "python -m finetune.gguf.converter --fetch" in err and "Traceback" not in err


@pytest.mark.parametrize("cfg,want", [({"r": 16}, 16), ({"r": 12}, 16), ({"r": 4}, 8),
                                      ({"r": 16, "rank_pattern": {"q_proj": 48}}, 64), ({"r": 300}, 320)])
def test_card_states_the_vllm_max_lora_rank_the_adapter_needs(cfg, want):
    from finetune.merge.card import vllm_max_lora_rank

    assert vllm_max_lora_rank(cfg) == want
