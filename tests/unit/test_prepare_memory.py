"""prepare() at scale: what preparing holds per row (the bound behind `finetune data` on millions of rows,
benchmarks/cpu/prepare_rss.py), and the examples read back from the memory-mapped cache as the lists were."""
import json
import random

import pytest

from finetune.data import prepare as P
from finetune.recipe import DataSource, DataSpec

ROWS = 5_000
WORDS = "apple river stone cloud green quick seven north paper light music table window garden".split()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def rows_file(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for _ in range(ROWS):
            f.write(json.dumps({"instruction": "reverse: " + " ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
                                "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))}) + "\n")
    return path


def test_prepared_rows_hold_no_python_containers(rows_file, tmp_path, tok):
    """The Python containers (lists, dicts) a Prepared keeps alive, per row: token ids as Python lists cost
    ~36 bytes a token, ids and labels, in a list and a dict per example (2.7 GiB of RSS for 200,000 rows
    before; benchmarks/cpu/prepare_rss.py). Counted by the garbage collector, which tracks every container."""
    import gc

    small = tmp_path / "small.jsonl"
    small.write_text("".join(rows_file.read_text().splitlines(keepends=True)[:50]))
    P.prepare(DataSpec(sources=[DataSource(path=str(small))]), tok)  # imports and first-use caches, not rows
    gc.collect()
    before = len(gc.get_objects())
    prepared = P.prepare(DataSpec(sources=[DataSource(path=str(rows_file))], eval_split=0.01), tok)
    gc.collect()
    held = len(gc.get_objects()) - before
    assert prepared.stats["rows"] + prepared.stats["eval_rows"] == ROWS
    assert prepared.stats["tokens"] > 15 * ROWS  # the rows were encoded, not skipped
    # The held-out rows are dicts (exact match reads them): 1% of the rows, a dict each.
    assert held < 0.05 * ROWS, f"{held} containers held for {ROWS} rows"


def test_examples_are_read_from_the_memory_mapped_cache(rows_file, tok):
    """The token ids stay in the cache file (memory-mapped, not arrow's heap), and each example reads back
    as the dict the encoder made for its row: the same row, ids and labels, truncated to max_seq_len."""
    import pyarrow

    from finetune.data.encode import IGNORE

    before = pyarrow.total_allocated_bytes()
    prepared = P.prepare(DataSpec(sources=[DataSource(path=str(rows_file))], eval_split=0.01, max_seq_len=12), tok)
    assert pyarrow.total_allocated_bytes() - before < 16 * ROWS
    ex = prepared.train[-1]
    assert set(ex) == {"input_ids", "labels", "where", "row", "parts", "turns", "check"}
    line = int(ex["where"].rsplit(":", 1)[1])
    row = json.loads(rows_file.read_text().splitlines()[line - 1])
    assert row["output"].split()[0] in tok.decode(ex["input_ids"]) or len(ex["input_ids"]) == 12
    assert max(len(e["input_ids"]) for e in prepared.train) == 12 and prepared.stats["truncated"] > 0
    assert all(len(e["labels"]) == len(e["input_ids"]) and e["labels"][-1] != IGNORE for e in prepared.train[:50])
    assert list(prepared.train[10:13]) == [prepared.train[i] for i in (10, 11, 12)]
    assert [r["_where"] for r in prepared.eval_rows] == [e["where"] for e in prepared.eval]
