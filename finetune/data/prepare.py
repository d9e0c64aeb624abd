"""Preparing a recipe's data: every source read, split into train and held-out rows, mixed by weight,
encoded (cached), filtered by the length policy, with stats.

Tokenizing is cached (datasets arrow files keyed by a fingerprint of rows, tokenizer and options), so a
second run or the other ranks of a node skip it. The encoded examples stay in that file, memory-mapped
(examples.Examples): every figure here is computed over it in batches, so preparing holds the rows' texts
and a few integers per row, not the token ids (docs/robustness.md, the scale section).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from array import array
from dataclasses import dataclass, field
from typing import Sequence

from finetune.data.bars import datasets_bars
from finetune.data.encode import ENCODER_VERSION, IGNORE, chat_layout, chat_template, encode_all
from finetune.data.examples import Examples, scan
from finetune.data.explain import length_figures, length_lines
from finetune.data.formats import BadRows, detect_format
from finetune.data.mixing import Rows, read_all
from finetune.recipe import DataSpec
from finetune.util.errors import RecipeError


@dataclass
class Prepared:
    train: Sequence[dict]  # Examples over the cache file (a list of dicts where tests build one)
    eval: Sequence[dict]
    eval_rows: list[dict]  # raw held-out rows, aligned with `eval`, for exact match
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- cached tokenizing


def _tokenizer_fingerprint(tok) -> list:
    backend = getattr(tok, "backend_tokenizer", None)
    return [type(tok).__name__, backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
            tok.chat_template, tok.bos_token_id, tok.eos_token_id, tok.special_tokens_map]


# Rows per map batch, and so per record batch of the cache file. Opening the file (datasets memory-maps
# it) reads every batch's header and the kernel maps the pages read ahead around each: with 256-row
# batches that was most of the file, resident from then on (49 of 85 MB for 200,000 short rows; measured
# in /proc/self/smaps); 10,000-row batches leave none of it (one batch is ~10 MB of Python lists meanwhile).
WRITER_BATCH = 10_000


def _features():
    """The cache file's column types: token ids as int32 (every vocabulary fits), half the bytes of the
    int64 that would be inferred, so the file and the pages read from it are smaller."""
    from datasets import Features, List, Value

    ids = List(Value("int32"))
    return Features({"input_ids": ids, "labels": ids, "rejected_ids": ids, "rejected_labels": ids,
                     "where": Value("string"), "error": Value("string"), "row": Value("int64"),
                     "parts": Value("int32"), "turns": Value("int32"), "check": Value("string"),
                     "length": Value("int64")})


def _encode_batch(batch: dict, indices: list[int], tok, spec: DataSpec, rows: Rows) -> dict:
    """Encodes the rows numbered in batch["n"], their texts read from `rows` here: the map's input is the
    row numbers alone, so the texts are never copied into a shuffled second table."""
    import jinja2

    keys = ("input_ids", "labels", "rejected_ids", "rejected_labels", "where", "error", "row", "parts", "turns",
            "check", "length")
    out = {k: [] for k in keys}
    cut = spec.max_seq_len + 1
    for (text, fmt), index in zip(rows.texts_of(batch["n"]), indices):
        row = json.loads(text)
        try:
            examples, err = encode_all(row, fmt, tok, spec), ""
        except (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError) as e:
            examples, err = [{"input_ids": [], "labels": []}], str(e).splitlines()[0][:400] or type(e).__name__
        for ex in examples:
            # Stored up to one token past max_seq_len: enough to tell a row is too long, and the cache stays
            # bounded per row whatever the row's size. Rejected ids are empty but for preference pairs.
            vals = (ex["input_ids"][:cut], ex["labels"][:cut], ex.get("rejected_ids", [])[:cut],
                    ex.get("rejected_labels", [])[:cut],
                    row.get("_where", "row"), err, index, len(examples), ex.get("turns", 0), ex.get("check", ""),
                    max(len(ex["input_ids"]), len(ex.get("rejected_ids", ()))))  # before the cut: the length report
            for k, v in zip(keys, vals):
                out[k].append(v)
    return out


def _texts_digest(rows: Rows, order: array) -> str:
    """A digest of the texts and formats of the rows numbered in `order`, in order, read in chunks (the rows
    are never one string)."""
    h = hashlib.sha256()
    for start in range(0, len(order), 65536):
        for text, fmt in rows.texts_of(order[start: start + 65536]):
            h.update(f"{fmt}\0{text}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def encode_cached(rows: Rows, order: array, tok, spec: DataSpec, what: str):
    """Tokenize the rows numbered in `order` through `datasets.Dataset.map`, cached under the finetune cache
    by a fingerprint of the rows, the tokenizer and the options that change the result. Returns the encoded
    Dataset: memory-mapped from the cache file, or in memory (Arrow, still compact) where the cache cannot
    be written. Failed rows come back with an `error` and empty ids. A row may give several examples (a
    chat whose template rewrites history): each names its position in `order` (`row`), how many its row
    gave (`parts`) and its chat turns checked (`turns`, `check`)."""
    import datasets
    import numpy as np
    from datasets.fingerprint import Hasher

    from finetune.plan.disk import data_cache_cap, data_cache_dir, probe_writable

    key = Hasher.hash([ENCODER_VERSION, _texts_digest(rows, order), _tokenizer_fingerprint(tok),
                       spec.train_on_inputs, chat_template(spec, tok), spec.max_seq_len, spec.prompt_template])
    cache = data_cache_dir() / f"{what}-{key}.arrow"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        unusable = probe_writable(cache.parent)
    except OSError as e:
        unusable = e.strerror or str(e)
    from finetune.util.log import log

    if unusable:  # a read-only or misplaced cache costs the cache, not the run
        log.warning(f"data cache: cannot write to {cache.parent} ({unusable}); tokenizing without a cache (set "
                    "FINETUNE_CACHE to a writable directory)")
    elif cache.exists():
        os.utime(cache)  # recently used: kept by the pruning below
    if unusable or not cache.exists():  # the work a bar shows on a terminal, said once in a log too
        kept = "" if unusable else f" (kept in {cache.parent} for the next run)"
        log.info(f"data: tokenizing {len(order):,} {what} rows{kept}")
    ds = datasets.Dataset.from_dict({"n": np.frombuffer(order, dtype=np.int64)})
    # Without a cache the examples stay in memory (keep_in_memory): Arrow buffers, not Python lists, so
    # still compact, but on the heap rather than memory-mapped.
    with datasets_bars():  # on a terminal only: a log or a captured stderr gets no bar frames
        out = ds.map(_encode_batch, batched=True, with_indices=True, batch_size=WRITER_BATCH, writer_batch_size=WRITER_BATCH,
                     fn_kwargs={"tok": tok, "spec": spec, "rows": rows}, remove_columns=["n"], features=_features(),
                     cache_file_name=None if unusable else str(cache), keep_in_memory=bool(unusable),
                     new_fingerprint=key, desc=f"tokenizing {what} rows")
    if not unusable:
        _USED.add(cache)
        prune_cache(cache.parent, _USED, data_cache_cap())
    del ds
    _release_arrow_memory()
    return out


def _release_arrow_memory() -> None:
    """Hand the arrow buffers of the map's input and batches back to the OS: pyarrow's allocator (mimalloc)
    would otherwise keep the freed pages for the rest of the run: measured 9-13 MiB of peak RSS on the tiny
    recipe's 4000 rows (benchmarks/peers/trl_sft.py)."""
    import pyarrow

    pyarrow.default_memory_pool().release_unused()


