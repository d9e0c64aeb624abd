"""Reading rows from files: .jsonl/.ndjson, .json (an array, an object holding one list, or JSON Lines
misnamed), .csv and .parquet.

Every row comes out as a dict with a `_where` key ("file.jsonl:7", "file.parquet row 12") so a bad row
can be named; bad rows go to `BadRows`. Problems that are not one row's (empty file, UTF-16 file,
unreadable parquet, a .json array broken midway) are always RecipeErrors.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Iterator

from finetune.data.formats import BadRows
from finetune.util.errors import RecipeError

# A single JSONL/CSV row above this size is refused rather than read into memory: 16 MiB is ~4M tokens of
# text, far beyond any context length, so such a line is a broken export, not a training example.
MAX_ROW_BYTES = 16 << 20


def _lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw line) with bounded memory; None for a line longer than MAX_ROW_BYTES."""
    with open(path, "rb") as f:
        lineno = 0
        while True:
            chunk = f.readline(MAX_ROW_BYTES + 1)
            if not chunk:
                return
            lineno += 1
            if len(chunk) > MAX_ROW_BYTES and not chunk.endswith(b"\n"):
                while chunk and not chunk.endswith(b"\n"):  # drain the rest of the giant line
                    chunk = f.readline(1 << 20)
                yield lineno, None
                continue
            yield lineno, chunk


def _int(digits: str) -> int | float:
    """JSON integers: Python refuses to convert more than 4300 digits (ValueError, not a JSON error); such a
    number becomes a float (inf), so it fails a row's type checks instead of crashing the reader."""
    return int(digits) if len(digits) <= 4000 else float(digits)


_DECODER = json.JSONDecoder(parse_int=_int)
# Valid UTF-8 cannot hold a UTF-16 surrogate, so one can only come from a JSON escape such as \ud800.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def surrogate_problem(text: str, row) -> str | None:
    """A lone surrogate (an escape like \\ud800 without its pair) cannot be encoded as UTF-8: the tokenizer
    and the cache would fail on it later. Checked only when the raw `text` holds such an escape."""
    if not text or not _SURROGATE_ESCAPE.search(text):
        return None
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape) is not text"
    return None


def _parse(where: str, text: str, bad: BadRows) -> dict | None:
    try:
        row = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        bad.add(where, f"invalid JSON: {e.msg} (column {e.colno})")
        return None
    except RecursionError:
        bad.add(where, "invalid JSON: nested too deeply")
        return None
    why = surrogate_problem(text, row)
    if why:
        bad.add(where, why)
        return None
    if not isinstance(row, dict):
        bad.add(where, f"expected a JSON object, got {type(row).__name__}")
        return None
    return row


