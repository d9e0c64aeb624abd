"""tensorfile: safetensors tensors and row ranges read into memory the process owns."""
import torch
from safetensors.torch import load_file, save_file

from finetune.weights.load import tensorfile


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16), "f32": torch.randn(3, 4, 2, generator=g),
            "u8": torch.randint(0, 255, (9, 1), generator=g, dtype=torch.uint8),
            "i64": torch.arange(6, dtype=torch.int64), "flag": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4, dtype=torch.float16)}


def test_whole_tensors_and_rows_equal_safetensors(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file(_tensors(), str(f), metadata={"format": "pt"})
    head, ref = tensorfile.header(f), load_file(str(f))
    assert set(head[1]) == set(ref)  # __metadata__ is not a tensor
    for key, want in ref.items():
        got = tensorfile.read_rows(f, head, key)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
    rows = tensorfile.read_rows(f, head, "f32", 1, 3)
    assert torch.equal(rows, ref["f32"][1:3])
    assert tensorfile.read_rows(f, head, "bf16", 4, 4).shape == (0, 5)


def test_a_read_tensor_does_not_follow_the_file(tmp_path):
    """A view of a map of the file (what safe_open's get_tensor returns) would change with the file."""
    f = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(1024, 1024)}, str(f))
    got = tensorfile.read_rows(f, tensorfile.header(f), "w")
    data = bytearray(f.read_bytes())
    base = tensorfile.header(f)[0]
    data[base:] = bytes(len(data) - base)  # the weights become zeros, in place
    with open(f, "r+b") as h:
        h.write(data)
    assert torch.equal(got, torch.ones(1024, 1024))
    assert tensorfile.read_rows(f, tensorfile.header(f), "w").abs().sum() == 0