_USED: set = set()  # cache files this process uses: never pruned under it


def prune_cache(directory, keep: set, cap: int) -> list:
    """Remove the least recently used cache files until the directory holds at most `cap` bytes (the files
    in `keep` stay whatever their size). Returns the removed paths."""
    files = []
    for p in directory.glob("*.arrow"):
        try:
            st = p.stat()
        except FileNotFoundError:  # removed meanwhile by another run's pruning
            continue
        files.append((st.st_mtime, st.st_size, p))
    total, removed = sum(f[1] for f in files), []
    for _, size, p in sorted(files):
        if total <= cap:
            break
        if p in keep:
            continue
        p.unlink(missing_ok=True)
        total -= size
        removed.append(p)
    return removed


def _outside_vocab(ex: dict, vocab_size: int) -> str | None:
    """A token id (input or label: the loss indexes the logits by its labels, which fails as badly) that the
    model's embedding does not have; -100 (not trained) is no id."""
    for key in ("input_ids", "labels", "rejected_ids", "rejected_labels"):
        ids = [t for t in ex.get(key) or () if t != IGNORE]
        if ids and max(ids) >= vocab_size:
            field = "" if key == "input_ids" else f" in '{key}'"
            return f"token id {max(ids)}{field} is outside the model's vocabulary ({vocab_size} ids)"
    return None


