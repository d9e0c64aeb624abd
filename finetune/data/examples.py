"""Encoded examples kept in Arrow, read as dicts one batch at a time.

The tokenizing map writes its examples into an Arrow file that `datasets` memory-maps, so the token ids
stay on disk and in the page cache, not on the heap: a Python list costs ~36 bytes a token (twice, ids and
labels), enough to need 8 GB for 2 million short rows. `Examples` is the read-only sequence the training
loop, eval and `finetune data` walk: the row numbers that passed the checks (a compact integer array),
over the Arrow rows; each access gives the same dict a list element used to be (truncated to max_seq_len,
without the encoder's bookkeeping). Dicts are made when read, so changing one changes nothing: per-example
values computed later (DPO's reference log-probs) are attached to the sequence (`attach`).
"""
from __future__ import annotations

from array import array
from typing import Iterator, Sequence

READ_BATCH = 1024  # rows per Arrow read while iterating: one take, then plain dicts
PAIR_KEYS = ("rejected_ids", "rejected_labels")
DROPPED = ("error", "length")  # the encoder's bookkeeping, read by the checks (prepare._keep), not by training


class Examples(Sequence):
    def __init__(self, ds, index: array, max_len: int, extra: dict | None = None):
        self._ds = ds.with_format("arrow")  # a read gives an Arrow table: one conversion per batch of rows
        self._index, self._max_len, self._extra = index, max_len, extra or {}
        self._ascending = all(index[i] < index[i + 1] for i in range(len(index) - 1))

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):
        if isinstance(i, slice):  # a view: the rows are not read
            return Examples(self._ds, self._index[i], self._max_len, {k: v[i] for k, v in self._extra.items()})
        n = len(self._index)
        if not -n <= i < n:
            raise IndexError(i)
        return self._read(range(i % n, i % n + 1))[0]

    def __iter__(self) -> Iterator[dict]:
        if self._ascending:  # the examples in file order: one streamed pass (scan), no page stays mapped
            yield from self._scan()
            return
        for start in range(0, len(self._index), READ_BATCH):
            yield from self._read(range(start, min(start + READ_BATCH, len(self._index))))

    def _scan(self) -> Iterator[dict]:
        index, pos, first = self._index, 0, 0  # first: the file row number of the batch's first row
        for cols in scan(self._ds):
            rows = len(next(iter(cols.values())))
            while pos < len(index) and index[pos] < first + rows:
                yield self._shape({k: v[index[pos] - first] for k, v in cols.items()}, pos)
                pos += 1
            if pos == len(index):
                return
            first += rows

    def lengths(self):
        """Each example's input length as read (truncated), from the Arrow offsets of a streamed pass: no
        token becomes a Python int."""
        import numpy as np
        import pyarrow.compute as pc

        parts = [pc.list_value_length(b.column("input_ids")).to_numpy(zero_copy_only=False)
                 for b in scan_arrow(self._ds)]
        per_row = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return np.minimum(per_row[np.frombuffer(self._index, dtype=np.int64)], self._max_len)

    def __eq__(self, other) -> bool:  # as the lists of dicts compared: element by element
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __add__(self, other) -> list[dict]:  # as lists concatenate (every row read: for small sets)
        return list(self) + list(other)

    def __radd__(self, other) -> list[dict]:
        return list(other) + list(self)

    def take(self, order: Sequence[int]) -> "Examples":
        """These examples in another order (positions into this sequence), as a view."""
        return Examples(self._ds, array("q", (self._index[j] for j in order)), self._max_len,
                        {k: [v[j] for j in order] for k, v in self._extra.items()})

    def attach(self, key: str, values: list) -> None:
        """values[i] appears as example i's `key` from now on, in this sequence and in its views made later."""
        if len(values) != len(self):
            raise ValueError(f"attach {key}: {len(values)} values for {len(self)} examples")
        self._extra[key] = list(values)

    def _read(self, positions: range) -> list[dict]:
        cols = self._ds[[self._index[p] for p in positions]].to_pydict()
        return [self._shape(dict(zip(cols, vals)), p) for p, vals in zip(positions, zip(*cols.values()))]

    def _shape(self, row: dict, p: int) -> dict:
        """Example p as training reads it: bookkeeping dropped, truncated, attached values added."""
        ex = {k: v for k, v in row.items() if k not in DROPPED}
        if not ex.get("rejected_ids"):  # a preference pair's rejected side exists only in pairs
            for k in PAIR_KEYS:
                ex.pop(k, None)
        # Stored one token past max_seq_len (prepare._encode_batch): an example still here is truncated.
        for k in ("input_ids", "labels", *PAIR_KEYS):
            if k in ex and len(ex[k]) > self._max_len:
                ex[k] = ex[k][: self._max_len]
        for k, v in self._extra.items():
            ex[k] = v[p]
        return ex


def scan_arrow(ds) -> Iterator:
    """A Dataset's rows in order, as Arrow record batches read from its cache file by a buffered reader,
    not through the memory map: every page of the map a pass touches stays in the process's RSS (after
    one pass, the whole file: ~1 GB for 2 million short rows), while a read batch is freed once used.
    An in-memory Dataset (no cache file) is read in batches from memory."""
    import pyarrow as pa

    if not ds.cache_files:
        yield from ds.with_format("arrow").iter(batch_size=READ_BATCH)
        return
    for f in ds.cache_files:  # datasets writes Arrow IPC streams
        with pa.OSFile(f["filename"]) as fh:
            yield from pa.ipc.open_stream(fh)


def scan(ds) -> Iterator[dict]:
    """scan_arrow's batches as {column: list of Python values}."""
    for batch in scan_arrow(ds):
        yield batch.to_pydict()


def reorder(examples: Sequence[dict], order: Sequence[int]) -> Sequence[dict]:
    """`examples` in `order` (positions): a view of Examples, a new list of a list."""
    if isinstance(examples, Examples):
        return examples.take(order)
    return [examples[j] for j in order]


def lengths_of(examples: Sequence[dict]):
    """Each example's input length, as a numpy array (Examples: from the Arrow offsets)."""
    import numpy as np

    if isinstance(examples, Examples):
        return examples.lengths()
    return np.array([len(e["input_ids"]) for e in examples], dtype=np.int64)


def attach(examples: Sequence[dict], key: str, values: list) -> None:
    """Each example's `key` set to its value: on Examples through `attach`, on a list of dicts in place."""
    if isinstance(examples, Examples):
        examples.attach(key, values)
        return
    for ex, v in zip(examples, values, strict=True):
        ex[key] = v
