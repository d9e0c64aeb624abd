"""Preparing a recipe's data: every source read, split into train and held-out rows, mixed by weight,
encoded (cached), filtered by the length policy, with stats.

Tokenizing is cached (datasets arrow files keyed by a fingerprint of rows, tokenizer and options), so a
second run or the other ranks of a node skip it.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

from finetune.data.encode import ENCODER_VERSION, IGNORE, chat_template, encode_all
from finetune.data.explain import length_figures, length_lines
from finetune.data.formats import BadRows
from finetune.data.sources import read_source
from finetune.recipe import DataSpec
from finetune.util.errors import RecipeError


@dataclass
class Prepared:
    train: list[dict]
    eval: list[dict]
    eval_rows: list[dict]  # raw held-out rows, aligned with `eval`, for exact match
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- cached tokenizing


def _tokenizer_fingerprint(tok) -> list:
    backend = getattr(tok, "backend_tokenizer", None)
    return [type(tok).__name__, backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
            tok.chat_template, tok.bos_token_id, tok.eos_token_id, tok.special_tokens_map]


def _encode_batch(batch: dict, indices: list[int], tok, spec: DataSpec) -> dict:
    import jinja2

    keys = ("input_ids", "labels", "rejected_ids", "rejected_labels", "where", "error", "row", "parts", "turns",
            "check", "length")
    out = {k: [] for k in keys}
    cut = spec.max_seq_len + 1
    for text, fmt, index in zip(batch["row"], batch["fmt"], indices):
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


def encode_cached(pairs: list[tuple[str, dict]], tok, spec: DataSpec, what: str) -> list[dict]:
    """Tokenize (format, row) pairs through `datasets.Dataset.map`, cached under the finetune cache by a
    fingerprint of the rows, the tokenizer and the options that change the result. Failed rows come back
    with an `error` and empty ids. A row may give several examples (a chat whose template rewrites history):
    each names its pair (`row`), how many its row gave (`parts`) and its chat turns checked (`turns`, `check`)."""
    import datasets
    from datasets.fingerprint import Hasher

    from finetune.plan.disk import data_cache_cap, data_cache_dir, probe_writable

    texts = [json.dumps(r, ensure_ascii=False, sort_keys=True, default=str) for _, r in pairs]
    fmts = [f for f, _ in pairs]
    key = Hasher.hash([ENCODER_VERSION, texts, fmts, _tokenizer_fingerprint(tok), spec.train_on_inputs,
                       chat_template(spec, tok), spec.max_seq_len, spec.prompt_template])
    cache = data_cache_dir() / f"{what}-{key}.arrow"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        unusable = probe_writable(cache.parent)
    except OSError as e:
        unusable = e.strerror or str(e)
    if unusable:  # a read-only or misplaced cache costs the cache, not the run
        from finetune.util.log import log

        log.warning(f"data cache: cannot write to {cache.parent} ({unusable}); tokenizing without a cache (set "
                    "FINETUNE_CACHE to a writable directory)")
    elif cache.exists():
        os.utime(cache)  # recently used: kept by the pruning below
    ds = datasets.Dataset.from_dict({"row": texts, "fmt": fmts})
    out = ds.map(_encode_batch, batched=True, with_indices=True, batch_size=256, fn_kwargs={"tok": tok, "spec": spec},
                 remove_columns=["row", "fmt"], cache_file_name=None if unusable else str(cache),
                 keep_in_memory=bool(unusable), new_fingerprint=key, desc=f"tokenizing {what} rows")
    if not unusable:
        _USED.add(cache)
        prune_cache(cache.parent, _USED, data_cache_cap())
    cols = out.to_dict()
    del ds, out
    _release_arrow_memory()
    return [dict(zip(cols, vals)) for vals in zip(*cols.values())]


def _release_arrow_memory() -> None:
    """Hand the arrow buffers of the map back to the OS. The rows are Python lists now; pyarrow's allocator
    (mimalloc) would otherwise keep the freed pages for the rest of the run: measured 9-13 MiB of peak RSS
    on the tiny recipe's 4000 rows (benchmarks/trl_sft.py)."""
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


def _keep(examples: list[dict], spec: DataSpec, bad: BadRows, counts: dict, vocab_size: int | None = None) -> list[int]:
    """Indices of examples that train, after bad rows and the length policy (counted in `counts`). With
    `vocab_size`, a token id the model's embedding does not have makes the row bad (on a GPU it would
    stop the run with a device-side assert, far from the row that caused it)."""
    kept = []
    for i, ex in enumerate(examples):
        err = ex.pop("error")
        if not err and vocab_size:
            err = _outside_vocab(ex, vocab_size)
        if err:
            bad.add(ex["where"], err)
            continue
        pair = bool(ex.get("rejected_ids"))
        if not pair:  # a preference pair's rejected side exists only in pairs
            ex.pop("rejected_ids", None), ex.pop("rejected_labels", None)
        counts["lengths"].append(ex.pop("length"))
        cut = max(len(ex["input_ids"]), len(ex.get("rejected_ids", ()))) > spec.max_seq_len
        if cut:
            if spec.overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            for k in ("input_ids", "labels", "rejected_ids", "rejected_labels")[: 4 if pair else 2]:
                ex[k] = ex[k][: spec.max_seq_len]
        if all(t == IGNORE for t in ex["labels"][1:]) or (pair and all(t == IGNORE for t in ex["rejected_labels"][1:])):
            counts["prompt_fills_max_seq_len" if cut else "no_trained_tokens"] += 1
            continue
        counts["truncated"] += cut
        kept.append(i)
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


