"""Data: rows -> token ids with loss labels -> batches (dynamically padded, or packed without padding).

An example is {"input_ids": [...], "labels": [...]} where labels are -100 on tokens that do not train
(prompts, user turns, templates' headers) so the loss covers exactly the completion / assistant spans.
Reading and row checks live in sources.py; tokenizing is cached (datasets arrow files keyed by a
fingerprint of rows, tokenizer and options), so a second run or the other ranks of a node skip it.
"""
from __future__ import annotations

import contextlib
import json
import random
import re
from dataclasses import dataclass, field

import torch

from finetune.recipe import DataSpec
from finetune.util.errors import RecipeError
from finetune.data.sources import SHAREGPT_ROLES, BadRows, detect_format, read_source

IGNORE = -100
ENCODER_VERSION = 2  # part of the cache key: bump when encode() changes what it produces

# ChatML, for tokenizers without a template of their own (`data.chat_template: chatml`).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class Prepared:
    train: list[dict]
    eval: list[dict]
    eval_rows: list[dict]  # raw held-out rows, aligned with `eval`, for exact match
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- encoding


def chat_template(spec: DataSpec, tok) -> str | None:
    if spec.chat_template == "chatml":
        return CHATML
    return spec.chat_template or getattr(tok, "chat_template", None)


def instruction_prompt(row: dict) -> str:
    """Alpaca-style fields as one prompt (the same layout `finetune eval` prompts with)."""
    return row["instruction"] + ("\n" + row["input"] if row.get("input") else "") + "\n"


