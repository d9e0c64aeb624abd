"""prepare(): mixing by weight, held-out split, max_samples, caching, the length policy and stats;
pack(): best-fit packing that keeps every token, restarts positions and never trains across documents."""
import json
import random

import pytest

from finetune.data import batching as B
from finetune.data import encode as E
from finetune.data import prepare as P
from finetune.recipe import DataSource, DataSpec
from finetune.util.errors import RecipeError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pc(n, tag):
    return [{"prompt": f"{tag} {i}\n", "completion": f"red cat {i}"} for i in range(n)]


def test_weights_scale_each_source_and_the_split_happens_before(tmp_path, tok):
    a, b = jsonl(tmp_path / "a.jsonl", pc(40, "a")), jsonl(tmp_path / "b.jsonl", pc(40, "b"))
    spec = DataSpec(sources=[DataSource(path=a, weight=2.0), DataSource(path=b, weight=0.5)], eval_split=0.1)
    p = P.prepare(spec, tok)
    assert [s["rows_train"] for s in p.stats["sources"]] == [72, 18]  # 36 x 2, 36 x 0.5
    assert p.stats["rows"] == 90 and p.stats["eval_rows"] == 8
    held = {r["prompt"] for r in p.eval_rows}
    trained = {tok.decode(e["input_ids"]).split("\n")[0] + "\n" for e in p.train}
    assert not held & trained  # a repeated row never lands on both sides


def test_same_seed_same_data_and_a_second_run_reads_the_cache(tmp_path, tok, cache):
    spec = DataSpec(sources=[DataSource(path=jsonl(tmp_path / "a.jsonl", pc(30, "a")))], shuffle_seed=3,
                    max_samples=20)
    first = P.prepare(spec, tok)
    files = sorted(cache.glob("data/train-*.arrow"))
    assert len(files) == 1
    second = P.prepare(spec, tok)
    assert second.train == first.train and len(first.train) == 20
    assert sorted(cache.glob("data/train-*.arrow")) == files  # reused, not rewritten under a new key
    other = P.prepare(spec.model_copy(update={"shuffle_seed": 4}), tok)
    assert other.train != first.train


def test_overlong_rows_are_truncated_or_dropped_and_counted(tmp_path, tok):
    rows = pc(5, "a") + [{"prompt": "long\n", "completion": " ".join(["red cat"] * 40)}]
    path = jsonl(tmp_path / "a.jsonl", rows)
    kw = dict(sources=[DataSource(path=path)], eval_split=0, max_seq_len=16)
    p = P.prepare(DataSpec(overlong="truncate", **kw), tok)
    assert p.stats["truncated"] == 1 and p.stats["rows"] == 6 and p.stats["max_length"] == 16
    p = P.prepare(DataSpec(overlong="drop", **kw), tok)
    assert p.stats["dropped_overlong"] == 1 and p.stats["rows"] == 5


def test_rows_that_fail_to_encode_are_bad_rows(tmp_path, tok):
    reverse = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    spec = DataSpec(sources=[DataSource(path=jsonl(tmp_path / "c.jsonl", chats))], eval_split=0,
                    chat_template=reverse)
    with pytest.raises(RecipeError, match=r"c\.jsonl:1: messages\[1\]: the chat template does not render"):
        P.prepare(spec, tok)
    with pytest.raises(RecipeError, match="no training examples left .*3 bad rows"):
        P.prepare(spec.model_copy(update={"on_bad_row": "skip"}), tok)


def test_stats_count_trained_tokens_as_the_loss_does(tmp_path, tok):
    spec = DataSpec(sources=[DataSource(path=jsonl(tmp_path / "a.jsonl", pc(4, "a")))], eval_split=0)
    p = P.prepare(spec, tok)
    assert p.stats["tokens"] == sum(len(e["input_ids"]) for e in p.train)
    assert p.stats["trained_tokens"] == sum(B.collate(p.train, 0)["labels"][:, 1:].ne(E.IGNORE).sum().tolist()
                                            for _ in [0])
    assert p.stats["rows_skipped"] == 0


def skewed(n=600, seed=0):
    """Many short examples and a few long ones, as real SFT data is."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([rng.randint(8, 40)] * 9 + [rng.randint(150, 500)])
        ids = [rng.randint(3, 300) for _ in range(k)]
        out.append({"input_ids": ids, "labels": [E.IGNORE] * (k // 2) + ids[k // 2:]})
    return out


def test_packing_keeps_every_token_and_labels_never_cross_documents():
    ex = skewed(300)
    rows = B.pack(ex, 512)
    assert all(len(r["input_ids"]) <= 512 for r in rows)
    docs = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        assert r["position_ids"] == [p for a, b in zip(starts, starts[1:]) for p in range(b - a)]
        for a, b in zip(starts, starts[1:]):
            assert r["labels"][a] == E.IGNORE  # a document's first token is never predicted from the last one
            docs.append((tuple(r["input_ids"][a:b]), tuple(r["labels"][a + 1:b])))
    assert sorted(docs) == sorted((tuple(e["input_ids"]), tuple(e["labels"][1:])) for e in ex)


def test_packing_efficiency_on_length_skewed_data():
    ex = skewed(600)
    stats = B.batch_stats(ex, batch_size=8, max_len=512)
    assert stats["packing_efficiency"] >= 0.95
    assert stats["padding_fraction_packed"] < 0.05 < 0.5 < stats["padding_fraction_unpacked"]


def test_packed_rows_follow_the_callers_order_not_the_length_order():
    ex = skewed(200)
    for i, e in enumerate(ex):  # tag each document by its first token
        e["input_ids"][0] = 1000 + i
    rows = B.pack(ex, 512)
    earliest = [min(t - 1000 for t, p in zip(r["input_ids"], r["position_ids"]) if p == 0) for r in rows]
    assert earliest == sorted(earliest) and earliest[0] == 0


def test_flat_layout_is_one_row_without_padding():
    rows = B.pack(skewed(40), 256)
    flat = B.collate_packed(rows[:4], pad_id=0, flat=True)
    assert flat["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows[:4]))
    assert "attention_mask" not in flat


def test_backends_without_packing_support_fall_back_to_padding(capsys):
    assert B.packing_layout(True, "sdpa") == "rows"
    assert B.packing_layout(True, "flash_attention_2") == "flat"
    assert B.packing_layout(True, "flex_attention") is None
    assert B.packing_layout(False, "sdpa") is None
    notes = capsys.readouterr().out.splitlines()
    assert len(notes) == 1 and "dynamic padding" in notes[0]