def read_jsonl(path: Path, bad: BadRows) -> Iterator[dict]:
    for lineno, raw in _lines(path):
        where = f"{path}:{lineno}"
        if raw is None:
            bad.add(where, f"line longer than the limit of {MAX_ROW_BYTES} bytes")
            continue
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte-order mark (Windows editors)
        try:
            text = raw.rstrip(b"\r\n").decode("utf-8")
        except UnicodeDecodeError as e:
            bad.add(where, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
            continue
        if text.strip():
            row = _parse(where, text, bad)
            if row is not None:
                row["_where"] = where
                yield row


_WS = re.compile(r"[ \t\r\n]*")


def _json_items(text: str) -> Iterator[tuple[int, object]]:
    """(character position, item) for a JSON array (text starts with '['), item by item, so each row
    can be named by its line."""
    dec, n, i, first = _DECODER, len(text), 1, True
    while True:
        i = _WS.match(text, i).end()
        if i >= n:
            raise json.JSONDecodeError("unterminated array", text, i)
        if text[i] == "]":
            return
        if not first:
            if text[i] != ",":
                raise json.JSONDecodeError("expected ',' or ']'", text, i)
            i = _WS.match(text, i + 1).end()
        obj, end = dec.raw_decode(text, i)
        yield i, (obj, end - i, surrogate_problem(text[i:end], obj))
        first, i = False, end


def read_json(path: Path, bad: BadRows) -> Iterator[dict]:
    """A JSON array of objects, or an object holding one list of them (e.g. {"data": [...]}). JSON Lines
    saved as .json is read as JSON Lines."""
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise RecipeError([f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); re-encode the "
                           "file as UTF-8"]) from None
    start = _WS.match(text).end()
    if text[start:start + 1] == "{":
        try:
            doc = _DECODER.decode(text)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # several objects, one per line: JSON Lines named .json
                yield from read_jsonl(path, bad)
                return
            raise RecipeError([f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})"]) from None
        lists = [v for v in doc.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise RecipeError([f"{path}: a JSON object file must hold exactly one list of rows "
                               f"(found {len(lists)}); or write one object per line (.jsonl)"])
        escaped = text if _SURROGATE_ESCAPE.search(text) else ""  # searched once, not once per row
        items = ((None, (x, _size(x), surrogate_problem(escaped, x))) for x in lists[0])
    elif text[start:start + 1] == "[":
        items = _json_items(text[start:])
    else:
        raise RecipeError([f"{path}: expected a JSON array of rows or JSON Lines, got "
                           f"{'an empty file' if start >= len(text) else repr(text[start])}"])
    pos, line = 0, text.count("\n", 0, start) + 1
    try:
        for k, (at, (row, size, why)) in enumerate(items):
            if at is not None:
                line += text.count("\n", start + pos, start + at)
                pos = at
            where = f"{path}:{line}" if at is not None else f"{path} row {k}"
            if size > MAX_ROW_BYTES or why:  # the same limit as a JSON Lines row
                bad.add(where, why or f"row longer than the limit of {MAX_ROW_BYTES} bytes")
                continue
            if not isinstance(row, dict):
                bad.add(where, f"expected a JSON object, got {type(row).__name__}")
                continue
            row["_where"] = where
            yield row
    except json.JSONDecodeError as e:  # a broken array cannot be resynchronised: the rest is unreadable
        line = text.count("\n", 0, start + e.pos) + 1
        raise RecipeError([f"{path}:{line}: invalid JSON: {e.msg}; a broken .json array cannot be read past "
                           "this point (fix it, or use JSON Lines, whose bad rows can be skipped)"]) from None


def _size(obj, limit: int = MAX_ROW_BYTES) -> int:
    """Characters of text in a parsed row (its strings and keys), counted until past `limit`."""
    todo, n = [obj], 0
    while todo and n <= limit:
        x = todo.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            n += sum(len(str(k)) for k in x)
            todo += x.values()
        elif isinstance(x, list):
            todo += x
    return n


def read_csv(path: Path, bad: BadRows) -> Iterator[dict]:
    """Header row names the fields; every value is a string (empty cells count as missing)."""
    csv.field_size_limit(MAX_ROW_BYTES)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            if reader.fieldnames is None:
                return
            prev = reader.line_num
            for row in reader:
                where, prev = f"{path}:{prev + 1}", reader.line_num
                if None in row:  # more cells than header names
                    bad.add(where, f"{len(row[None]) + len(reader.fieldnames)} cells, the header has "
                                   f"{len(reader.fieldnames)}")
                    continue
                out = {k: v for k, v in row.items() if v not in (None, "")}
                out["_where"] = where
                yield out
        except UnicodeDecodeError as e:
            raise RecipeError([f"{path}:{reader.line_num + 1}: not UTF-8 text (byte {e.object[e.start]:#04x}); "
                               "re-encode the file as UTF-8"]) from None
        except csv.Error as e:
            raise RecipeError([f"{path}:{reader.line_num}: unreadable CSV: {e}"]) from None


def read_parquet(path: Path, bad: BadRows) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        k = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row["_where"] = f"{path} row {k}"
                k += 1
                yield row
    except (pa.ArrowException, OSError) as e:
        raise RecipeError([f"{path}: unreadable parquet: {str(e).splitlines()[0][:200]}"]) from None


READERS = {".jsonl": read_jsonl, ".ndjson": read_jsonl, ".json": read_json, ".csv": read_csv,
           ".parquet": read_parquet}
SUFFIXES = tuple(READERS)  # (".jsonl", ".ndjson", ".json", ".csv", ".parquet"), in the order messages list them


def described(path: Path) -> str:
    """`path`, and where it leads when it is a symbolic link (read by its own name's suffix, not the target's)."""
    import os

    return f"{path} (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else str(path)


def read_file(path: Path, bad: BadRows) -> Iterator[dict]:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise RecipeError([f"data: cannot read {described(path)}: {e.strerror}"]) from None
    if not head:
        raise RecipeError([f"data: {described(path)} is empty"])
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):  # a UTF-16 byte-order mark
        raise RecipeError([f"data: {described(path)} is UTF-16 text; re-encode it as UTF-8 "
                           f"(e.g. iconv -f UTF-16 -t UTF-8)"])
    yield from READERS[path.suffix.lower()](path, bad)

