"""An epoch's micro-batches are collated when the loop reaches them, not all up front, and are the same
batches the eager assembly made (same rows, same order, same split across ranks)."""
import random
from types import SimpleNamespace

import pytest
import torch

from finetune.data import batching as B
from finetune.train.run import epoch_batches


def examples(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))]
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "where": f"r{i}"})
    return out


def eager(order, mb, world, rank, pad_id, layout):
    """What the loop assembled before: every global batch collated at once."""
    groups = [order[i: i + mb * world] for i in range(0, len(order) - mb * world + 1, mb * world)]
    if layout:
        return [B.collate_packed(g[rank * mb:(rank + 1) * mb], pad_id, flat=layout == "flat") for g in groups]
    return [B.collate(g[rank * mb:(rank + 1) * mb], pad_id) for g in groups]


@pytest.mark.parametrize("layout", [None, "flat", "padded"])
@pytest.mark.parametrize("world, rank", [(1, 0), (3, 2)])
def test_lazy_batches_are_the_eager_ones(layout, world, rank):
    ex = examples(101)
    spec = SimpleNamespace(data=SimpleNamespace(shuffle_seed=7, max_seq_len=48), train=SimpleNamespace(micro_batch_size=4))
    lazy = epoch_batches(ex, 2, spec, rank, world, 0, layout)
    order = list(ex)
    random.Random(7 * 1000 + 2).shuffle(order)
    if layout:
        order = B.pack(order, 48)
    want = eager(order, 4, world, rank, 0, layout)
    assert not isinstance(lazy, list) and len(lazy) == len(want) > 0
    for i in range(len(want)):
        got = lazy[i]
        assert got.keys() == want[i].keys()
        assert all(torch.equal(got[k], want[i][k]) for k in got)
    with pytest.raises(IndexError):
        lazy[len(want)]


def test_a_million_rows_make_an_epoch_without_collating_it():
    """1M tiny rows: the epoch object holds the order only; one micro-batch is collated on access."""
    ex = [{"input_ids": [5, 6], "labels": [-100, 6]}] * 1_000_000
    spec = SimpleNamespace(data=SimpleNamespace(shuffle_seed=0, max_seq_len=16), train=SimpleNamespace(micro_batch_size=8))
    lazy = epoch_batches(ex, 0, spec, 0, 1, 0, None)
    assert len(lazy) == 125_000 and lazy[124_999]["input_ids"].shape == (8, 2)
