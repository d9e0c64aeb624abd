"""Data: read rows, render them to token ids with loss labels, and batch them (padded or packed).

An example is {"input_ids": [...], "labels": [...]} where labels are -100 on tokens that do not train
(prompts, user turns) so the loss covers exactly the completion / assistant spans.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .recipe import DataSource, DataSpec, RecipeError

IGNORE = -100


@dataclass
class Prepared:
    train: list[dict]
    eval: list[dict]
    eval_rows: list[dict]  # raw held-out rows, for exact match
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- reading rows


def _source_files(src: DataSource) -> list[Path]:
    if src.path.startswith("builtin:"):
        from . import tiny

        builder = tiny.BUILTIN_DATASETS.get(src.path)
        if builder is None:
            raise RecipeError([f"data: unknown builtin dataset '{src.path}'; known: {', '.join(tiny.BUILTIN_DATASETS)}"])
        f = builder() / f"{src.split}.jsonl"
        if not f.exists():
            raise RecipeError([f"data: builtin dataset {src.path} has no split '{src.split}'"])
        return [f]
    p = Path(src.path).expanduser()
    if p.is_dir():
        files = sorted(x for x in p.iterdir() if x.suffix in (".jsonl", ".json"))
        if not files:
            raise RecipeError([f"data: folder {p} holds no .jsonl/.json files"])
        return files
    if p.exists():
        return [p]
    raise RecipeError([f"data: no such file or folder: {src.path}"])


def read_jsonl(path: Path, on_bad_row: str, bad: list) -> list[dict]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError([f"{path}: not UTF-8 (byte {e.start})"]) from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        except ValueError as e:
            msg = f"{path}:{lineno}: {str(e).splitlines()[0][:200]}"
            if on_bad_row == "error":
                raise RecipeError([msg + " (set data.on_bad_row: skip to skip bad rows)"]) from None
            bad.append(msg)
            continue
        row["_where"] = f"{path}:{lineno}"
        rows.append(row)
    return rows


def read_source(src: DataSource, on_bad_row: str, bad: list) -> list[dict]:
    rows = []
    for f in _source_files(src):
        rows += read_jsonl(f, on_bad_row, bad)
    for r in rows:
        for new, old in src.fields.items():  # rename: recipe maps format name -> column name
            if old in r:
                r[new] = r.pop(old)
    return rows[: src.max_samples] if src.max_samples else rows


def detect_format(row: dict) -> str:
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
    raise ValueError(f"cannot tell the format from fields {sorted(k for k in row if k != '_where')}")


# ----------------------------------------------------------------------------------- tokenizing


def _ids(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def _prompt_completion(tok, prompt: str, completion: str, train_on_inputs: bool) -> dict:
    p = _ids(tok, prompt, special=True)
    c = _ids(tok, completion, special=False) + [tok.eos_token_id]
    labels = (p if train_on_inputs else [IGNORE] * len(p)) + c
    return {"input_ids": p + c, "labels": labels}


def _messages(tok, messages: list[dict], train_on_inputs: bool, template: str | None) -> dict:
    """Assistant-only labels for any chat template: render growing prefixes and mark the tokens each
    assistant turn adds. Works as long as the template renders a prefix of a chat as a prefix."""
    kw = {"chat_template": template} if template else {}
    ids: list[int] = []
    labels: list[int] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"message {i} needs string 'role' and 'content'")
        if m["role"] == "assistant":
            head = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kw)
            head_ids = _ids(tok, head, special=False)
            labels += [IGNORE if not train_on_inputs else t for t in head_ids[len(ids):]]
            ids = head_ids
        full = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kw)
        full_ids = _ids(tok, full, special=False)
        if full_ids[: len(ids)] != ids:
            raise ValueError("the chat template does not render a prefix of the chat as a prefix")
        new = full_ids[len(ids):]
        labels += new if (m["role"] == "assistant" or train_on_inputs) else [IGNORE] * len(new)
        ids = full_ids
    return {"input_ids": ids, "labels": labels}


def encode(row: dict, fmt: str, tok, spec: DataSpec) -> dict:
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "prompt_completion":
        return _prompt_completion(tok, _str(row, "prompt"), _str(row, "completion"), spec.train_on_inputs)
    if fmt == "instruction":
        prompt = _str(row, "instruction") + ("\n" + row["input"] if row.get("input") else "") + "\n"
        return _prompt_completion(tok, prompt, _str(row, "output"), spec.train_on_inputs)
    if fmt == "messages":
        return _messages(tok, row["messages"], spec.train_on_inputs, spec.chat_template)
    if fmt == "sharegpt":
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
        msgs = [{"role": roles.get(t.get("from"), t.get("from")), "content": t.get("value")} for t in row["conversations"]]
        return _messages(tok, msgs, spec.train_on_inputs, spec.chat_template)
    if fmt == "text":
        ids = _ids(tok, _str(row, "text"), special=True) + [tok.eos_token_id]
        return {"input_ids": ids, "labels": list(ids)}
    raise ValueError(f"unknown format {fmt}")


def _str(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is missing or not a string")
    if not v.strip() and key in ("completion", "output", "text"):
        raise ValueError(f"field '{key}' is empty")
    return v


def encode_rows(rows: list[dict], fmt: str, tok, spec: DataSpec, bad: list) -> tuple[list[dict], dict]:
    out, counts = [], {"truncated": 0, "dropped_overlong": 0, "no_trained_tokens": 0}
    for row in rows:
        try:
            ex = encode(row, fmt, tok, spec)
        except (ValueError, KeyError, TypeError) as e:
            msg = f"{row.get('_where', 'row')}: {e}"
            if spec.on_bad_row == "error":
                raise RecipeError([msg + " (set data.on_bad_row: skip to skip bad rows)"]) from None
            bad.append(msg)
            continue
        if len(ex["input_ids"]) > spec.max_seq_len:
            if spec.overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            counts["truncated"] += 1
            ex = {k: v[: spec.max_seq_len] for k, v in ex.items()}
        if all(t == IGNORE for t in ex["labels"][1:]):
            counts["no_trained_tokens"] += 1
            continue
        out.append(ex)
    return out, counts


def prepare(spec: DataSpec, tok) -> Prepared:
    """All sources -> shuffled, encoded train and eval examples, plus stats."""
    bad: list[str] = []
    rng = random.Random(spec.shuffle_seed)
    train_rows: list[dict] = []
    for src in spec.sources:
        rows = read_source(src, spec.on_bad_row, bad)
        rng.shuffle(rows)
        train_rows += [(src.format, r) for r in rows]
    eval_rows = [(s.format, r) for s in spec.eval_sources for r in read_source(s, spec.on_bad_row, bad)]
    if not eval_rows and spec.eval_split > 0:
        n = max(1, int(len(train_rows) * spec.eval_split))
        eval_rows, train_rows = train_rows[:n], train_rows[n:]
    if spec.max_samples:
        train_rows = train_rows[: spec.max_samples]
    train, tc = _encode_all(train_rows, tok, spec, bad)
    evals, _ = _encode_all(eval_rows, tok, spec, bad)
    if not train:
        raise RecipeError(["data: no training examples left after reading and filtering"
                           + (f" ({len(bad)} bad rows, first: {bad[0]})" if bad else "")])
    stats = {"rows": len(train), "eval_rows": len(evals), "rows_skipped": len(bad), "bad_rows": bad[:5],
             "tokens": sum(len(e["input_ids"]) for e in train),
             "trained_tokens": sum(sum(t != IGNORE for t in e["labels"][1:]) for e in train), **tc}
    return Prepared(train, evals, [r for _, r in eval_rows], stats)


def _encode_all(pairs, tok, spec, bad):
    out, counts = [], {}
    for fmt in {f for f, _ in pairs}:
        ex, c = encode_rows([r for f, r in pairs if f == fmt], fmt, tok, spec, bad)
        out += ex
        counts = {k: counts.get(k, 0) + v for k, v in c.items()}
    return out, counts


# ----------------------------------------------------------------------------------- batching


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
    """Greedy first-fit packing into rows of at most max_len tokens. Each row keeps `position_ids` that
    restart at 0 per example: with no attention_mask and no KV cache, transformers turns them into a
    block-diagonal causal mask, so examples never attend to each other."""
    rows: list[dict] = []
    for e in sorted(examples, key=lambda e: -len(e["input_ids"])):
        for r in rows:
            if len(r["input_ids"]) + len(e["input_ids"]) <= max_len:
                break
        else:
            r = {"input_ids": [], "labels": [], "position_ids": []}
            rows.append(r)
        r["input_ids"] += e["input_ids"]
        # The first token of each example has no prediction from its own document: never train on it
        # (the shifted loss would otherwise predict it from the previous example's last token).
        r["labels"] += [IGNORE] + e["labels"][1:]
        r["position_ids"] += list(range(len(e["input_ids"])))
    return rows


def collate_packed(rows: list[dict], pad_id: int) -> dict:
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


def batches(examples: list[dict], batch_size: int, pad_id: int, packing: bool, max_len: int) -> list[dict]:
    """The epoch's examples, in order, as collated batches (the order was fixed by the shuffle seed)."""
    if packing:
        rows = pack(examples, max_len)
        return [collate_packed(rows[i: i + batch_size], pad_id) for i in range(0, len(rows), batch_size)]
    return [collate(examples[i: i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]
