"""The tokenized-data cache is bounded (least recently used files go past FINETUNE_DATA_CACHE_MAX) and its
planned size is part of the disk preflight."""
from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

from finetune import recipe as R
from finetune.data.prepare import prune_cache
from finetune.plan import disk as D
from finetune.plan.archs import resolve

ROOT = Path(__file__).resolve().parents[2]
Usage = namedtuple("Usage", "total used free")


def test_least_recently_used_cache_files_go_past_the_cap(tmp_path):
    for i, name in enumerate(["old", "mid", "new", "mine"]):
        p = tmp_path / f"{name}.arrow"
        p.write_bytes(b"\0" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    os.utime(tmp_path / "mine.arrow", (1, 1))  # the oldest, but in use by this run
    removed = prune_cache(tmp_path, {tmp_path / "mine.arrow"}, cap=2500)
    assert [p.name for p in removed] == ["old.arrow", "mid.arrow"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.arrow", "new.arrow"]


def test_the_cache_counts_in_the_disk_preflight(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))  # the same disk as the output dir
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "' + b"x" * (1 << 20) + b'"}\n')
    r = R.load(ROOT / "recipes" / "llama3_8b_qlora.yaml", [f"output.dir={tmp_path / 'run'}",
                                                            f"data.sources=[{{path: '{data}'}}]"])
    arch = resolve(r.model.name)[0]
    need = D.planned_bytes(r, arch, 1).total
    cache = D.cache_bytes(r)
    assert cache == data.stat().st_size * D.CACHE_BYTES_PER_TEXT_BYTE
    low = D.output_problems(r, arch, 1, disk_usage=lambda p: Usage(10 * need, 0, need + cache // 2))
    assert len(low) == 1 and low[0].path == "output.dir" and "tokenized-data cache" in low[0].message
    assert D.output_problems(r, arch, 1, disk_usage=lambda p: Usage(10 * need, 0, need + cache + 1)) == []
    monkeypatch.setenv(D.CACHE_MAX_ENV, "1MiB")  # a cap bounds the plan too
    assert D.cache_bytes(r) == 1 << 20


def test_an_unwritable_cache_costs_the_cache_not_the_run(tmp_path, monkeypatch, tok, capsys):
    import json

    from finetune.data.prepare import prepare
    from finetune.recipe import DataSource, DataSpec

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FINETUNE_CACHE", str(blocker / "cache"))  # cannot be created: not a directory
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}:", "completion": f" {i}"}) + "\n" for i in range(20)))
    prepared = prepare(DataSpec(sources=[DataSource(path=str(rows))], eval_split=0), tok)
    assert len(prepared.train) == 20
    assert "data cache: cannot write to" in capsys.readouterr().err
