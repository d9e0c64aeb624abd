"""Reading rows: local files and folders (.jsonl/.json/.csv/.parquet), hub datasets from the local cache,
and the builtin set; format detection and per-row field checks.

Every row comes out as a dict with a `_where` key ("file.jsonl:7", "owner/name[train] row 12") so a bad
row can be named. A bad row (broken JSON, bad bytes, missing field, wrong type, empty text, a line over
MAX_ROW_BYTES) goes to `BadRows`: with `on_bad_row: error` the run stops with every bad row found
(exit 2, no traceback), with `skip` it is counted and the first few are reported. Problems that are not
one row's (missing file, empty file, UTF-16 file, unreadable parquet) are always RecipeErrors.
"""
from __future__ import annotations

import contextlib
import csv
import json
import re
from pathlib import Path
from typing import Iterator

from finetune.recipe import DataSource
from finetune.util.errors import RecipeError

# A single JSONL/CSV row above this size is refused rather than read into memory: 16 MiB is ~4M tokens of
# text, far beyond any context length, so such a line is a broken export, not a training example.
MAX_ROW_BYTES = 16 << 20
SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool"}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


class BadRows:
    """Collects bad rows; `check()` raises them all (error mode) once a stage is done."""

    SHOW = 5

    def __init__(self, mode: str):
        self.mode, self.items = mode, []

    def add(self, where: str, why: str):
        self.items.append(f"{where}: {why}")

    def check(self):
        if self.mode == "error" and self.items:
            more = len(self.items) - self.SHOW
            tail = [f"... and {more} more bad rows"] if more > 0 else []
            raise RecipeError(self.items[: self.SHOW] + tail
                              + ["(set data.on_bad_row: skip to skip bad rows and report them)"])

    def __len__(self):
        return len(self.items)


# ----------------------------------------------------------------------------------- formats


def detect_format(row: dict) -> str | None:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "instruction" in row and "output" in row:
        return "instruction"
    if "text" in row:
        return "text"
    return None


def _text(row: dict, key: str, required=True, allow_empty=False) -> str | None:
    if key not in row or row[key] is None:
        return f"missing field '{key}'" if required else None
    v = row[key]
    if not isinstance(v, str):
        return f"field '{key}' must be a string, got {type(v).__name__}"
    if not allow_empty and not v.strip():
        return f"field '{key}' is empty"
    return None


def _chat(msgs, key: str, role_key="role", content_key="content", roles=CHAT_ROLES) -> str | None:
    if not isinstance(msgs, list):
        return f"field '{key}' must be a list of messages, got {type(msgs).__name__}"
    if not msgs:
        return f"field '{key}' is empty"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"{key}[{i}] must be an object, got {type(m).__name__}"
        if m.get(role_key) not in roles:
            return f"{key}[{i}].{role_key} must be one of {sorted(roles)}, got {m.get(role_key)!r}"
        if not isinstance(m.get(content_key), str):
            return f"{key}[{i}].{content_key} must be a string, got {type(m.get(content_key)).__name__}"
    return None


def check_row(row: dict, fmt: str) -> str | None:
    """Why `row` cannot be used as `fmt`, or None when it can."""
    if fmt == "text":
        return _text(row, "text")
    if fmt == "prompt_completion":
        if isinstance(row.get("prompt"), list):  # conversational prompt/completion (TRL's layout)
            return _chat(row["prompt"], "prompt") or _chat(row.get("completion"), "completion")
        return _text(row, "prompt", allow_empty=True) or _text(row, "completion")
    if fmt == "instruction":
        return _text(row, "instruction") or _text(row, "input", required=False, allow_empty=True) \
            or _text(row, "output")
    if fmt == "messages":
        return _chat(row.get("messages"), "messages") if "messages" in row else "missing field 'messages'"
    if fmt == "sharegpt":
        if "conversations" not in row:
            return "missing field 'conversations'"
        return _chat(row["conversations"], "conversations", "from", "value", set(SHAREGPT_ROLES))
    return f"unknown format {fmt}"


# ----------------------------------------------------------------------------------- files


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8")


def _utf16(head: bytes) -> bool:
    return head.startswith((b"\xff\xfe", b"\xfe\xff"))


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


def _parse(where: str, text: str, bad: BadRows) -> dict | None:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        bad.add(where, f"invalid JSON: {e.msg} (column {e.colno})")
        return None
    except RecursionError:
        bad.add(where, "invalid JSON: nested too deeply")
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
            text = _decode(raw.rstrip(b"\r\n"))
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
    dec, n, i, first = json.JSONDecoder(), len(text), 1, True
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
        yield i, obj
        first, i = False, end