def _keep(ds, spec: DataSpec, bad: BadRows, counts: dict, vocab_size: int | None = None) -> array:
    """Row numbers of the encoded examples in `ds` that train, after bad rows and the length policy (counted
    in `counts`; each kept example's untruncated length appended to counts["lengths"]), read in batches.
    With `vocab_size`, a token id the model's embedding does not have makes the row bad (on a GPU it would
    stop the run with a device-side assert, far from the row that caused it). Truncation happens when the
    examples are read (examples.Examples)."""
    kept, n = array("q"), 0
    for batch in scan(ds):
        for ex in (dict(zip(batch, vals)) for vals in zip(*batch.values())):
            n += 1
            err = ex["error"]
            if not err and vocab_size:
                err = _outside_vocab(ex, vocab_size)
            if err:
                bad.add(ex["where"], err)
                continue
            pair = bool(ex["rejected_ids"])  # a preference pair's rejected side exists only in pairs
            counts["lengths"].append(ex["length"])
            cut = max(len(ex["input_ids"]), len(ex["rejected_ids"])) > spec.max_seq_len
            if cut and spec.overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            labels = ex["labels"][: spec.max_seq_len]
            rejected = ex["rejected_labels"][: spec.max_seq_len]
            if pair and ex["input_ids"][: spec.max_seq_len] == ex["rejected_ids"][: spec.max_seq_len]:
                counts["identical_pairs"] += 1  # chosen == rejected as trained: a zero DPO/ORPO signal
                continue
            if all(t == IGNORE for t in labels[1:]) or (pair and all(t == IGNORE for t in rejected[1:])):
                counts["prompt_fills_max_seq_len" if cut else "no_trained_tokens"] += 1
                continue
            counts["truncated"] += cut
            kept.append(n - 1)
    return kept


def check_method(prepared: "Prepared", method: str) -> None:
    """Preference methods (dpo, orpo) train on preference pairs only, and sft on no pair: a mix would train
    half the rows with a loss they were not written for."""
    for what, examples in (("training", prepared.train), ("held-out", prepared.eval)):
        pairs = sum(1 for e in examples if "rejected_ids" in e)
        if method == "sft" and pairs:
            raise RecipeError([f"data: {pairs} {what} rows are preference pairs (chosen/rejected); set "
                               "train.method: dpo or orpo to train on them"])
        if method != "sft" and pairs < len(examples):
            first = next(e["where"] for e in examples if "rejected_ids" not in e)
            raise RecipeError([f"data: train.method {method} needs preference rows (prompt, chosen, rejected); "
                               f"{len(examples) - pairs} {what} rows are not, first: {first}"])


# ----------------------------------------------------------------------------------- preparing


def _check_templates(rows: Rows, spec: DataSpec, tok):
    if spec.prompt_template == "chat" and not chat_template(spec, tok):
        raise RecipeError(["data.prompt_template: chat renders rows with a chat template and the tokenizer has none; "
                           "set data.chat_template (a Jinja template or `chatml`) or data.prompt_template: raw"])
    if rows.any_chat() and not chat_template(spec, tok):
        raise RecipeError(["data.chat_template: the data has chat rows but the tokenizer has no chat template; "
                           "set data.chat_template to a Jinja template or `chatml`"])


