"""Chats in OpenAI's message format with tools, tool calls, tool results and reasoning: only the assistant
turns train, and every trained turn trains as inference renders it, for a template that rewrites history
(modelled on Qwen3's: reasoning only for the turns after the last user message) and for ones that do not."""
import json

import pytest

from finetune.data import encode as E
from finetune.data import formats as F
from finetune.data.chat import normalize
from finetune.recipe import DataSpec

from .test_data_formats import (
    spans,  # decoded runs of trained tokens; `tok` is conftest's
)

# Written for these tests after Qwen3's behaviour: tools listed in the system turn, tool calls as JSON in
# <call> tags, tool results inside a user turn, and <think> reasoning kept only after the last user message.
REWRITING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools or messages[0].role == 'system' -%}{{ '<|system|>\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content }}{%- endif -%}"
    "{%- for t in tools or [] -%}{{ '\\n<tool>' + (t | tojson) + '</tool>' }}{%- endfor -%}{{ '<|end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|user|>\\n' + m.content + '<|end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}{{ '<|user|>\\n<result>' + m.content + '</result><|end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>\\n' }}"
    "{%- if m.reasoning_content is string and loop.index0 > ns.last_user -%}"
    "{{ '<think>' + m.reasoning_content + '</think>\\n' }}{%- endif -%}"
    "{%- if m.content is string -%}{{ m.content }}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{ '<call>' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '</call>' }}"
    "{%- endfor -%}{{ '<|end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
KEEPING = REWRITING.replace(" and loop.index0 > ns.last_user", "")  # every turn keeps its reasoning

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "need the tool",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "sunny in Paris", "reasoning_content": "tool said sunny"},
    {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
    {"role": "assistant", "content": "no forecast", "reasoning": "no tool for that"},
]
ROW = {"messages": CONV, "tools": TOOLS}
CALL = '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'


def test_rewriting_template_trains_each_turn_as_inference_renders_it(tok):
    examples = E.encode_all(ROW, "auto", tok, DataSpec(chat_template=REWRITING))
    # The last user message drops the earlier turns' reasoning: those two turns train in an example of
    # their own, rendered as they were when each was the latest turn.
    assert len(examples) == 2
    first, last = examples
    assert spans(tok, first) == [f"<think>need the tool</think>\n{CALL}<|end|>\n",
                                 "<think>tool said sunny</think>\nsunny in Paris<|end|>\n"]
    assert spans(tok, last) == ["<think>no tool for that</think>\nno forecast<|end|>\n"]
    text = tok.decode(last["input_ids"])
    assert "need the tool" not in text and "tool said sunny" not in text  # history as inference renders it
    assert "<result>sunny</result>" in text and "get_weather" in text.split("<|user|>")[0]  # tools in the prompt
    assert [(e["turns"], e["check"]) for e in examples] == [(2, ""), (1, "")]
    # Independently of the encoder: the tokens before the last turn's trained span are what
    # apply_chat_template gives inference for the conversation so far (messages as a server passes them:
    # text parts joined, arguments parsed).
    prompt = tok.apply_chat_template(normalize(CONV[:6]), tools=TOOLS, chat_template=REWRITING,
                                     add_generation_prompt=True, return_dict=False)
    start = next(i for i, lab in enumerate(last["labels"]) if lab != E.IGNORE)
    assert last["input_ids"][:start] == prompt


def test_template_that_keeps_history_trains_the_row_as_one_example(tok):
    [ex] = E.encode_all(ROW, "auto", tok, DataSpec(chat_template=KEEPING))
    assert spans(tok, ex) == [f"<think>need the tool</think>\n{CALL}<|end|>\n",
                              "<think>tool said sunny</think>\nsunny in Paris<|end|>\n",
                              "<think>no tool for that</think>\nno forecast<|end|>\n"]
    assert (ex["turns"], ex["check"]) == (3, "")
    assert E.encode(ROW, "auto", tok, DataSpec(chat_template=KEEPING)) == ex


def test_builtin_template_passes_the_inference_check(tok):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first: red cat"},
            {"role": "assistant", "content": "red"}, {"role": "user", "content": "last: red cat"},
            {"role": "assistant", "content": "cat dog"}]
    [ex] = E.encode_all({"messages": chat}, "auto", tok, DataSpec())
    assert spans(tok, ex) == ["red<|end|>\n", "cat dog<|end|>\n"]
    assert (ex["turns"], ex["check"]) == (2, "")


def test_inference_check_names_a_turn_whose_prompt_tokens_differ(tok):
    # The generation prompt ends in a space that the turn's first word takes into its token: the example's
    # tokens before the turn are not the tokens inference sends (and the check says so).
    tpl = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    [ex] = E.encode_all({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]},
                        "auto", tok, DataSpec(chat_template=tpl))
    assert ex["turns"] == 1 and ex["check"] == ("messages[1]: the tokens before the turn are not the tokenized "
                                                "inference prompt")


