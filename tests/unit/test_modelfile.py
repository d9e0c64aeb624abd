"""gguf/modelfile.py: the Ollama TEMPLATE translated from a chat template renders (through a Go-template-subset
renderer, tests/gotemplate.py) exactly what the Jinja template renders; templates that do not decompose get no
TEMPLATE and a comment saying why."""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.data.encode import CHATML, render_chat
from finetune.gguf.modelfile import Untranslatable, modelfile_text, translate
from finetune.util.builtin import builtin_dir
from tests.gotemplate import render

LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATS = ([{"role": "user", "content": "reverse the words: a b c"}, {"role": "assistant", "content": "c b a"},
          {"role": "user", "content": "and: x y"}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "one\ntwo"}])


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(builtin_dir("builtin:tiny-llama"))


@pytest.mark.parametrize("name", ["builtin", "chatml", "llama3"])
def test_translated_template_renders_as_jinja(tok, name):
    template = {"builtin": tok.chat_template, "chatml": CHATML, "llama3": LLAMA3}[name]
    go = translate(tok, template)
    for chat in CHATS:
        assert render(go, chat) == render_chat(tok, chat, template, gen=True)


def test_builtin_template_text(tok):
    assert translate(tok, tok.chat_template) == (
        '{{ range .Messages }}{{ if eq .Role "user" }}<|user|>\n{{ .Content }}\n'
        '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}<|end|>\n'
        '{{ else if eq .Role "system" }}<|system|>\n{{ .Content }}\n{{ end }}{{ end }}<|assistant|>\n')


def test_bos_is_left_to_llama_cpp_when_the_tokenizer_adds_it(tok):
    class AddsBos:  # the tiny tokenizer, as a Llama 3 tokenizer behaves: a BOS before every encoding
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kw):
            return {"input_ids": [tok.bos_token_id] + tok(text, **kw)["input_ids"]}

    assert translate(tok, LLAMA3).startswith("<|bos|>{{ range")
    assert translate(AddsBos(), LLAMA3).startswith("{{ range")


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
     "{{ m.content }}{% endfor %}", "does not render a system, user, assistant conversation"),
    ("{% if messages[0].role != 'system' %}You are helpful.\n{% endif %}"
     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}", "system turn changes what comes before"),
    ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | upper }}\n{% endfor %}", "do not compose"),
    ("{% for m in messages %}[{{ loop.index }}] {{ m.content }}\n{% endfor %}", "differently by position"),
    ("{% for m in messages %}{{ '{{' }}{{ m.content }}\n{% endfor %}", "cannot hold"),
])
def test_untranslatable_templates_say_why(tok, template, why):
    with pytest.raises(Untranslatable, match=why):
        translate(tok, template)
    text = modelfile_text(Path("/r/gguf/model-f16.gguf"), tok, template, ["<|end|>"])
    assert not any(line.startswith("TEMPLATE") for line in text.splitlines())
    assert "# No TEMPLATE: " in text and why in text
    assert "FROM ./model-f16.gguf\n" in text and 'PARAMETER stop "<|end|>"\n' in text


def test_write_modelfile_never_replaces_a_foreign_file(tmp_path):
    from finetune.gguf.modelfile import write_modelfile
    from finetune.util.errors import RecipeError

    model = Path(builtin_dir("builtin:tiny-llama"))
    mine = tmp_path / "m.Modelfile"
    mine.write_text("FROM llama3\nSYSTEM my own\n")
    with pytest.raises(RecipeError, match="is not a Modelfile export wrote"):
        write_modelfile(tmp_path / "m.gguf", tmp_path, model)
    assert mine.read_text() == "FROM llama3\nSYSTEM my own\n"
    mine.unlink()
    for _ in range(2):  # its own earlier Modelfile is replaced
        assert write_modelfile(tmp_path / "m.gguf", tmp_path, model) == mine
    assert mine.read_text().startswith("# Ollama Modelfile for m.gguf") and "FROM ./m.gguf\n" in mine.read_text()