def _ids(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def _prompt_completion(tok, prompt: str, completion: str, train_on_inputs: bool) -> dict:
    # Prompt and completion are tokenized apart, as at inference (the prompt alone, then generation),
    # so the boundary is exact and no completion token is lost to a merge with the prompt's last bytes.
    p = _ids(tok, prompt, special=True)
    c = _ids(tok, completion, special=False) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    labels = (p if train_on_inputs else [IGNORE] * len(p)) + c
    return {"input_ids": p + c, "labels": labels}


def _chat(tok, messages: list[dict], template: str | None, train_on_inputs: bool, first_trained=None) -> dict:
    """Render a chat and train on its assistant turns (or, for conversational prompt/completion, on the
    messages from `first_trained` on). A template with {% generation %} marks the trained tokens itself;
    otherwise each trained turn's characters are found by rendering the chat up to before and after it,
    and the tokens of the full rendering whose first character falls there are trained."""
    if not template:
        raise ValueError("chat data needs a chat template: the tokenizer has none; set data.chat_template "
                         "(a Jinja template, or `chatml`)")
    render = lambda msgs, gen=False: tok.apply_chat_template(  # noqa: E731
        msgs, chat_template=template, tokenize=False, add_generation_prompt=gen)
    if first_trained is None and _GENERATION_TAG.search(template):
        enc = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), enc["assistant_masks"]
        return {"input_ids": ids, "labels": [t if (m or train_on_inputs) else IGNORE for t, m in zip(ids, mask)]}
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if (m["role"] == "assistant") if first_trained is None else (i >= first_trained):
            upto = render(messages[: i + 1])
            # transformers cannot render an empty chat: for a first message, its header ends where its content starts
            head = render(messages[:i], gen=m["role"] == "assistant") if i else upto[: max(upto.find(m["content"]), 0)]
            if not (full.startswith(upto) and upto.startswith(head)):
                raise ValueError("the chat template does not render the start of a chat as a prefix of the "
                                 "whole (it rewrites earlier turns); give it {% generation %} markers")
            spans.append((len(head), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if train_on_inputs or any(a <= s < b for a, b in spans) else IGNORE
              for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    return {"input_ids": list(enc["input_ids"]), "labels": labels}


def encode(row: dict, fmt: str, tok, spec: DataSpec) -> dict:
    """One row -> {"input_ids", "labels"}. Raises ValueError for a row that does not fit `fmt`."""
    fmt = (detect_format(row) or "unknown") if fmt == "auto" else fmt
    template = chat_template(spec, tok)
    if fmt == "prompt_completion":
        if isinstance(row.get("prompt"), list):  # conversational: train on the completion messages
            return _chat(tok, row["prompt"] + row["completion"], template, spec.train_on_inputs,
                         first_trained=len(row["prompt"]))
        return _prompt_completion(tok, _str(row, "prompt"), _str(row, "completion"), spec.train_on_inputs)
    if fmt == "instruction":
        _str(row, "instruction")
        return _prompt_completion(tok, instruction_prompt(row), _str(row, "output"), spec.train_on_inputs)
    if fmt == "messages":
        return _chat(tok, row["messages"], template, spec.train_on_inputs)
    if fmt == "sharegpt":
        msgs = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                for t in row["conversations"]]
        return _chat(tok, msgs, template, spec.train_on_inputs)
    if fmt == "text":  # continued pretraining: every token trains
        ids = _ids(tok, _str(row, "text"), special=True) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        return {"input_ids": ids, "labels": list(ids)}
    raise ValueError(f"unknown format {fmt}")


def _str(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is missing or not a string")
    if not v.strip() and key in ("completion", "output", "text", "instruction"):
        raise ValueError(f"field '{key}' is empty")
    return v


# ----------------------------------------------------------------------------------- cached tokenizing


@contextlib.contextmanager
def _quiet(quiet: bool = True):
    """Hide datasets' progress bars for internal, fast passes (packing runs every epoch)."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    if quiet and was:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and was:
            datasets.enable_progress_bars()


def _tokenizer_fingerprint(tok) -> list:
    backend = getattr(tok, "backend_tokenizer", None)
    return [type(tok).__name__, backend.to_str() if backend is not None else sorted(tok.get_vocab().items()),
            tok.chat_template, tok.bos_token_id, tok.eos_token_id, tok.special_tokens_map]


def _encode_batch(batch: dict, tok, spec: DataSpec) -> dict:
    import jinja2

    out = {"input_ids": [], "labels": [], "where": [], "error": []}
    for text, fmt in zip(batch["row"], batch["fmt"]):
        row = json.loads(text)
        try:
            ex, err = encode(row, fmt, tok, spec), ""
        except (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError) as e:
            ex, err = {"input_ids": [], "labels": []}, str(e).splitlines()[0][:300] or type(e).__name__
        out["input_ids"].append(ex["input_ids"])
        out["labels"].append(ex["labels"])
        out["where"].append(row.get("_where", "row"))
        out["error"].append(err)
    return out


def encode_cached(pairs: list[tuple[str, dict]], tok, spec: DataSpec, what: str) -> list[dict]:
    """Tokenize (format, row) pairs through `datasets.Dataset.map`, cached under the finetune cache by a
    fingerprint of the rows, the tokenizer and the options that change the result. Failed rows come back
    with an `error` and empty ids."""
    import datasets
    from datasets.fingerprint import Hasher

    from finetune.util.builtin import cache_root

    texts = [json.dumps(r, ensure_ascii=False, sort_keys=True, default=str) for _, r in pairs]
    fmts = [f for f, _ in pairs]
    key = Hasher.hash([ENCODER_VERSION, texts, fmts, _tokenizer_fingerprint(tok), spec.train_on_inputs,
                       chat_template(spec, tok)])
    cache = cache_root() / "data" / f"{what}-{key}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict({"row": texts, "fmt": fmts})
    out = ds.map(_encode_batch, batched=True, batch_size=256, fn_kwargs={"tok": tok, "spec": spec},
                 remove_columns=["row", "fmt"], cache_file_name=str(cache), new_fingerprint=key,
                 desc=f"tokenizing {what} rows")
    cols = out.to_dict()
    return [{"input_ids": i, "labels": lab, "where": w, "error": e}
            for i, lab, w, e in zip(cols["input_ids"], cols["labels"], cols["where"], cols["error"])]


def _keep(examples: list[dict], spec: DataSpec, bad: BadRows, counts: dict) -> list[int]:
    """Indices of examples that train, after bad rows and the length policy (counted in `counts`)."""
    kept = []
    for i, ex in enumerate(examples):
        err = ex.pop("error")
        if err:
            bad.add(ex["where"], err)
            continue
        if len(ex["input_ids"]) > spec.max_seq_len:
            if spec.overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            counts["truncated"] += 1
            ex["input_ids"], ex["labels"] = ex["input_ids"][: spec.max_seq_len], ex["labels"][: spec.max_seq_len]
        if all(t == IGNORE for t in ex["labels"][1:]):
            counts["no_trained_tokens"] += 1
            continue
        kept.append(i)
    return kept


# ----------------------------------------------------------------------------------- preparing


def _weighted(rows: list, weight: float, rng: random.Random) -> list:
    """weight x rows: whole copies, plus a seeded sample for the fraction."""
    whole, frac = int(weight), weight - int(weight)
    return rows * whole + rng.sample(rows, round(frac * len(rows)))


def _read_all(spec: DataSpec, bad: BadRows, rng: random.Random):
    """(train pairs, eval pairs, per-source stats). Each source is split before weighting, so a repeated
    row can never sit on both sides of the split."""
    train, held, per_source = [], [], []
    for i, src in enumerate(spec.sources):
        fmt, rows = read_source(src, bad, f"data.sources[{i}]")
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
        fmt, rows = read_source(src, bad, f"data.eval_sources[{i}]")
        held += [(fmt, r) for r in rows]
    if len(spec.sources) > 1:  # interleave the sources (one source is already in shuffled order)
        rng.shuffle(train)
    return train[: spec.max_samples] if spec.max_samples else train, held, per_source


def _check_templates(pairs, spec: DataSpec, tok):
    chat = any(f in ("messages", "sharegpt") or (f == "prompt_completion" and isinstance(r.get("prompt"), list))
               for f, r in pairs)
    if chat and not chat_template(spec, tok):
        raise RecipeError(["data.chat_template: the data has chat rows but the tokenizer has no chat template; "
                           "set data.chat_template to a Jinja template or `chatml`"])


def prepare(spec: DataSpec, tok) -> Prepared:
    """All sources -> mixed, shuffled, split, encoded (cached) train and eval examples, plus stats."""
    bad = BadRows(spec.on_bad_row)
    train_pairs, eval_pairs, per_source = _read_all(spec, bad, random.Random(spec.shuffle_seed))
    _check_templates(train_pairs + eval_pairs, spec, tok)
    counts = {"truncated": 0, "dropped_overlong": 0, "no_trained_tokens": 0}
    train = encode_cached(train_pairs, tok, spec, "train")
    train = [train[i] for i in _keep(train, spec, bad, counts)]
    evals = encode_cached(eval_pairs, tok, spec, "eval") if eval_pairs else []
    kept = _keep(evals, spec, bad, dict(counts))
    evals, eval_rows = [evals[i] for i in kept], [eval_pairs[i][1] for i in kept]
    bad.check()
    if not train:
        raise RecipeError(["data: no training examples left after reading and filtering"
                           + (f" ({len(bad)} bad rows, first: {bad.items[0]})" if bad else "")
                           + (f" ({counts['dropped_overlong']} longer than data.max_seq_len "
                              f"{spec.max_seq_len}, dropped)" if counts["dropped_overlong"] else "")])
    stats = {"rows": len(train), "eval_rows": len(evals), "rows_skipped": len(bad), "bad_rows": bad.items[:5],
             **counts, **token_stats(train), "sources": per_source,
             "packing_efficiency": packing_efficiency(train, spec.max_seq_len)}
    return Prepared(train, evals, eval_rows, stats)


def token_stats(examples: list[dict]) -> dict:
    """tokens, trained tokens (labels[1:] != -100, what the shifted loss counts) and lengths."""
    lengths = [len(e["input_ids"]) for e in examples]
    return {"tokens": sum(lengths), "trained_tokens": sum(sum(t != IGNORE for t in e["labels"][1:]) for e in examples),
            "max_length": max(lengths, default=0), "mean_length": round(sum(lengths) / max(len(lengths), 1), 2)}


# ----------------------------------------------------------------------------------- batching

# How each attention backend keeps packed documents apart (transformers 5.23, no attention_mask, no cache):
# sdpa/eager build a block-diagonal causal mask from position_ids that restart at 0, per batch row; flash
# attention 2 derives varlen cu_seqlens from position_ids, but only for ONE flattened row (batch size 1):
# with more rows it would silently attend across documents. Backends not listed get dynamic padding.
PACKED_LAYOUT = {"sdpa": "rows", "eager": "rows", "flash_attention_2": "flat"}


def packing_layout(packing: bool, attn_implementation: str, notice=print) -> str | None:
    """"rows" (B x max_len), "flat" (1 x total, padding-free) or None (dynamic padding) for this backend."""
    if not packing:
        return None
    layout = PACKED_LAYOUT.get(attn_implementation)
    if layout is None:
        notice(f"data: packing is not supported with attention '{attn_implementation}' (documents would see "
               "each other); using dynamic padding instead")
    return layout


def collate(examples: list[dict], pad_id: int) -> dict:
    """Dynamic padding to the longest example in the batch (right padding, masked out of the loss)."""
    n = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e["input_ids"])
        ids[i, :k] = torch.tensor(e["input_ids"])
        labels[i, :k] = torch.tensor(e["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack(examples: list[dict], max_len: int) -> list[dict]:
    """Best-fit-decreasing packing (trl.pack_dataset) into rows of at most max_len tokens. Each row keeps
    `position_ids` that restart at 0 per example: with no attention_mask and no KV cache, transformers
    turns them into a block-diagonal causal mask, so examples never attend to each other. Rows come out
    in the order of their earliest example, so the caller's shuffle still decides the order."""
    from datasets import Dataset
    from trl import pack_dataset

    examples = [e for e in examples if e["input_ids"]]
    if not examples:
        return []
    ds = Dataset.from_dict({"input_ids": [e["input_ids"][:max_len] for e in examples],
                            "labels": [e["labels"][:max_len] for e in examples],
                            "doc": [[i] * min(len(e["input_ids"]), max_len) for i, e in enumerate(examples)]})
    with _quiet():
        cols = pack_dataset(ds, max_len, strategy="bfd", map_kwargs={"batch_size": len(ds)}).to_dict()
    rows = []
    for ids, labels, docs, lengths in zip(cols["input_ids"], cols["labels"], cols["doc"], cols["seq_lengths"]):
        pos, lab, o = [], [], 0
        for n in lengths:
            pos += range(n)
            # The first token of each example has no prediction from its own document: never train on it
            # (the shifted loss would otherwise predict it from the previous example's last token).
            lab += [IGNORE] + labels[o + 1: o + n]
            o += n
        rows.append({"input_ids": ids, "labels": lab, "position_ids": pos, "first": min(docs)})
    rows.sort(key=lambda r: r.pop("first"))
    return rows


def collate_packed(rows: list[dict], pad_id: int, flat: bool = False) -> dict:
    """Packed rows -> input_ids, labels, position_ids and NO attention_mask. flat=True concatenates the
    rows into one (1 x total) row with no padding at all, the layout flash_attention_2 needs."""
    if flat:
        rows = [{k: [x for r in rows for x in r[k]] for k in ("input_ids", "labels", "position_ids")}]
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.tensor(r["input_ids"])
        labels[i, :k] = torch.tensor(r["labels"])
        pos[i, :k] = torch.tensor(r["position_ids"])
        pos[i, k:] = torch.arange(n - k)  # padding forms its own block; it trains nothing
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def batches(examples: list[dict], batch_size: int, pad_id: int, packing: bool, max_len: int,
            layout: str = "rows") -> list[dict]:
    """The epoch's examples, in order, as collated batches (the order was fixed by the shuffle seed)."""
    if packing:
        rows = pack(examples, max_len)
        return [collate_packed(rows[i: i + batch_size], pad_id, flat=layout == "flat")
                for i in range(0, len(rows), batch_size)]
    return [collate(examples[i: i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]


def packing_efficiency(examples: list[dict], max_len: int) -> float:
    """Real tokens / (packed rows x max_len): the share of a packed row's slots that hold data."""
    rows = pack(examples, max_len)
    return round(sum(len(r["input_ids"]) for r in rows) / max(len(rows) * max_len, 1), 4)


def padding_fraction(items: list[dict], batch_size: int) -> float:
    """Share of the positions in right-padded batches of `items` (examples, or packed rows) that are
    padding: what a batch computes for nothing."""
    total = real = 0
    for i in range(0, len(items), batch_size):
        lengths = [len(x["input_ids"]) for x in items[i: i + batch_size]]
        total, real = total + len(lengths) * max(lengths), real + sum(lengths)
    return round(1 - real / max(total, 1), 4)


def batch_stats(examples: list[dict], batch_size: int, max_len: int) -> dict:
    """Packed vs padded, for the same examples and batch size (dynamic padding pads each batch to its
    longest example; packing pads each batch of rows to its longest row)."""
    rows = pack(examples, max_len)
    return {"packed_rows": len(rows),
            "packing_efficiency": round(sum(len(r["input_ids"]) for r in rows) / max(len(rows) * max_len, 1), 4),
            "padding_fraction_packed": padding_fraction(rows, batch_size),
            "padding_fraction_unpacked": padding_fraction(examples, batch_size)}