def read_json(path: Path, bad: BadRows) -> Iterator[dict]:
    """A JSON array of objects, or an object holding one list of them (e.g. {"data": [...]}). JSON Lines
    saved as .json is read as JSON Lines."""
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        text = _decode(raw)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise RecipeError([f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); re-encode the "
                           "file as UTF-8"]) from None
    start = _WS.match(text).end()
    if text[start:start + 1] == "{":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # several objects, one per line: JSON Lines named .json
                yield from read_jsonl(path, bad)
                return
            raise RecipeError([f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})"]) from None
        lists = [v for v in doc.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise RecipeError([f"{path}: a JSON object file must hold exactly one list of rows "
                               f"(found {len(lists)}); or write one object per line (.jsonl)"])
        items = ((None, x) for x in lists[0])
    elif text[start:start + 1] == "[":
        items = _json_items(text[start:])
    else:
        raise RecipeError([f"{path}: expected a JSON array of rows or JSON Lines, got "
                           f"{'an empty file' if start >= len(text) else repr(text[start])}"])
    pos, line = 0, text.count("\n", 0, start) + 1
    try:
        for k, (at, row) in enumerate(items):
            if at is not None:
                line += text.count("\n", start + pos, start + at)
                pos = at
            where = f"{path}:{line}" if at is not None else f"{path} row {k}"
            if not isinstance(row, dict):
                bad.add(where, f"expected a JSON object, got {type(row).__name__}")
                continue
            row["_where"] = where
            yield row
    except json.JSONDecodeError as e:  # a broken array cannot be resynchronised: the rest is unreadable
        line = text.count("\n", 0, start + e.pos) + 1
        raise RecipeError([f"{path}:{line}: invalid JSON: {e.msg}; a broken .json array cannot be read past "
                           "this point (fix it, or use JSON Lines, whose bad rows can be skipped)"]) from None


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


def source_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(x for x in p.rglob("*") if x.is_file() and x.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in x.relative_to(p).parts))
        if not files:
            raise RecipeError([f"data: folder {p} holds no {'/'.join(SUFFIXES)} files"])
        return files
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise RecipeError([f"data: {p}: unknown file type '{p.suffix}'; expected one of {', '.join(SUFFIXES)}"])
        return [p]
    raise RecipeError([f"data: no such file or folder: {path}"])


def read_file(path: Path, bad: BadRows) -> Iterator[dict]:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise RecipeError([f"data: cannot read {path}: {e.strerror}"]) from None
    if not head:
        raise RecipeError([f"data: {path} is empty"])
    if _utf16(head):
        raise RecipeError([f"data: {path} is UTF-16 text; re-encode it as UTF-8 "
                           f"(e.g. iconv -f UTF-16 -t UTF-8)"])
    yield from READERS[path.suffix.lower()](path, bad)


# ----------------------------------------------------------------------------------- hub and builtin


@contextlib.contextmanager
def _offline():
    """Hub datasets are read from the local caches only: data preparation runs inside a training job
    (main process first, others waiting), which is no place for a download that may hang on retries."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def load_hub(src: DataSource):
    """A hub dataset from the local cache: a dataset loaded before with `datasets.load_dataset` (its
    processed cache in HF_DATASETS_CACHE), else a snapshot fetched with `hf download --repo-type dataset`."""
    import datasets
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    with _offline():
        try:
            snapshot = snapshot_download(src.path, repo_type="dataset", local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            snapshot = None
        try:
            return datasets.load_dataset(snapshot or src.path, src.subset, split=src.split)
        except ValueError as e:  # unknown split or subset: the message lists the known ones
            raise RecipeError([f"data: {src.path}: {str(e).splitlines()[0]}"]) from None
        except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
            raise RecipeError([
                f"data: hub dataset '{src.path}' is not in the local cache ({type(e).__name__}); datasets are "
                f"read offline. Fetch it once where there is network (python -c \"import datasets; "
                f"datasets.load_dataset('{src.path}')\" or hf download {src.path} --repo-type dataset), "
                "or give a local file or folder"]) from None


def read_hub(src: DataSource, bad: BadRows) -> Iterator[dict]:
    ds = load_hub(src)
    for k, row in enumerate(ds):
        row = dict(row)
        row["_where"] = f"{src.path}[{src.split}] row {k}"
        yield row


def _is_hub_id(path: str) -> bool:
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not path.startswith((".", "~")) \
        and not Path(path).suffix.lower() in SUFFIXES


def iter_rows(src: DataSource, bad: BadRows) -> Iterator[dict]:
    if src.path.startswith("builtin:"):
        from finetune.util import builtin as tiny

        builder = tiny.BUILTIN_DATASETS.get(src.path)
        if builder is None:
            raise RecipeError([f"data: unknown builtin dataset '{src.path}'; known: {', '.join(tiny.BUILTIN_DATASETS)}"])
        f = builder() / f"{src.split}.jsonl"
        if not f.exists():
            raise RecipeError([f"data: builtin dataset {src.path} has no split '{src.split}'"])
        yield from read_jsonl(f, bad)
    elif Path(src.path).expanduser().exists() or not _is_hub_id(src.path):
        for f in source_files(src.path):
            yield from read_file(f, bad)
    else:
        yield from read_hub(src, bad)


def read_source(src: DataSource, bad: BadRows, label: str) -> tuple[str, list[dict]]:
    """(format, checked rows) of one source: fields renamed, format detected from the first row (unless
    declared), every row checked against it, at most `max_samples` good rows (in file order)."""
    fmt, rows, bad_before = src.format, [], len(bad)
    rename = {old: new for new, old in src.fields.items()}
    from datasets.utils import tqdm  # honours datasets' progress-bar switch; silent when not a terminal

    for row in tqdm(iter_rows(src, bad), desc=f"reading {src.path}", unit=" rows", leave=False, disable=None):
        if rename:
            row = {rename.get(k, k): v for k, v in row.items()}
        if fmt == "auto":
            fmt = detect_format(row)
            if fmt is None:
                keys = sorted(k for k in row if k != "_where")
                raise RecipeError([f"{label}: cannot tell the format of {row['_where']} from its fields {keys}; "
                                   f"set {label}.format (text, prompt_completion, instruction, messages, "
                                   f"sharegpt) and map names with {label}.fields"])
        why = check_row(row, fmt)
        if why:
            bad.add(row["_where"], f"{why} (format {fmt})")
            continue
        rows.append(row)
        if src.max_samples and len(rows) >= src.max_samples:
            break
    bad.check()  # error mode: stop here with every bad row of this source
    if not rows:
        n_bad = len(bad) - bad_before
        why = f"no usable rows ({n_bad} bad, first: {bad.items[bad_before]})" if n_bad else "no rows"
        raise RecipeError([f"{label}: {src.path}: {why}"])
    return fmt, rows