def test_conversational_prompt_completion_with_tools_trains_only_the_assistant(tok):
    row = {"prompt": CONV[:2], "completion": CONV[2:5], "tools": json.dumps(TOOLS)}  # tools as JSON text
    [ex] = E.encode_all(row, "auto", tok, DataSpec(chat_template=REWRITING))
    assert spans(tok, ex) == [f"<think>need the tool</think>\n{CALL}<|end|>\n",
                              "<think>tool said sunny</think>\nsunny in Paris<|end|>\n"]  # not the tool result


@pytest.mark.parametrize("row, why", [
    ({"messages": CONV[4:]}, "the chat template does not render reasoning_content"),
    ({"messages": CONV[:2] + [{"role": "assistant", "content": "ok"}], "tools": TOOLS},
     "field 'tools': the chat template does not render tools"),
])
def test_a_template_that_drops_what_the_row_trains_is_a_row_error(tok, row, why):
    # The builtin tiny template renders role and content only: training on it would drop the reasoning or
    # the tools silently.
    with pytest.raises(ValueError, match=why):
        E.encode_all(row, "auto", tok, DataSpec())


GOOD = [
    {"messages": CONV, "tools": TOOLS},
    {"messages": CONV, "tools": json.dumps(TOOLS)},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 1}}}]}]},  # no content key at all, arguments an object
    {"messages": [{"role": "user", "content": "hi", "tool_calls": None, "reasoning_content": None},
                  {"role": "assistant", "content": "yo", "tool_calls": []}]},  # parquet's nulls and empty lists
]
BAD = [
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content must be a string, got NoneType"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content must be a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
     "messages[1].content must be a string, got NoneType"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"name": "f"}}]},
     "messages[0].tool_calls must be a list, got dict"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name must be a non-empty string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments must be a JSON object, got list"),
    ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 3}]},
     "messages[0].reasoning_content must be a string, got int"),
    ({"messages": [{"role": "tool", "content": "r", "tool_call_id": 7}]},
     "messages[0].tool_call_id must be a string, got int"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": "not json"}, "field 'tools' is not valid JSON"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools[0].function.name must be a non-empty string"),
]


@pytest.mark.parametrize("row", GOOD)
def test_openai_shapes_are_good_rows(row):
    assert F.check_row(row, "messages") is None


@pytest.mark.parametrize("row, why", BAD)
def test_malformed_chat_rows_name_the_field(row, why):
    assert F.check_row(row, "messages").startswith(why)


def _recipe(tmp_path, rows, template):
    import yaml

    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"sources": [{"path": str(data)}], "eval_split": 0,
                                               "max_seq_len": 512, "chat_template": template}}))
    return recipe, data


def test_data_verb_reports_the_inference_check(tmp_path, capsys, monkeypatch):
    from finetune import cli

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]}
    recipe, data = _recipe(tmp_path, [ROW, plain], REWRITING)
    assert cli.main(["data", str(recipe), "--show", "3", "--json", "--color", "never"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["rows"] == 3 and stats["chat_rows_split"] == 1 and stats["chat_split_examples"] == 2
    assert (stats["chat_turns_checked"], stats["chat_turns_differing"]) == (4, 0)
    assert "chat turns: 4 of 4 trained turns have exactly the tokens inference renders" in out
    assert "1 rows: the template rewrites earlier turns" in out
    assert out.count("check: ") == 3 and "MISMATCH" not in out
    assert f"({data}:1): " in out and "one of 2 examples of its row" in out

    # A template whose generation prompt ends in a space: every turn differs, each named by file and line.
    space = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    recipe, data = _recipe(tmp_path, [plain, plain], space)
    assert cli.main(["data", str(recipe), "--show", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "chat turns: 0 of 2 trained turns" in out and "check: MISMATCH messages[1]" in out
    assert f"{data}:2: messages[1]: the tokens before the turn are not the tokenized inference prompt" in out


def test_held_out_rows_stay_aligned_when_a_chat_splits(tmp_path, tok):
    from finetune.data import prepare as P
    from finetune.recipe import DataSource

    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]}
    _, data = _recipe(tmp_path, [plain, ROW], REWRITING)
    spec = DataSpec(sources=[DataSource(path=str(data), max_samples=1)], eval_sources=[DataSource(path=str(data))],
                    chat_template=REWRITING, max_seq_len=512)
    p = P.prepare(spec, tok)
    assert len(p.train) == 1 and len(p.eval) == len(p.eval_rows) == 3  # the second row: two examples
    assert [r["_where"] for r in p.eval_rows] == [e["where"] for e in p.eval] == [f"{data}:1"] + [f"{data}:2"] * 2


def test_a_malformed_tool_row_is_named_by_file_line_and_field(tmp_path, tok):
    from finetune.data import prepare as P
    from finetune.recipe import DataSource
    from finetune.util.errors import RecipeError

    broken = json.loads(json.dumps(ROW))
    broken["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{\"city\": "
    _, data = _recipe(tmp_path, [ROW, broken], REWRITING)
    with pytest.raises(RecipeError) as e:
        P.prepare(DataSpec(sources=[DataSource(path=str(data))], eval_split=0, chat_template=REWRITING), tok)
    assert e.value.problems[0] == (f"{data}:2: messages[2].tool_calls[0].function.arguments is not valid JSON "
                                   "(Expecting value, column 10) (format messages)")
