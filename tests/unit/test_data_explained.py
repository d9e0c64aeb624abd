"""Data that explains itself: each test is a trap a new user met with their own file, and the line
that now names it: a chat template's exception as row, turn and field; bad-row counts that match and run in
line order; rows dropped for length counted by reason with the max_seq_len that fixes it; where the held-out
rows come from; save_to_disk folders; the `key[0].field=value` override the errors print."""
import json
import re
from pathlib import Path

import pytest

from finetune.data.prepare import prepare
from finetune.recipe import DataSource, DataSpec, load
from finetune.util.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]


def _docs_tool_call_row() -> dict:
    """The tool-call example of docs/data.md, as the page shows it."""
    text = (ROOT / "docs/data.md").read_text()
    block = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    return json.loads(block)


def _spec(path, **kw) -> DataSpec:
    return DataSpec(sources=[DataSource(path=str(path))], **kw)


def test_the_docs_tool_call_example_says_which_turn_and_field_the_default_template_cannot_render(tmp_path, tok):
    f = tmp_path / "tools.jsonl"
    f.write_text(json.dumps(_docs_tool_call_row()) + "\n")
    with pytest.raises(RecipeError) as e:
        prepare(_spec(f, eval_split=0), tok)
    line = e.value.problems[0]
    assert line.startswith(f"{f}:1: messages[1] (assistant, with tool_calls): the chat template reads 'content', "
                           "which this turn does not have"), line
    assert "never reads tool_calls" in line and "data.chat_template" in line
    assert "dict object" not in line  # the raw Jinja message is gone


def test_bad_rows_are_counted_in_full_and_listed_in_line_order(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = _docs_tool_call_row()
    lines = [bad if i % 3 == 0 else good for i in range(30)]  # lines 1, 4, ..., 28: ten rows the template fails
    f = tmp_path / "mix.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(RecipeError) as e:
        prepare(_spec(f, eval_split=0), tok)  # encoding sees the rows shuffled
    text = e.value.render()
    assert text.splitlines()[0] == "error: 10 problems (the first 5 shown)", text
    assert [p.split(": ")[0] for p in e.value.problems] == [f"{f}:{n}" for n in (1, 4, 7, 10, 13)]
    assert "  ... and 5 more" in text and "on_bad_row: skip" in text.splitlines()[-1]


def test_rows_whose_prompt_fills_max_seq_len_are_counted_with_the_length_that_keeps_them(tmp_path, tok):
    rows = [{"instruction": "word " * (20 + i), "output": "ok"} for i in range(40)]
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps(rows))
    with pytest.raises(RecipeError) as e:
        prepare(_spec(f, eval_split=0, max_seq_len=32, prompt_template="raw"), tok)
    text = "\n".join(e.value.problems)
    assert "no training examples left" in text
    assert "data.max_seq_len: 40 examples dropped: their prompt fills all 32 tokens" in text, text
    longest = len(tok("word " * 59 + "\n")["input_ids"]) + 2  # the prompt, "ok" and EOS
    m = re.search(r"the longest example has (\d+) tokens; data.max_seq_len=(\d+) keeps 99%", text)
    assert m and abs(int(m.group(1)) - longest) <= 1, text
    p = prepare(_spec(f, eval_split=0, max_seq_len=int(m.group(2)), prompt_template="raw"), tok)  # the fix works
    assert p.stats["rows"] >= 39 and p.stats["prompt_fills_max_seq_len"] <= 1


def test_the_held_out_source_is_named_and_a_foreign_one_warned_about(tmp_path, tok):
    from finetune.data.explain import data_notes

    f = tmp_path / "own.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"say {i}", "completion": str(i)}) + "\n" for i in range(20)))
    copied = DataSpec(sources=[DataSource(path=str(f))],  # tiny_cpu.yaml with only the source changed
                      eval_sources=[DataSource(path="builtin:tiny-instruct", split="eval")])
    infos, warns = data_notes(copied, prepare(copied, tok).stats)
    assert infos[0].startswith(f"data: training on {f}; held out for eval: data.eval_sources builtin:tiny-instruct")
    assert any(w.startswith("data.eval_sources: builtin:tiny-instruct is not the training data") for w in warns)
    own = _spec(f, eval_split=0.1)
    infos, warns = data_notes(own, prepare(own, tok).stats)
    assert "data.eval_split 0.1 of the training rows (never trained), 2 examples" in infos[0] and not warns


