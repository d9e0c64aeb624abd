"""Rows that used to crash the reader or train silently: a huge integer, a lone surrogate, an empty assistant
turn, an oversized .json row. Each is a bad row named by file:line; with on_bad_row: skip the good rows
around it all train."""
import json

import pytest

from finetune.data import prepare as P
from finetune.data import readers as R
from finetune.recipe import DataSource, DataSpec
from finetune.util.errors import RecipeError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


GOOD = [{"prompt": f"say {i}\n", "completion": f"word {i}"} for i in range(6)]
HOSTILE = ['{"prompt": "a\\n", "completion": "b", "id": ' + "9" * 5000 + "}",  # int() refuses > 4300 digits
           '{"prompt": "a\\n", "completion": "bad \\ud800 text"}',  # a lone surrogate
           '{"prompt": ' + "1" * 5000 + ', "completion": "b"}']


def _spec(path, mode, **kw):
    return DataSpec(sources=[DataSource(path=str(path))], eval_split=0, on_bad_row=mode, max_seq_len=64, **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_huge_integers_and_lone_surrogates_are_bad_rows(tmp_path, tok, suffix):
    p = tmp_path / f"rows{suffix}"
    lines = [json.dumps(r) for r in GOOD[:3]] + HOSTILE + [json.dumps(r) for r in GOOD[3:]]
    p.write_text("\n".join(lines) + "\n" if suffix == ".jsonl" else "[\n" + ",\n".join(lines) + "\n]\n")
    kept = P.prepare(_spec(p, "skip"), tok)
    # The huge integer in an unused field (line 4) harms nothing: that row trains.
    assert kept.stats["rows"] == 7 and kept.stats["rows_skipped"] == 2
    with pytest.raises(RecipeError) as e:
        P.prepare(_spec(p, "error"), tok)
    text = "\n".join(e.value.problems)
    line = 5 if suffix == ".jsonl" else 6  # the array's "[" takes line 1
    assert f"{p}:{line}: a lone UTF-16 surrogate" in text and f"{p}:{line + 1}: field 'prompt' must be a" in text


@pytest.mark.parametrize("content", ["", "  \n "])
def test_empty_assistant_turn_is_a_bad_row_in_chat_formats(tmp_path, tok, content):
    good = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
            for i in range(4)]
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": content}]}
    p, q = tmp_path / "chat.jsonl", tmp_path / "sharegpt.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [good[0], bad, *good[1:]]))
    q.write_text(json.dumps(share) + "\n" + json.dumps({**share, "conversations": share["conversations"][:1] + [
        {"from": "gpt", "value": "fine"}]}) + "\n")
    sources = [DataSource(path=str(p)), DataSource(path=str(q))]
    with pytest.raises(RecipeError) as e:
        P.prepare(DataSpec(sources=sources, eval_split=0, chat_template="chatml"), tok)
    text = "\n".join(e.value.problems)
    assert f"{p}:2: messages[1].content is empty" in text
    with pytest.raises(RecipeError) as e:
        P.prepare(DataSpec(sources=sources[1:], eval_split=0, chat_template="chatml"), tok)
    assert f"{q}:1: conversations[1].value is empty" in "\n".join(e.value.problems)
    skip = DataSpec(sources=sources, eval_split=0, chat_template="chatml", on_bad_row="skip")
    assert P.prepare(skip, tok).stats["rows"] == 5


@pytest.mark.parametrize("layout", ["array", "object"])
def test_json_files_obey_the_row_size_limit(tmp_path, tok, monkeypatch, layout):
    monkeypatch.setattr(R, "MAX_ROW_BYTES", 4096)  # the limit (16 MiB) scaled down: same code path
    rows = GOOD[:3] + [{"prompt": "x\n", "completion": "y" * 5000}] + GOOD[3:]
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(rows, indent=0) if layout == "array" else json.dumps({"data": rows}))
    kept = P.prepare(_spec(p, "skip"), tok)
    assert kept.stats["rows"] == 6 and "longer than the limit of 4096 bytes" in kept.stats["bad_rows"][0]


class _Recording:
    """The real tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _strings(value):
    """Every string inside a row (its fields, and the contents of its messages)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


@pytest.mark.parametrize("row", [{"text": "many words " * 100_000},
                                 {"prompt": "say it\n", "completion": "again and " * 100_000},
                                 {"messages": [{"role": "user", "content": "hi " * 100_000},
                                               {"role": "assistant", "content": "ok"}]}])
def test_a_huge_row_is_cut_before_it_is_tokenized_with_the_same_result(tok, row):
    """A 1 MB row: only a bounded prefix reaches the tokenizer, and the first max_seq_len tokens (what
    trains) and the verdict "too long" are what tokenizing the whole row gives."""
    from finetune.data import encode as E

    spec = DataSpec(max_seq_len=64, chat_template="chatml")
    rec = _Recording(tok)
    got = E.encode(row, "auto", rec, spec)
    cap = 64 * E.CHARS_PER_TOKEN_CAP
    beside = sum(len(v) for v in _strings(row) if len(v) <= cap)  # the short fields rendered with the long one
    assert rec.longest <= cap + beside + 64  # + the template's own characters
    whole = E.encode(row, "auto", tok, DataSpec(max_seq_len=10**9, chat_template="chatml"))
    assert got["input_ids"][:64] == whole["input_ids"][:64] and got["labels"][:64] == whole["labels"][:64]
    assert len(got["input_ids"]) > 64 and len(whole["input_ids"]) > 64


SYSTEM_FILE = "root:x:0:0:secret-line-of-a-system-file:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/nologin\n"


def test_a_data_link_to_a_file_of_another_kind_is_named_never_echoed(tmp_path, capsys):
    """A .csv that is a link to a system file: exit 2 naming the link and where it leads, and not one line
    of the file in the message (its "header" is its first line)."""
    from finetune import cli

    target = tmp_path / "passwd"
    target.write_text(SYSTEM_FILE)
    (tmp_path / "rows.csv").symlink_to(target)
    assert cli.main(["data", "recipes/tiny_cpu.yaml", f"data.sources=[{{path: {tmp_path / 'rows.csv'}}}]",
                     "data.eval_sources=[]"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "secret-line" not in err and "root:x" not in err, err
    assert f"{tmp_path / 'rows.csv'} is a symbolic link to {target}" in err and "no field names" in err, err


def test_values_quoted_from_rows_are_escaped_and_bounded(tmp_path):
    """Where a file did parse as its declared format, a quoted value is an escaped excerpt: no terminal
    control character, no kilobytes of text."""
    from finetune.data import sources as S
    from finetune.data.formats import BadRows

    role = "\x1b[2J" + "x" * 5000
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": role, "content": "hi"}]}) + "\n"
                 + json.dumps({"\x1b]0;title\x07": "a", "weird key " * 20: "b"}) + "\n")
    with pytest.raises(RecipeError) as e:
        S.read_source(DataSource(path=str(p), format="messages"), BadRows("error"), "data.sources[0]")
    text = str(e.value)
    assert "\x1b" not in text and "x" * 100 not in text and "\\x1b[2Jxxx" in text, text
    with pytest.raises(RecipeError) as e:  # the second row alone, format auto: its keys are not names
        p.write_text(json.dumps({"\x1b]0;title\x07": "a", "weird key " * 20: "b"}) + "\n")
        S.read_source(DataSource(path=str(p)), BadRows("error"), "data.sources[0]")
    assert "\x1b" not in str(e.value) and "weird key" not in str(e.value) and "no field names (2 key(s)" in str(e.value)
