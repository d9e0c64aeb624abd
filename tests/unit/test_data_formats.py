"""Token-level checks per format: the trained tokens (labels != -100, past token 0) are exactly the
completion / assistant spans, multi-turn included; train_on_inputs trains everything."""
import pytest

from finetune.data import encode as E
from finetune.data.chat import chat_examples
from finetune.recipe import DataSpec

RAW = DataSpec(prompt_template="raw")  # the plain layout these tests check (the default renders through the template)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from finetune.util import builtin as tiny

    return AutoTokenizer.from_pretrained(tiny.ASSETS / f"tiny-llama-{tiny.VERSION}")


def spans(tok, ex):
    """Decoded runs of trained tokens, in order."""
    out, cur = [], []
    for i, (t, lab) in enumerate(zip(ex["input_ids"], ex["labels"])):
        if lab != E.IGNORE and i > 0:
            assert lab == t  # a trained label is the token itself (the loss shifts it)
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first: red cat"},
        {"role": "assistant", "content": "red"}, {"role": "user", "content": "last: red cat"},
        {"role": "assistant", "content": "cat dog"}]


def test_text_trains_every_token(tok):
    ex = E.encode({"text": "red cat sun"}, "auto", tok, DataSpec())
    assert ex["labels"] == ex["input_ids"]
    assert tok.decode(ex["input_ids"]) == "red cat sun<|end|>"


def test_prompt_completion_trains_the_completion_and_eos_only(tok):
    ex = E.encode({"prompt": "reverse: red cat\n", "completion": "cat red"}, "prompt_completion", tok, RAW)
    assert spans(tok, ex) == ["cat red<|end|>"]
    assert tok.decode(ex["input_ids"]) == "reverse: red cat\ncat red<|end|>"


def test_instruction_trains_the_output_with_or_without_input(tok):
    ex = E.encode({"instruction": "reverse", "input": "red cat", "output": "cat red"}, "auto", tok, RAW)
    assert tok.decode(ex["input_ids"]) == "reverse\nred cat\ncat red<|end|>"
    assert spans(tok, ex) == ["cat red<|end|>"]
    ex = E.encode({"instruction": "say red", "output": "red"}, "instruction", tok, RAW)
    assert spans(tok, ex) == ["red<|end|>"]


def test_messages_train_every_assistant_turn_and_nothing_else(tok):
    ex = E.encode({"messages": CHAT}, "auto", tok, DataSpec())
    assert tok.decode(ex["input_ids"]).startswith("<|system|>\nbe brief\n<|user|>\nfirst: red cat\n<|assistant|>\n")
    assert spans(tok, ex) == ["red<|end|>\n", "cat dog<|end|>\n"]


def test_sharegpt_conversations_map_roles_like_messages(tok):
    conv = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "first: red cat"},
            {"from": "gpt", "value": "red"}, {"from": "human", "value": "last: red cat"},
            {"from": "gpt", "value": "cat dog"}]
    a = E.encode({"conversations": conv}, "auto", tok, DataSpec())
    b = E.encode({"messages": CHAT}, "auto", tok, DataSpec())
    assert a == b


def test_conversational_prompt_completion_trains_the_completion_messages(tok):
    row = {"prompt": CHAT[:4], "completion": CHAT[4:]}
    ex = E.encode(row, "auto", tok, DataSpec())
    assert spans(tok, ex) == ["cat dog<|end|>\n"]  # the earlier assistant turn is context here


def test_train_on_inputs_trains_the_whole_chat(tok):
    ex = E.encode({"messages": CHAT}, "auto", tok, DataSpec(train_on_inputs=True))
    assert ex["labels"] == ex["input_ids"]
    ex = E.encode({"prompt": "sort: b a\n", "completion": "a b"}, "auto", tok, DataSpec(train_on_inputs=True))
    assert ex["labels"] == ex["input_ids"]


def test_recipe_chatml_template_overrides_the_tokenizer_one(tok):
    ex = E.encode({"messages": CHAT[1:3]}, "auto", tok, DataSpec(chat_template="chatml"))
    assert tok.decode(ex["input_ids"]) == ("<|im_start|>user\nfirst: red cat<|im_end|>\n"
                                           "<|im_start|>assistant\nred<|im_end|>\n")
    assert spans(tok, ex) == ["red<|im_end|>\n"]


def test_generation_markers_decide_the_trained_tokens(tok):
    # A template that marks only the content + end token (not the trailing newline) as generated.
    tpl = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{% if m['role'] == 'assistant' %}"
           "{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}{% else %}{{ m['content'] }}"
           "{% endif %}{{ '\\n' }}{% endfor %}")
    ex = E.encode({"messages": CHAT}, "auto", tok, DataSpec(chat_template=tpl))
    assert spans(tok, ex) == ["red<|end|>", "cat dog<|end|>"]


def test_template_that_does_not_render_a_turn_after_its_prompt_is_a_row_error(tok):
    # Renders the last message first: the chat before a turn is not the start of the chat through it, so no
    # rendering trains the turn as inference would prompt for it (history rewriting is fine: test_data_tools).
    tpl = "{% for m in messages|reverse %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix"):
        E.encode({"messages": CHAT}, "auto", tok, DataSpec(chat_template=tpl))


def test_chat_without_any_template_says_so(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        chat_examples(NoTemplate(), CHAT, None, None, False)


def test_a_chat_opening_with_the_assistant_trains_its_reply_not_the_header(tok):
    ex = E.encode({"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "red"}]}, "auto", tok, DataSpec())
    assert spans(tok, ex) == ["hello<|end|>\n", "red<|end|>\n"]
