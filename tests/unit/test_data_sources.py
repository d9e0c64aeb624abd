"""Reading rows: every file type, folders, bad rows named by file and line, hostile files as clean
RecipeErrors, mixing by weight, splits, max_samples, and hub datasets from the local cache only."""
import json

import pytest

from finetune.data import formats as F
from finetune.data import readers as R
from finetune.data import sources as S
from finetune.recipe import DataSource
from finetune.util.errors import RecipeError


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


PC = [{"prompt": f"p{i}\n", "completion": f"c{i}"} for i in range(6)]


def read(path, mode="error", **kw):
    bad = F.BadRows(mode)
    fmt, rows = S.read_source(DataSource(path=str(path), **kw), bad, "data.sources[0]")
    return fmt, rows, bad


def test_jsonl_rows_carry_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", PC[:2])
    fmt, rows, _ = read(f)
    assert fmt == "prompt_completion"
    assert [r["_where"] for r in rows] == [f"{f}:1", f"{f}:2"]


def test_broken_json_line_errors_with_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [PC[0], PC[1], '{"prompt": "x", "completion": ', PC[2]])
    with pytest.raises(RecipeError) as e:
        read(f)
    assert f"{f}:3: invalid JSON" in str(e.value)
    assert "on_bad_row: skip" in str(e.value)


def test_skip_mode_keeps_good_rows_and_reports_every_kind_of_bad_row(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [
        PC[0], "{not json", '["a list"]', {"prompt": "p", "completion": 5}, {"prompt": "p"},
        {"prompt": "p", "completion": "   "}, PC[1]])
    fmt, rows, bad = read(f, "skip")
    assert [r["completion"] for r in rows] == ["c0", "c1"]
    assert len(bad) == 5
    got = "\n".join(bad.items)
    for line, why in [(2, "invalid JSON"), (3, "expected a JSON object, got list"),
                      (4, "field 'completion' must be a string, got int"), (5, "missing field 'completion'"),
                      (6, "field 'completion' is empty")]:
        assert f"{f}:{line}: {why}" in got


def test_error_mode_reports_every_bad_row_at_once(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [PC[0], "{", "{", PC[1], "["])
    with pytest.raises(RecipeError) as e:
        read(f)
    assert [p.split(": ")[0] for p in e.value.problems[:3]] == [f"{f}:2", f"{f}:3", f"{f}:5"]


def test_json_array_rows_are_named_by_line(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('[\n  {"text": "red"},\n  {"text": ""},\n  {"text": "cat"}\n]\n')
    fmt, rows, bad = read(f, "skip")
    assert fmt == "text" and [r["_where"] for r in rows] == [f"{f}:2", f"{f}:4"]
    assert bad.items == [f"{f}:3: field 'text' is empty (format text)"]


def test_json_object_with_one_list_and_jsonl_named_json(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"version": 1, "data": PC[:3]}))
    assert len(read(f)[1]) == 3
    g = write_jsonl(tmp_path / "b.json", PC[:4])
    assert [r["_where"] for r in read(g)[1]][-1] == f"{g}:4"


def test_broken_json_array_is_an_error_even_in_skip_mode(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('[\n{"text": "a"},\n{"text": "b"\n{"text": "c"}]')
    with pytest.raises(RecipeError, match=r"a\.json:4: invalid JSON"):
        read(f, "skip")


def test_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    c = tmp_path / "a.csv"
    c.write_text('instruction,input,output\nsay red,,red\n"multi\nline",x,y\nonly,\n')
    fmt, rows, bad = read(c, "skip")
    assert fmt == "instruction" and "input" not in rows[0]  # empty cell = missing optional field
    assert [r["_where"] for r in rows] == [f"{c}:2", f"{c}:3"]
    assert bad.items == [f"{c}:5: missing field 'output' (format instruction)"]
    p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(PC[:3]), p)
    fmt, rows, _ = read(p)
    assert fmt == "prompt_completion" and rows[2]["_where"] == f"{p} row 2"


def test_folder_reads_every_data_file_in_order_and_skips_others(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", PC[2:4])
    write_jsonl(tmp_path / "a.jsonl", PC[:2])
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / ".hidden.jsonl").write_text("{broken")
    _, rows, _ = read(tmp_path)
    assert [r["completion"] for r in rows] == ["c0", "c1", "c2", "c3"]


