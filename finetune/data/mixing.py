"""Reading every source of a recipe into compact form, then splitting, weighting and mixing them by index.

Each checked row is kept as its JSON text in an Arrow string array (a few bytes over the text itself), never
as a dict: 2 million short rows as dicts are about 1 GB. The split, the weights and the shuffle work on row
numbers, with the same random draws as shuffling the rows themselves, so the same rows come out in the
same order as when they were lists of dicts.
"""
from __future__ import annotations

import json
import random
from array import array
from dataclasses import dataclass

from finetune.data.formats import BadRows
from finetune.data.sources import checked_rows
from finetune.recipe import DataSpec

CHUNK = 65536  # rows gathered as Python strings before they become one Arrow chunk
CHAT_FORMATS = ("messages", "sharegpt")


@dataclass
class Rows:
    """Every row read (texts, formats, chat flags, indexed by global row number) and the row numbers of the
    training and held-out sides, in order."""
    texts: list    # pyarrow large_string arrays, CHUNK rows each (a source's last one fewer): json.dumps of each row
    chunk_starts: object  # numpy: the first row number of each of `texts`
    starts: list   # each source's first row number (sources are read one after another)
    fmts: list     # each source's format
    chat: object   # numpy bool array: the row renders through a chat template
    train: array
    held: array
    per_source: list

    def texts_of(self, numbers) -> list[tuple[str, str]]:
        """(JSON text, format) of the rows numbered in `numbers` (a short run of them: one Arrow take)."""
        import numpy as np

        # Row by row from its chunk: a take on the chunked texts would first join every chunk into one copy.
        idx = np.asarray(numbers, dtype=np.int64)
        chunk = np.searchsorted(self.chunk_starts, idx, side="right") - 1
        source = np.searchsorted(self.starts, idx, side="right") - 1
        return [(self.texts[c][int(i - self.chunk_starts[c])].as_py(), self.fmts[s])
                for i, c, s in zip(idx, chunk, source)]

    def any_chat(self) -> bool:
        import numpy as np

        used = np.concatenate([np.frombuffer(self.train, dtype=np.int64), np.frombuffer(self.held, dtype=np.int64)])
        return bool(self.chat[used].any())

    def row(self, n: int) -> dict:
        return json.loads(self.texts_of([n])[0][0])


def _is_chat(fmt: str, row: dict) -> bool:
    return fmt in CHAT_FORMATS or (fmt in ("prompt_completion", "preference", "auto")
                                   and isinstance(row.get("prompt", row.get("chosen")), list))


class _Reader:
    """Appends checked rows of one source after another, as JSON texts in Arrow chunks."""

    def __init__(self):
        self.chunks, self.chunk_starts, self.starts, self.fmts, self.chat = [], [], [], [], bytearray()
        self.texts, self.n = [], 0

    def read(self, src, bad: BadRows, label: str, vocab_size: int | None) -> tuple[str, int, int]:
        """(format, first global row number, rows read) of one source."""
        start, fmt = self.n, src.format
        for fmt, row in checked_rows(src, bad, label, vocab_size):
            # The text the encoder parses and the cache key hashes (sort_keys: a stable key).
            self.texts.append(json.dumps(row, ensure_ascii=False, sort_keys=True, default=str))
            self.chat.append(_is_chat(fmt, row))
            self.n += 1
            if len(self.texts) >= CHUNK:
                self._flush()
        self._flush()
        self.starts.append(start)
        self.fmts.append(fmt)
        return fmt, start, self.n - start

    def _flush(self):
        import pyarrow as pa

        if self.texts:
            self.chunk_starts.append(self.n - len(self.texts))
            self.chunks.append(pa.array(self.texts, type=pa.large_string()))
            self.texts = []

    def rows(self, train: array, held: array, per_source: list) -> Rows:
        import numpy as np

        return Rows(self.chunks, np.asarray(self.chunk_starts, dtype=np.int64), self.starts, self.fmts,
                    np.frombuffer(bytes(self.chat), dtype=np.bool_), train, held, per_source)


def _weighted(rows: array, weight: float, rng: random.Random) -> array:
    """weight x rows: whole copies, plus a seeded sample for the fraction."""
    whole, frac = int(weight), weight - int(weight)
    out = rows * whole
    out.extend(rng.sample(rows, round(frac * len(rows))))
    return out


def read_all(spec: DataSpec, bad: BadRows, rng: random.Random, vocab_size: int | None = None) -> Rows:
    """Every source read, split (before weighting, so a repeated row can never sit on both sides), weighted
    and interleaved. random.shuffle and sample draw by position only, so shuffling row numbers gives the
    order shuffling the rows gave."""
    reader, train, held, per_source = _Reader(), array("q"), array("q"), []
    for i, src in enumerate(spec.sources):
        fmt, start, n = reader.read(src, bad, f"data.sources[{i}]", vocab_size)
        rows = array("q", range(start, start + n))
        rng.shuffle(rows)
        n_eval = 0
        if not spec.eval_sources and spec.eval_split > 0 and n > 1:
            n_eval = min(n - 1, max(1, round(n * spec.eval_split)))
            held.extend(rows[:n_eval])
        mixed = _weighted(rows[n_eval:], src.weight, rng)
        train.extend(mixed)
        per_source.append({"path": src.path, "format": fmt, "rows_read": n, "rows_eval": n_eval,
                           "rows_train": len(mixed), "weight": src.weight})
    for i, src in enumerate(spec.eval_sources):
        _, start, n = reader.read(src, bad, f"data.eval_sources[{i}]", vocab_size)
        held.extend(range(start, start + n))
    if len(spec.sources) > 1:  # interleave the sources (one source is already in shuffled order)
        rng.shuffle(train)
    return reader.rows(train[: spec.max_samples] if spec.max_samples else train, held, per_source)
