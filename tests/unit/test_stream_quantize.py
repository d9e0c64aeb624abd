"""The streaming loader quantizes big weights in block-aligned pieces (weights/load/quantize.py): the packed
bytes and every part of the quantization state must equal one bitsandbytes quantize_4bit call's."""
import pytest
import torch

from finetune.weights.load import quantize as Q
from finetune.weights.load import reader


class _Entry:  # the load plan's entry for a 4-bit weight (weights/load/loadplan.py), without a module
    def __init__(self, **q):
        self.q, self.key = q, "w"


@pytest.mark.parametrize("shape,storage,nested,qtype", [
    ((3 * 2**11 + 4 * 64, 3), torch.bfloat16, True, "nf4"),  # several pieces, a short last one
    ((104, 77), torch.float32, True, "nf4"),  # ends in a partial block
    ((2**12 // 64 + 1, 64), torch.uint8, False, "fp4"),
])
def test_pieces_equal_one_call(shape, storage, nested, qtype, monkeypatch):
    import bitsandbytes.functional as F

    monkeypatch.setattr(Q, "QUANT_CHUNK", 2**11)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    q = dict(blocksize=64, compress_statistics=nested, quant_type=qtype, quant_storage=storage)
    got, got_state = Q.quantize(w, q)
    want, want_state = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type=qtype,
                                       quant_storage=storage)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    a, b = got_state.as_dict(packed=True), want_state.as_dict(packed=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("shape,blocks", [((100, 192), True), ((40, 77), False)])
def test_row_blocks_from_checkpoint_equal_one_call(shape, blocks, tmp_path, monkeypatch):
    """quantize_from reads the weight in blocks of rows (never whole) when a block of rows is a whole number
    of quantization blocks, and reads it whole otherwise; either way the result is quantize_4bit's."""
    import bitsandbytes.functional as F
    from safetensors.torch import save_file

    monkeypatch.setattr(Q, "QUANT_CHUNK", 2**11)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    save_file({"w": w}, tmp_path / "model.safetensors")
    ckpt = reader.Checkpoint(tmp_path)
    reads = []
    monkeypatch.setattr(reader.Checkpoint, "read", lambda self, key: reads.append("whole") or w.clone())
    entry = _Entry(blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
    entry.rows, entry.cols = shape
    got, got_state = Q.quantize_from(ckpt, entry, torch.bfloat16, torch.device("cpu"))
    want, want_state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                       quant_storage=torch.bfloat16)
    assert reads == ([] if blocks else ["whole"])
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    a, b = got_state.as_dict(packed=True), want_state.as_dict(packed=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