def test_fields_rename_and_declared_format(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    fmt, rows, _ = read(f, format="instruction", fields={"instruction": "question", "output": "answer"})
    assert fmt == "instruction" and rows[0]["instruction"] == "q" and rows[0]["output"] == "a"
    with pytest.raises(RecipeError, match="cannot tell the format"):
        read(f)


def test_max_samples_stops_reading_early(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", PC + ["{broken"])
    assert len(read(f, max_samples=4)[1]) == 4  # the broken last line is never reached


@pytest.mark.parametrize("content, match", [
    (b"", "is empty"),
    ("\ufeff".encode("utf-16") + '{"text": "a"}\n'.encode("utf-16-le"), "UTF-16"),
])
def test_hostile_files_are_clean_errors(tmp_path, content, match):
    f = tmp_path / "a.jsonl"
    f.write_bytes(content)
    with pytest.raises(RecipeError, match=match):
        read(f)


def test_non_utf8_line_is_a_bad_row_and_a_bom_is_fine(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "fine"}\n')
    _, rows, bad = read(f, "skip")
    assert len(rows) == 2 and bad.items == [f"{f}:2: not UTF-8 text (byte 0xe9 at column 14)"]


def test_enormous_line_is_refused_without_reading_it_into_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "MAX_ROW_BYTES", 1000)
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps(PC[0]) + "\n" + '{"text": "' + "x" * 5000 + '"}\n' + json.dumps(PC[1]) + "\n")
    _, rows, bad = read(f, "skip")
    assert len(rows) == 2 and bad.items == [f"{f}:2: line longer than the limit of 1000 bytes"]


def test_all_rows_bad_in_skip_mode_names_the_source(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", ["{", "{"])
    with pytest.raises(RecipeError, match=r"data.sources\[0\].*no usable rows \(2 bad"):
        read(f, "skip")


def test_missing_path_and_unknown_suffix(tmp_path):
    with pytest.raises(RecipeError, match="no such file or folder"):
        read(tmp_path / "nope.jsonl")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(RecipeError, match="unknown file type"):
        read(tmp_path / "a.txt")


def test_missing_hub_dataset_is_a_clear_offline_error(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(RecipeError, match="not in the local cache"):
        read("someone/missing-set")


@pytest.fixture
def hub_caches(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


def test_hub_dataset_loaded_before_is_read_from_the_datasets_cache(hub_caches):
    """What `datasets.load_dataset("me/toy")` leaves behind on a machine with network: a processed
    cache under HF_DATASETS_CACHE/me___toy/<config>/<version>/<hash>/."""
    import shutil

    import datasets

    src = write_jsonl(hub_caches / "train.jsonl", PC[:3])
    builder = datasets.load_dataset_builder("json", data_files={"train": str(src)}, cache_dir=str(hub_caches / "b"))
    builder.download_and_prepare()
    built = next((hub_caches / "b" / "json").glob("*/*/*"))
    target = hub_caches / "datasets" / "me___toy" / "default" / "0.0.0" / built.name
    shutil.copytree(built, target)
    for f in target.glob("json-*.arrow"):
        f.rename(f.with_name(f.name.replace("json-", "toy-")))
    fmt, rows, _ = read("me/toy")
    assert fmt == "prompt_completion" and [r["completion"] for r in rows] == ["c0", "c1", "c2"]
    assert rows[1]["_where"] == "me/toy[train] row 1"
    with pytest.raises(RecipeError, match="Unknown split"):
        read("me/toy", split="validation")


def test_hub_snapshot_downloaded_with_hf_cli_is_read(hub_caches):
    """What `hf download me/snap --repo-type dataset` leaves: a snapshot in the hub cache."""
    repo = hub_caches / "hub" / "datasets--me--snap"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd" / "data").mkdir(parents=True)
    write_jsonl(repo / "snapshots" / "0123abcd" / "data" / "train.jsonl", PC[:2])
    fmt, rows, _ = read("me/snap")
    assert [r["completion"] for r in rows] == ["c0", "c1"]
