"""Batching: examples -> collated tensors, dynamically padded, or packed without padding (several
examples per row, kept apart by position_ids that restart at 0), and the stats that compare the two.
"""
from __future__ import annotations

from typing import Sequence

import torch

from finetune.data.bars import datasets_bars
from finetune.data.encode import IGNORE
from finetune.data.examples import lengths_of, reorder
from finetune.util.log import log

# How each attention backend keeps packed documents apart (transformers 5.23, no attention_mask, no cache):
# sdpa/eager build a block-diagonal causal mask from position_ids that restart at 0, per batch row; flash
# attention 2 derives varlen cu_seqlens from position_ids, but only for ONE flattened row (batch size 1):
# with more rows it would silently attend across documents. Backends not listed get dynamic padding.
PACKED_LAYOUT = {"sdpa": "rows", "eager": "rows", "flash_attention_2": "flat"}


def packing_layout(packing: bool, attn_implementation: str) -> str | None:
    """"rows" (B x max_len), "flat" (1 x total, padding-free) or None (dynamic padding) for this backend."""
    if not packing:
        return None
    layout = PACKED_LAYOUT.get(attn_implementation)
    if layout is None:
        log.info(f"data: packing is not supported with attention '{attn_implementation}' (documents would see "
                 "each other); using dynamic padding instead")
    return layout


def _right_pad(items: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (padded with pad_id) and labels (padded with IGNORE, so padding never trains) of `items`
    as (len(items) x longest) tensors."""
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    labels = torch.full((len(items), n), IGNORE, dtype=torch.long)
    for i, x in enumerate(items):
        k = len(x["input_ids"])
        ids[i, :k] = torch.tensor(x["input_ids"])
        labels[i, :k] = torch.tensor(x["labels"])
    return ids, labels


def collate(examples: list[dict], pad_id: int) -> dict:
    """Dynamic padding to the longest example in the batch (right padding, masked out of the loss). Preference
    pairs go through `collate_pairs`."""
    examples = list(examples)  # read once (a slice of data.examples.Examples reads its rows when walked)
    if examples and "rejected_ids" in examples[0]:
        return collate_pairs(examples, pad_id)
    ids, labels = _right_pad(examples, pad_id)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def collate_pairs(pairs: list[dict], pad_id: int) -> dict:
    """B preference pairs -> one batch of 2B sequences, the B chosen then the B rejected, so both sides of
    every pair go through the model in one forward. `ref_logps` [2B] (float64, same order) holds the
    reference policy's log-probs once they are known (`ref` of each pair: [chosen, rejected]), else zeros."""
    sides = ([{"input_ids": p["input_ids"], "labels": p["labels"]} for p in pairs]
             + [{"input_ids": p["rejected_ids"], "labels": p["rejected_labels"]} for p in pairs])
    batch = collate(sides, pad_id)
    refs = [p.get("ref", (0.0, 0.0)) for p in pairs]
    batch["ref_logps"] = torch.tensor([r[0] for r in refs] + [r[1] for r in refs], dtype=torch.float64)
    return batch


def pack(examples, max_len: int) -> list[dict]:
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
    with datasets_bars(show=False):
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
    ids, labels = _right_pad(rows, pad_id)
    n, pos = ids.shape[1], torch.zeros_like(ids)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
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


def shuffled(examples: Sequence[dict], rng) -> Sequence[dict]:
    """`examples` shuffled by `rng`: positions are shuffled (the same draws as shuffling the examples
    themselves, so the order is the one a list of dicts got), then the examples reordered as a view."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    return reorder(examples, order)


class EpochBatches:
    """One rank's micro-batches of an epoch, collated when asked for (`batches[i]`), not all up front: an
    epoch of a million short rows would otherwise cost minutes and gigabytes of tensors before the first step.
    `rows` are the epoch's examples (or packed rows) in order; global batch i is rows[i*mb*world:(i+1)*mb*world],
    of which this rank takes the `rank`-th micro-batch; a last incomplete global batch is dropped."""

    def __init__(self, rows: list[dict], mb: int, world: int, rank: int, pad_id: int, layout: str | None):
        self.rows, self.mb, self.world, self.rank, self.pad_id, self.layout = rows, mb, world, rank, pad_id, layout

    def __len__(self) -> int:
        return len(self.rows) // (self.mb * self.world)

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.mb * self.world + self.rank * self.mb
        part = self.rows[start: start + self.mb]
        if self.layout:
            return collate_packed(part, self.pad_id, flat=self.layout == "flat")
        return collate(part, self.pad_id)


def packing_efficiency(examples, max_len: int) -> float:
    """Real tokens / (packed rows x max_len): the share of a packed row's slots that hold data."""
    return _efficiency(_row_lengths(pack(examples, max_len)), max_len)


def _row_lengths(items) -> list[int]:
    return [len(x["input_ids"]) for x in items]


def _efficiency(lengths: list[int], max_len: int) -> float:
    return round(sum(lengths) / max(len(lengths) * max_len, 1), 4)


def padding_fraction(items, batch_size: int) -> float:
    """Share of the positions in right-padded batches of `items` (examples, or packed rows) that are
    padding: what a batch computes for nothing."""
    return _padding(_row_lengths(items), batch_size)


def _padding(lengths: list[int], batch_size: int) -> float:
    total = real = 0
    for i in range(0, len(lengths), batch_size):
        part = lengths[i: i + batch_size]
        total, real = total + len(part) * max(part), real + sum(part)
    return round(1 - real / max(total, 1), 4)


# The packing figures pack this many examples at a time: best fit keeps a small record per packed row,
# bounded by the window; within 65536 short examples it leaves no more room unused than across all of them.
STATS_WINDOW = 65536


def packed_lengths(lengths, max_len: int) -> list[int]:
    """The lengths of pack()'s rows, in pack()'s order, from the examples' lengths alone (a numpy array):
    the same best fit, run over a list column that holds each example's number (in Arrow, 4 bytes a token)
    instead of its tokens. Equal to pack() up to STATS_WINDOW examples; beyond, window by window."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from trl import pack_dataset

    out = []
    for start in range(0, len(lengths), STATS_WINDOW):
        n = lengths[start: start + STATS_WINDOW]
        n = np.minimum(n[n > 0], max_len).astype(np.int32)  # as pack(): empty examples out, long ones cut
        if not len(n):
            continue
        docs = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)),
                                        pa.array(np.repeat(np.arange(len(n), dtype=np.int32), n)))
        with datasets_bars(show=False):
            packed = pack_dataset(Dataset.from_dict({"input_ids": docs}), max_len, strategy="bfd",
                                  map_kwargs={"batch_size": len(n)})
        col = packed.with_format("arrow")[:]["input_ids"].combine_chunks()
        offsets = col.offsets.to_numpy()
        offsets = offsets - offsets[0]
        first = np.minimum.reduceat(col.flatten().to_numpy(), offsets[:-1])  # each row's earliest example
        out += np.diff(offsets)[np.argsort(first, kind="stable")].tolist()
    return out


def batch_stats(examples, batch_size: int, max_len: int) -> dict:
    """Packed vs padded, for the same examples and batch size (dynamic padding pads each batch to its
    longest example; packing pads each batch of rows to its longest row). From the examples' lengths
    only: the figures for millions of examples hold no copy of their tokens."""
    lengths = lengths_of(examples)
    rows = packed_lengths(lengths, max_len)
    return {"packed_rows": len(rows),
            "packing_efficiency": _efficiency(rows, max_len),
            "padding_fraction_packed": _padding(rows, batch_size),
            "padding_fraction_unpacked": _padding(lengths.tolist(), batch_size)}