def _weighted(rows: list, weight: float, rng: random.Random) -> list:
    """weight x rows: whole copies, plus a seeded sample for the fraction."""
    whole, frac = int(weight), weight - int(weight)
    return rows * whole + rng.sample(rows, round(frac * len(rows)))


def _read_all(spec: DataSpec, bad: BadRows, rng: random.Random, vocab_size: int | None = None):
    """(train pairs, eval pairs, per-source stats). Each source is split before weighting, so a repeated
    row can never sit on both sides of the split."""
    train, held, per_source = [], [], []
    for i, src in enumerate(spec.sources):
        fmt, rows = read_source(src, bad, f"data.sources[{i}]", vocab_size)
        rng.shuffle(rows)
        n_eval = 0
        if not spec.eval_sources and spec.eval_split > 0 and len(rows) > 1:
            n_eval = min(len(rows) - 1, max(1, round(len(rows) * spec.eval_split)))
            held += [(fmt, r) for r in rows[:n_eval]]
        mixed = _weighted(rows[n_eval:], src.weight, rng)
        train += [(fmt, r) for r in mixed]
        per_source.append({"path": src.path, "format": fmt, "rows_read": len(rows), "rows_eval": n_eval,
                           "rows_train": len(mixed), "weight": src.weight})
    for i, src in enumerate(spec.eval_sources):
        fmt, rows = read_source(src, bad, f"data.eval_sources[{i}]", vocab_size)
        held += [(fmt, r) for r in rows]
    if len(spec.sources) > 1:  # interleave the sources (one source is already in shuffled order)
        rng.shuffle(train)
    return train[: spec.max_samples] if spec.max_samples else train, held, per_source


def _check_templates(pairs, spec: DataSpec, tok):
    chat = any(f in ("messages", "sharegpt") or (f in ("prompt_completion", "preference", "auto")
                                                 and isinstance(r.get("prompt", r.get("chosen")), list))
               for f, r in pairs)
    if spec.prompt_template == "chat" and not chat_template(spec, tok):
        raise RecipeError(["data.prompt_template: chat renders rows with a chat template and the tokenizer has none; "
                           "set data.chat_template (a Jinja template or `chatml`) or data.prompt_template: raw"])
    if chat and not chat_template(spec, tok):
        raise RecipeError(["data.chat_template: the data has chat rows but the tokenizer has no chat template; "
                           "set data.chat_template to a Jinja template or `chatml`"])


def prepare(spec: DataSpec, tok, vocab_size: int | None = None) -> Prepared:
    """All sources -> mixed, shuffled, split, encoded (cached) train and eval examples, plus stats.
    `vocab_size` (the model's, when known) sizes synthetic token sources and bounds every row's ids."""
    bad = BadRows(spec.on_bad_row)
    train_pairs, eval_pairs, per_source = _read_all(spec, bad, random.Random(spec.shuffle_seed), vocab_size)
    _check_templates(train_pairs + eval_pairs, spec, tok)
    counts = {"truncated": 0, "dropped_overlong": 0, "prompt_fills_max_seq_len": 0, "no_trained_tokens": 0,
              "lengths": []}
    train = encode_cached(train_pairs, tok, spec, "train")
    train = [train[i] for i in _keep(train, spec, bad, counts, vocab_size)]
    evals = encode_cached(eval_pairs, tok, spec, "eval") if eval_pairs else []
    kept = _keep(evals, spec, bad, {**counts, "lengths": []}, vocab_size)
    counts.update(length_figures(counts.pop("lengths")))
    evals, eval_rows = [evals[i] for i in kept], [eval_pairs[evals[i]["row"]][1] for i in kept]
    bad.check()
    if not train:
        raise RecipeError(["data: no training examples left after reading and filtering"
                           + (f" ({len(bad)} bad rows, first: {bad.first(1)[0]})" if bad else "")]
                          + length_lines(counts, spec.max_seq_len))
    # No packing statistics here: they pack every row (a second copy of the data, and trl imported) for a
    # figure only `finetune data` shows, and it computes them itself (batching.batch_stats).
    stats = {"rows": len(train), "eval_rows": len(evals), "rows_skipped": len(bad), "bad_rows": bad.first(5),
             **counts, **token_stats(train), **chat_stats(train), "sources": per_source}
    return Prepared(train, evals, eval_rows, stats)


def token_stats(examples: list[dict]) -> dict:
    """tokens, trained tokens (labels[1:] != -100, what the shifted loss counts) and lengths."""
    lengths = [len(e["input_ids"]) for e in examples]
    return {"tokens": sum(lengths), "trained_tokens": sum(sum(t != IGNORE for t in e["labels"][1:]) for e in examples),
            "max_length": max(lengths, default=0), "mean_length": round(sum(lengths) / max(len(lengths), 1), 2)}



def chat_stats(examples: list[dict]) -> dict:
    """The inference-rendering check over the chat examples (chat.py): trained turns checked, those whose
    tokens differ (first five named), and the rows a history-rewriting template split into several examples."""
    bad = [f"{e['where']}: {e['check']}" for e in examples if e.get("check")]
    split = {e["row"] for e in examples if e.get("parts", 1) > 1}
    return {"chat_turns_checked": sum(e.get("turns", 0) for e in examples),
            "chat_turns_differing": sum(e["check"].count("; ") + 1 for e in examples if e.get("check")),
            "chat_differing": bad[:5], "chat_rows_split": len(split),
            "chat_split_examples": sum(1 for e in examples if e.get("parts", 1) > 1)}
