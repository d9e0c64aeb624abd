"""Hostile data files: empty, wrongly encoded, binary, one enormous line, random bytes. Reading them
gives rows or a RecipeError naming the file (exit 2 in the CLI), never another exception."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune.data import formats as F
from finetune.data import prepare as P
from finetune.data import readers as R
from finetune.data import sources as S
from finetune.recipe import DataSource, from_dict
from finetune.util import builtin as tiny
from finetune.util.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
GIANT = R.MAX_ROW_BYTES + 1024  # one line just past the reader's limit
pytestmark = pytest.mark.slow


def read(path: Path, mode: str = "error"):
    """Rows of one source, or the RecipeError's problems."""
    try:
        return S.read_source(DataSource(path=str(path)), F.BadRows(mode), "data.sources[0]")[1]
    except RecipeError as e:
        assert e.problems and all(isinstance(p, str) for p in e.problems)
        return e.problems


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.ASSETS / f"tiny-llama-{tiny.VERSION}"))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))


HOSTILE = {
    "empty.jsonl": b"",
    "blank.jsonl": b"\n \n\t\n",
    "latin1.jsonl": '{"text": "caf\xe9 cr\xe8me"}\n'.encode("latin-1"),
    "utf16.jsonl": '{"text": "hello"}\n'.encode("utf-16"),
    "utf16be.json": '[{"text": "hello"}]'.encode("utf-16-be"),
    "binary.jsonl": bytes(range(256)) * 4,
    "nul.jsonl": b"\x00" * 64 + b"\n",
    "latin1.csv": "text\ncaf\xe9\n".encode("latin-1"),
    "empty.csv": b"",
    "header_only.csv": b"text\n",
    "empty.json": b"",
    "scalar.json": b"42",
    "garbage.parquet": b"PAR1" + bytes(100) + b"PAR1",
    "empty.parquet": b"",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_files_are_validation_errors(tmp_path, tok, cache, name):
    p = tmp_path / name
    p.write_bytes(HOSTILE[name])
    for mode in ("error", "skip"):
        spec = from_dict({"data": {"sources": [{"path": str(p)}], "on_bad_row": mode}}).data
        with pytest.raises(RecipeError) as e:
            P.prepare(spec, tok)
        assert name in "\n".join(e.value.problems), e.value.problems


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_a_single_enormous_line(tmp_path, tok, cache, suffix):
    """One line of 16 MiB + 1 KiB, no newline: refused by name with bounded memory, not read whole."""
    p = tmp_path / f"giant{suffix}"
    with open(p, "wb") as f:
        f.write({".jsonl": b'{"text": "', ".csv": b'text\n"', ".json": b'[{"text": "'}[suffix])
        f.write(b"a" * GIANT)
    spec = from_dict({"data": {"sources": [{"path": str(p)}]}}).data
    with pytest.raises(RecipeError) as e:
        P.prepare(spec, tok)
    text = "\n".join(e.value.problems)
    assert p.name in text and ("limit" in text or "invalid JSON" in text or "larger" in text), text


def test_good_rows_around_an_enormous_line_are_kept_in_skip_mode(tmp_path):
    p = tmp_path / "mixed.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "first row"}\n{"text": "' + b"b" * GIANT + b'"}\n{"text": "last row"}\n')
    rows = read(p, "skip")
    assert [r["text"] for r in rows] == ["first row", "last row"]
    problems = read(p, "error")
    assert any("mixed.jsonl:2" in x and "limit" in x for x in problems), problems


@settings(max_examples=240, **SETTINGS)
@given(st.sampled_from([".jsonl", ".json", ".csv", ".parquet"]), st.binary(max_size=400),
       st.sampled_from(["error", "skip"]))
def test_random_bytes(tmp_path_factory, suffix, raw, mode):
    p = tmp_path_factory.mktemp("d") / f"x{suffix}"
    p.write_bytes(raw)
    out = read(p, mode)
    assert isinstance(out, list)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                               st.sampled_from(["text", "prompt", "completion", "messages", "role", "content",
                                                "instruction", "output", "input", "conversations", "from",
                                                "value", "x"]), inner, max_size=4), max_leaves=10)


@settings(max_examples=200, **SETTINGS)
@given(st.lists(json_values, min_size=1, max_size=6), st.sampled_from(["error", "skip"]),
       st.sampled_from(["auto", "text", "prompt_completion", "messages", "sharegpt", "instruction"]))
def test_random_json_rows(tmp_path_factory, rows, mode, fmt):
    """Well-formed JSON of the wrong shape: every row is either used or reported, per the format."""
    p = tmp_path_factory.mktemp("j") / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        fmt_out, got = S.read_source(DataSource(path=str(p), format=fmt), F.BadRows(mode), "data.sources[0]")
    except RecipeError:
        return
    assert got and all(F.check_row(r, fmt_out) is None for r in got)


@pytest.mark.parametrize("name", ["utf16.jsonl"])  # one: each CLI start costs seconds of imports
def test_cli_data_verb_exits_2_without_traceback(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(HOSTILE[name])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"sources": [{"path": str(p)}]}}))
    out = subprocess.run([sys.executable, "-m", "finetune", "data", str(recipe)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "FINETUNE_CACHE": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and name in out.stderr