def test_save_to_disk_folders_are_read_as_datasets(tmp_path, tok):
    import datasets

    rows = [{"instruction": f"say {w}", "output": w} for w in ("one", "two", "three", "four")] * 5
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:4])}).save_to_disk(str(tmp_path / "dd"))
    assert prepare(_spec(tmp_path / "ds", eval_split=0), tok).stats["rows"] == 20
    test = DataSpec(sources=[DataSource(path=str(tmp_path / "dd"), split="test")], eval_split=0)
    assert prepare(test, tok).stats["rows"] == 4
    with pytest.raises(RecipeError, match="DatasetDict without a split 'valid'; its splits: train, test"):
        prepare(DataSpec(sources=[DataSource(path=str(tmp_path / "dd"), split="valid")]), tok)


def test_the_override_syntax_the_errors_print_is_accepted():
    r = load(ROOT / "recipes/tiny_cpu.yaml", ["data.sources[0].format=messages", "data.eval_sources[0].split=train"])
    assert r.data.sources[0].format == "messages" and r.data.eval_sources[0].split == "train"
    with pytest.raises(RecipeError, match=r"data.sources has 1 entry"):
        load(ROOT / "recipes/tiny_cpu.yaml", ["data.sources[2].format=text"])
    with pytest.raises(RecipeError, match=r"data.sources is a list: name an entry, e.g. data.sources\[0\]"):
        load(ROOT / "recipes/tiny_cpu.yaml", ["data.sources.format=text"])


def test_prompt_template_chat_trains_instruction_rows_as_the_chat_a_server_sends(tok):
    from finetune.data.encode import chat_template, encode, prompt_ids
    from finetune.train.inference import _prompt

    row = {"instruction": "Reverse the words.", "input": "cloud rocket river", "output": "river rocket cloud"}
    spec = DataSpec(prompt_template="chat")
    template = chat_template(spec, tok)
    ex = encode(row, "instruction", tok, spec)
    user = [{"role": "user", "content": "Reverse the words.\n\ncloud rocket river"}]
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "river rocket cloud"}],
                                    chat_template=template, tokenize=False)
    assert ex["input_ids"] == tok(whole, add_special_tokens=False)["input_ids"]
    prompt = prompt_ids(tok, user, template)  # what generate and eval send
    assert ex["input_ids"][: len(prompt)] == prompt
    assert all(t == -100 for t in ex["labels"][: len(prompt)]) and ex["labels"][len(prompt)] != -100
    assert tok.decode([t for t in ex["labels"] if t != -100]).startswith("river rocket cloud")
    assert _prompt(row, chat_layout=True) == (user, "river rocket cloud")
    assert encode(row, "instruction", tok, DataSpec()) == ex  # the default (auto): the chat layout, as there is a template
    raw = encode(row, "instruction", tok, DataSpec(prompt_template="raw"))  # the raw layout when asked
    assert raw["input_ids"][: len(tok("Reverse the words.\ncloud rocket river\n")["input_ids"])] == \
        tok("Reverse the words.\ncloud rocket river\n")["input_ids"]


def test_auto_layout_follows_the_chat_template_and_the_run_says_which(tmp_path, tok):
    """prompt_template's default (auto): instruction rows train through the chat template when there is
    one, as plain text when the tokenizer has none; the run's first lines say which, and how to change it."""
    import copy

    from finetune.data.encode import chat_layout
    from finetune.data.explain import data_notes

    plain_tok = copy.deepcopy(tok)
    plain_tok.chat_template = None
    assert chat_layout(DataSpec(), tok) and not chat_layout(DataSpec(), plain_tok)
    assert not chat_layout(DataSpec(prompt_template="raw"), tok)
    assert chat_layout(DataSpec(chat_template="chatml"), plain_tok)  # a recipe's own template counts
    row = {"instruction": "Reverse the words.", "input": "cloud rocket", "output": "rocket cloud"}
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps([row] * 10))
    for t, spec, want in ((tok, _spec(f), "as a user and an assistant turn of the chat template (data.prompt_template: auto"),
                          (plain_tok, _spec(f), "as plain text, the prompt then the completion (data.prompt_template: "
                                                "auto; the tokenizer has no chat template)"),
                          (tok, _spec(f, prompt_template="raw"), "as plain text, the prompt then the completion "
                                                                 "(data.prompt_template: raw)")):
        p = prepare(spec, t)
        assert any(want in line for line in data_notes(spec, p.stats)[0]), data_notes(spec, p.stats)
    chats = tmp_path / "chat.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ok"}]}) + "\n")
    p = prepare(_spec(chats, eval_split=0), tok)
    assert not any("instruction and prompt/completion rows" in line for line in data_notes(_spec(chats), p.stats)[0])
