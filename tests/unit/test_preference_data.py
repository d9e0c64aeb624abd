"""Preference rows: strings and chats rendered as SFT renders a turn, only the answer tokens scored, bad rows
named by file:line, the builtin set, pairs collated chosen-then-rejected, and a method that does not fit
the data refused."""
import json

import pytest

from finetune.data import encode as E
from finetune.data import prepare as P
from finetune.data.batching import collate_pairs
from finetune.recipe import DataSource, DataSpec
from finetune.util import builtin
from finetune.util.errors import RecipeError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


def trained(ids, labels):
    return [t for i, (t, lab) in enumerate(zip(ids, labels)) if i > 0 and lab != E.IGNORE]


def test_a_string_pair_is_two_prompt_completion_examples(tok):
    for spec, end in ((DataSpec(), "<|end|>\n"), (DataSpec(prompt_template="raw"), "<|end|>")):  # either layout
        ex = E.encode_all({"prompt": "first: red cat\n", "chosen": "red", "rejected": "cat"}, "auto", tok, spec)[0]
        sft = E.encode({"prompt": "first: red cat\n", "completion": "red"}, "prompt_completion", tok, spec)
        assert (ex["input_ids"], ex["labels"]) == (sft["input_ids"], sft["labels"])
        assert tok.decode(trained(ex["rejected_ids"], ex["rejected_labels"])) == "cat" + end


@pytest.mark.parametrize("row", [
    {"prompt": [{"role": "user", "content": "first: red cat"}], "chosen": [{"role": "assistant", "content": "red"}],
     "rejected": [{"role": "assistant", "content": "cat"}]},
    {"chosen": [{"role": "user", "content": "first: red cat"}, {"role": "assistant", "content": "red"}],
     "rejected": [{"role": "user", "content": "first: red cat"}, {"role": "assistant", "content": "cat"}]},
])
def test_a_chat_pair_renders_each_answer_as_an_sft_turn(tok, row):
    spec = DataSpec()
    ex = E.encode_all(row, "auto", tok, spec)[0]
    for ids, labels, answer in ((ex["input_ids"], ex["labels"], "red"), (ex["rejected_ids"], ex["rejected_labels"], "cat")):
        sft = E.encode({"messages": [{"role": "user", "content": "first: red cat"},
                                     {"role": "assistant", "content": answer}]}, "messages", tok, spec)
        assert (ids, labels) == (sft["input_ids"], sft["labels"])


def test_bad_preference_rows_are_named_by_file_and_line(tmp_path, tok):
    rows = [{"prompt": "a\n", "chosen": "b", "rejected": "c"},
            {"prompt": "a\n", "chosen": "b", "rejected": ""},
            {"prompt": "a\n", "chosen": "b", "rejected": 3},
            {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError) as e:
        P.prepare(DataSpec(sources=[DataSource(path=str(path))], eval_split=0), tok)
    text = "\n".join(e.value.problems)
    assert f"{path}:2: field 'rejected' is empty" in text
    assert f"{path}:3: field 'rejected' must be a string" in text
    assert f"{path}:4: 'chosen' and 'rejected' must share every message but their last" in text
    assert f"{path}:1" not in text


def test_the_builtin_set_pairs_the_right_answer_with_a_plausible_wrong_one(tok):
    rows = [json.loads(l) for l in (builtin.preference_dir() / "train.jsonl").read_text().splitlines()]
    held = [json.loads(l) for l in (builtin.preference_dir() / "eval.jsonl").read_text().splitlines()]
    assert (len(rows), len(held)) == (4000, 200)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    for r in rows:
        task, words = r["prompt"].split(":", 1)
        assert r["chosen"] == " ".join(builtin.TASKS[task](words.split())) != r["rejected"]
        assert set(r["rejected"].split()) <= set(words.split())


def test_pairs_collate_as_chosen_then_rejected_with_their_reference(tok):
    spec = DataSpec()
    exs = [E.encode_pair({"prompt": f"first: {w} cat\n", "chosen": w, "rejected": "cat"}, tok, spec)
           for w in ("red", "blue")]
    exs[0]["ref"], exs[1]["ref"] = (-1.0, -2.0), (-3.0, -4.0)
    b = collate_pairs(exs, tok.pad_token_id)
    assert b["input_ids"].shape[0] == 4
    assert b["ref_logps"].tolist() == [-1.0, -3.0, -2.0, -4.0]
    assert b["input_ids"][2, : len(exs[0]["rejected_ids"])].tolist() == exs[0]["rejected_ids"]


def test_a_method_that_does_not_fit_the_data_is_refused(tok):
    pairs = P.prepare(DataSpec(sources=[DataSource(path="builtin:tiny-preference", max_samples=20)]), tok)
    P.check_method(pairs, "dpo")
    with pytest.raises(RecipeError, match="preference pairs"):
        P.check_method(pairs, "sft")
    sft = P.prepare(DataSpec(sources=[DataSource(path="builtin:tiny-instruct", max_samples=20)]), tok)
    with pytest.raises(RecipeError, match="needs preference rows"):
        P.check_method(sft, "orpo")


def test_packing_is_refused_for_preference_methods():
    from finetune.recipe import Recipe

    with pytest.raises(ValueError, match="data.packing"):
        Recipe.model_validate({"train": {"method": "dpo"}, "data": {"packing": True}})


def test_pairs_whose_chosen_equals_rejected_are_counted_warned_and_dropped(tmp_path, tok):
    from finetune.data.explain import data_notes

    rows = [{"prompt": f"q{i}\n", "chosen": "yes", "rejected": "yes" if i % 3 == 0 else "no"} for i in range(9)]
    rows.append({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                 "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(sources=[DataSource(path=str(path))], eval_split=0)
    prepared = P.prepare(spec, tok)
    assert prepared.stats["identical_pairs"] == 4 and len(prepared.train) == 6  # rows 0, 3, 6 and the chat
    assert all(e["input_ids"] != e["rejected_ids"] for e in prepared.train)
    _, warns = data_notes(spec, prepared.stats)  # what `finetune data` and `train` print
    assert any("4 preference pairs dropped: chosen equals rejected" in w for w in warns), warns


def test_a_damaged_reference_file_is_not_used_by_a_fresh_run(tmp_path):
    # A fresh DPO run (no checkpoint) recomputes what it cannot read; it used to die in a JSONDecodeError.
    from finetune.train import refpolicy

    path = tmp_path / refpolicy.FILE
    path.parent.mkdir()
    good = {"key": "k", "train": [[-1.0, -2.0]], "eval": []}
    path.write_text(json.dumps(good))
    assert refpolicy.read_stored(tmp_path, "k") == good
    for damaged in (json.dumps(good)[:20], '{"key": "k", "train": [[1.0]], "eval": []}', "\udcff"):
        path.write_bytes(damaged.encode(errors="surrogateescape"))
        assert refpolicy.read_stored(tmp_path, "k") is None
