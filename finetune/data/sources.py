"""Reading a recipe's data source: local files and folders (through readers.py), hub datasets from the
local cache, and the builtin set; then every row renamed, its format detected and checked (formats.py).

Problems that are not one row's (missing file, empty folder, unknown file type, a hub dataset not in
the cache, unknown builtin) are always RecipeErrors.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from finetune.data.formats import BadRows, check_row, detect_format, field_names
from finetune.data.readers import SUFFIXES, read_file, read_jsonl
from finetune.recipe import DataSource
from finetune.util.builtin import builtin_dir
from finetune.util.errors import RecipeError
from finetune.util.synthetic_names import is_synthetic_tokens, parse_tokens, token_rows


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
        and Path(path).suffix.lower() not in SUFFIXES


def is_saved_dataset(path: str) -> bool:
    """A folder `datasets`' save_to_disk wrote: a Dataset (state.json) or a DatasetDict (dataset_dict.json).
    Its .json files describe the arrow files; reading them as data would fail on a misleading row."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def read_saved(src: DataSource) -> Iterator[dict]:
    """The rows of a save_to_disk folder (datasets.load_from_disk); a DatasetDict gives its `split`."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(Path(src.path).expanduser()))
    except (OSError, ValueError) as e:
        raise RecipeError([f"data: {src.path}: a datasets save_to_disk folder that cannot be read: "
                           f"{str(e).splitlines()[0]}"]) from None
    if isinstance(ds, datasets.DatasetDict):
        if src.split not in ds:
            raise RecipeError([f"data: {src.path} is a DatasetDict without a split '{src.split}'; its splits: "
                               f"{', '.join(ds)}. Set the source's split (data.sources[0].split=NAME)"])
        ds = ds[src.split]
    for k, row in enumerate(ds):
        row = dict(row)
        row["_where"] = f"{src.path}[{src.split}] row {k}"
        yield row


def synthetic_rows(src: DataSource, vocab_size: int | None) -> Iterator[dict]:
    opts = parse_tokens(src.path)
    vocab = opts["vocab"] or vocab_size
    if not vocab:
        raise RecipeError([f"data: {src.path}: the model's vocabulary size is not known here; add vocab=N"])
    for i, row in enumerate(token_rows(opts, src.split, vocab)):
        row["_where"] = f"{src.path} row {i + 1}"
        yield row


def iter_rows(src: DataSource, bad: BadRows, vocab_size: int | None = None) -> Iterator[dict]:
    if is_synthetic_tokens(src.path):
        yield from synthetic_rows(src, vocab_size)
    elif src.path.startswith("builtin:"):
        f = builtin_dir(src.path, "data", kind="dataset") / f"{src.split}.jsonl"
        if not f.exists():
            raise RecipeError([f"data: builtin dataset {src.path} has no split '{src.split}'"])
        yield from read_jsonl(f, bad)
    elif is_saved_dataset(src.path):
        yield from read_saved(src)
    elif Path(src.path).expanduser().exists() or not _is_hub_id(src.path):
        for f in source_files(src.path):
            yield from read_file(f, bad)
    else:
        yield from read_hub(src, bad)


def read_source(src: DataSource, bad: BadRows, label: str, vocab_size: int | None = None) -> tuple[str, list[dict]]:
    """(format, checked rows) of one source: fields renamed, format detected from the first row (unless
    declared), every row checked against it, at most `max_samples` good rows (in file order)."""
    fmt, rows = src.format, []
    for fmt, row in checked_rows(src, bad, label, vocab_size):
        rows.append(row)
    return fmt, rows


def _described(where: str) -> str:
    """A row's place (file:line, file row N), with where its file leads when that is a symbolic link."""
    import re

    path = re.sub(r"(:\d+| row \d+)$", "", where)
    if not Path(path).is_symlink():
        return where
    return f"{where} ({path} is a symbolic link to {os.path.realpath(path)}, read as {Path(path).suffix} for its name)"


def checked_rows(src: DataSource, bad: BadRows, label: str, vocab_size: int | None = None) -> Iterator[tuple[str, dict]]:
    """read_source one row at a time, as (format, row): a caller that keeps each row compactly never holds
    them all as dicts (2 million short rows are about 1 GB of dicts)."""
    fmt, n, bad_before = src.format, 0, len(bad)
    rename = {old: new for new, old in src.fields.items()}
    from datasets.utils import tqdm  # honours datasets' progress-bar switch; silent when not a terminal

    for row in tqdm(iter_rows(src, bad, vocab_size), desc=f"reading {src.path}", unit=" rows", leave=False, disable=None):
        if rename:
            row = {rename.get(k, k): v for k, v in row.items()}
        if fmt == "auto":
            fmt = detect_format(row)
            if fmt is None:  # never the row itself: from a file of another kind its "fields" are its text
                raise RecipeError([f"{label}: cannot tell the format of {_described(row['_where'])}: its first row "
                                   f"has {field_names(row)}; set {label}.format (text, prompt_completion, "
                                   f"instruction, messages, sharegpt, tokens) and map names with {label}.fields"])
        why = check_row(row, fmt)
        if why:
            bad.add(row["_where"], f"{why} (format {fmt})")
            continue
        n += 1
        yield fmt, row
        if src.max_samples and n >= src.max_samples:
            break
    bad.check()  # error mode: stop here with every bad row of this source
    if not n:
        n_bad = len(bad) - bad_before
        why = f"no usable rows ({n_bad} bad, first: {bad.items[bad_before]})" if n_bad else "no rows"
        raise RecipeError([f"{label}: {src.path}: {why}"])
