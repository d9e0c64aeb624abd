"""Synthetic token data (`synthetic:tokens?...`) and pre-tokenized rows (format `tokens`): ids over a whole
vocabulary that is not the tiny tokenizer's, every token trained, seeded and split-dependent; and every
row's ids bounded by the model's vocabulary with the row named."""
from __future__ import annotations

import json

import pytest

from finetune.data.prepare import prepare
from finetune.recipe import DataSource, DataSpec
from finetune.util.errors import RecipeError
from finetune.util.synthetic_names import parse_tokens


def spec(*sources, **kw) -> DataSpec:
    return DataSpec(sources=[DataSource(path=s) if isinstance(s, str) else s for s in sources], **kw)


def test_synthetic_tokens_cover_the_model_vocabulary_and_train_every_token(tok):
    path = "synthetic:tokens?rows=60&min_len=8&max_len=40&seed=3"
    prep = prepare(spec(path, eval_split=0.1, max_seq_len=64), tok, vocab_size=5000)
    examples = prep.train + prep.eval
    assert len(examples) == 60 and len(prep.eval) == 6
    ids = [t for ex in examples for t in ex["input_ids"]]
    assert max(ids) < 5000 and max(ids) >= len(tok)  # beyond the tiny tokenizer's 384 ids
    assert all(8 <= len(ex["input_ids"]) <= 40 for ex in examples)
    assert all(ex["labels"] == ex["input_ids"] for ex in examples)
    again = prepare(spec(path, eval_split=0.1, max_seq_len=64), tok, vocab_size=5000)
    assert again.train == prep.train  # seeded


def test_synthetic_tokens_options_and_splits(tok):
    explicit = prepare(spec("synthetic:tokens?rows=20&max_len=16&vocab=700", eval_split=0), tok, vocab_size=None)
    assert max(t for ex in explicit.train for t in ex["input_ids"]) < 700
    other_split = DataSource(path="synthetic:tokens?rows=20&max_len=16&vocab=700", split="validation")
    held = prepare(spec("synthetic:tokens?rows=20&max_len=16&vocab=700", eval_sources=[other_split]), tok)
    assert {tuple(e["input_ids"]) for e in held.eval}.isdisjoint({tuple(e["input_ids"]) for e in held.train})
    with pytest.raises(RecipeError, match="vocabulary size is not known"):
        prepare(spec("synthetic:tokens?rows=5"), tok, vocab_size=None)


@pytest.mark.parametrize("path, match", [
    ("synthetic:tokens?row=5", "unknown option 'row'"),
    ("synthetic:tokens?rows=0", "rows='0' is not a positive integer"),
    ("synthetic:tokens?min_len=50&max_len=10", "min_len <= max_len"),
    ("synthetic:tokens?rows=x", "is not a positive integer"),
])
def test_bad_synthetic_token_options_are_recipe_errors(path, match):
    with pytest.raises(RecipeError, match=match):
        parse_tokens(path)
    assert parse_tokens("synthetic:tokens")["rows"] == 1000


def test_pretokenized_rows_keep_their_labels_and_bad_ones_are_named(tmp_path, tok):
    f = tmp_path / "ids.jsonl"
    rows = [{"input_ids": [1, 5, 9, 12], "labels": [-100, -100, 9, 12]},
            {"input_ids": [3, 4, 5, 6, 7]},
            {"input_ids": [3, "4"]},
            {"input_ids": [3, 4], "labels": [3]},
            {"input_ids": [2, 900, 3]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError) as err:  # checked while reading: every malformed row at once
        prepare(spec(str(f), eval_split=0), tok, vocab_size=500)
    text = str(err.value)
    assert f"{f}:3" in text and "input_ids[1]" in text
    assert f"{f}:4" in text and "'labels' has 1 entries" in text
    f.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[4:]))
    with pytest.raises(RecipeError, match=f"{f}:3: token id 900 is outside the model's vocabulary .500 ids."):
        prepare(spec(str(f), eval_split=0), tok, vocab_size=500)
    kept = prepare(spec(str(f), eval_split=0, on_bad_row="skip"), tok, vocab_size=500)
    by_len = {len(ex["input_ids"]): ex for ex in kept.train}
    assert sorted(by_len) == [4, 5]
    assert by_len[4]["labels"] == [-100, -100, 9, 12] and by_len[5]["labels"] == [3, 4, 5, 6, 7]


def test_data_show_marks_ids_the_tokenizer_lacks(tok):
    from finetune.commands.data import render

    text = render({"input_ids": [5, 900, 7], "labels": [5, 900, 7]}, tok, color=False)
    assert "<id 900>" in text


def test_data_command_refuses_ids_beyond_the_model_vocabulary():
    from tests.conftest import run_cli

    p = run_cli(["data", "recipes/tiny_cpu.yaml", "--dataset", "synthetic:tokens?rows=10&vocab=1000"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "outside the model's vocabulary (384 ids)" in p.stderr and "Traceback" not in p.stderr


def test_labels_outside_the_vocabulary_are_bad_rows_like_input_ids(tmp_path, tok):
    f = tmp_path / "ids.jsonl"
    rows = [{"input_ids": [1, 5, 9, 12], "labels": [-100, -100, 9, 12]},
            {"input_ids": [1, 5, 9, 12], "labels": [-100, -100, 9, 900]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=f"{f}:2: token id 900 in 'labels' is outside the model's vocabulary"):
        prepare(spec(str(f), eval_split=0), tok, vocab_size=500)
    kept = prepare(spec(str(f), eval_split=0, on_bad_row="skip"), tok, vocab_size=500)
    assert [ex["labels"] for ex in kept.train] == [[-100, -100, 9, 12]]
