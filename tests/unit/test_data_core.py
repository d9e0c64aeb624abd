"""Token-level checks of what trains: labels != -100 exactly on completion / assistant spans."""
import pytest

from finetune.data import batching as B
from finetune.data import encode as E
from finetune.recipe import DataSpec


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def trained_text(tok, ex):
    return tok.decode([t for t, l in zip(ex["input_ids"], ex["labels"]) if l != E.IGNORE])


def test_prompt_completion_trains_only_the_completion(tok):
    ex = E.encode({"prompt": "reverse: red cat\n", "completion": "cat red"}, "auto", tok,
                  DataSpec(prompt_template="raw"))
    assert trained_text(tok, ex) == "cat red<|end|>"
    assert tok.decode(ex["input_ids"]) == "reverse: red cat\ncat red<|end|>"


def test_train_on_inputs_trains_everything(tok):
    ex = E.encode({"prompt": "sort: b a\n", "completion": "a b"}, "auto", tok, DataSpec(train_on_inputs=True))
    assert all(l != E.IGNORE for l in ex["labels"])


def test_multi_turn_chat_trains_every_assistant_turn_only(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first: red cat"},
            {"role": "assistant", "content": "red"}, {"role": "user", "content": "last: red cat"},
            {"role": "assistant", "content": "cat"}]
    ex = E.encode({"messages": msgs}, "auto", tok, DataSpec())
    spans, cur = [], []
    for t, l in zip(ex["input_ids"], ex["labels"]):
        if l != E.IGNORE:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur)); cur = []
    if cur:
        spans.append(tok.decode(cur))
    assert spans == ["red<|end|>\n", "cat<|end|>\n"]


def test_pack_restarts_positions_and_never_trains_across_documents():
    a = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
    b = {"input_ids": [4, 5], "labels": [4, 5]}
    rows = B.pack([a, b], max_len=8)
    assert len(rows) == 1
    assert rows[0]["position_ids"] == [0, 1, 2, 0, 1]
    assert rows[0]["labels"] == [-100, 2, 3, -100, 5]
    batch = B.collate_packed(rows, pad_id=0)
    assert "attention_mask" not in batch  # the block-diagonal mask comes from position_ids only


def test_collate_pads_right_and_masks_padding():
    batch = B.collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}], pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"][1].tolist() == [4, -100, -100]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