def prepare(spec: DataSpec, tok, vocab_size: int | None = None) -> Prepared:
    """All sources -> mixed, shuffled, split, encoded (cached) train and eval examples, plus stats.
    `vocab_size` (the model's, when known) sizes synthetic token sources and bounds every row's ids."""
    bad = BadRows(spec.on_bad_row)
    rows = read_all(spec, bad, random.Random(spec.shuffle_seed), vocab_size)
    _check_templates(rows, spec, tok)
    counts = {"truncated": 0, "dropped_overlong": 0, "prompt_fills_max_seq_len": 0, "no_trained_tokens": 0,
              "identical_pairs": 0, "lengths": array("q")}
    encoded = encode_cached(rows, rows.train, tok, spec, "train")
    train = Examples(encoded, _keep(encoded, spec, bad, counts, vocab_size), spec.max_seq_len)
    evals, eval_rows = [], []
    if rows.held:
        encoded = encode_cached(rows, rows.held, tok, spec, "eval")
        evals = Examples(encoded, _keep(encoded, spec, bad, {**counts, "lengths": array("q")}, vocab_size),
                         spec.max_seq_len)
        # The raw held-out rows, for exact match: only these few are dicts again.
        eval_rows = [rows.row(rows.held[e["row"]]) for e in evals]
    counts.update(length_figures(counts.pop("lengths")))
    bad.check()
    if not train:
        raise RecipeError(["data: no training examples left after reading and filtering"
                           + (f" ({len(bad)} bad rows, first: {bad.first(1)[0]})" if bad else "")]
                          + length_lines(counts, spec.max_seq_len))
    # No packing statistics here: they pack every row (trl imported) for a figure only `finetune data`
    # shows, and it computes them itself (batching.batch_stats).
    stats = {"rows": len(train), "eval_rows": len(evals), "rows_skipped": len(bad), "bad_rows": bad.first(5),
             **counts, **token_stats(train), **chat_stats(train), "sources": rows.per_source,
             "prompt_layout": _prompt_layout(rows, spec, tok)}
    return Prepared(train, evals, eval_rows, stats)


def _prompt_layout(rows: Rows, spec: DataSpec, tok) -> str | None:
    """How text instruction and prompt/completion rows train ("chat" or "raw", encode.chat_layout), as the
    first trained row that is not a chat shows; None when there is none of those."""
    import numpy as np

    used = np.frombuffer(rows.train, dtype=np.int64)
    plain = used[~rows.chat[used]][:1]
    if not len(plain):
        return None
    text, fmt = rows.texts_of(plain)[0]
    fmt = detect_format(json.loads(text)) if fmt == "auto" else fmt
    if fmt not in ("instruction", "prompt_completion"):
        return None
    return "chat" if chat_layout(spec, tok) else "raw"


def token_stats(examples: Sequence[dict]) -> dict:
    """tokens, trained tokens (labels[1:] != -100, what the shifted loss counts) and lengths, in one pass."""
    n = tokens = trained = longest = 0
    for e in examples:
        length = len(e["input_ids"])
        n, tokens, longest = n + 1, tokens + length, max(longest, length)
        trained += sum(t != IGNORE for t in e["labels"][1:])
    return {"tokens": tokens, "trained_tokens": trained, "max_length": longest,
            "mean_length": round(tokens / max(n, 1), 2)}


def chat_stats(examples: Sequence[dict]) -> dict:
    """The inference-rendering check over the chat examples (chat.py): trained turns checked, those whose
    tokens differ (first five named), and the rows a history-rewriting template split into several examples."""
    bad, split, turns, differing, split_examples = [], set(), 0, 0, 0
    for e in examples:
        turns += e.get("turns", 0)
        if e.get("check"):
            differing += e["check"].count("; ") + 1
            bad.append(f"{e['where']}: {e['check']}")
        if e.get("parts", 1) > 1:
            split.add(e["row"])
            split_examples += 1
    return {"chat_turns_checked": turns, "chat_turns_differing": differing, "chat_differing": bad[:5],
            "chat_rows_split": len(split), "chat_split_examples": split_examples}
