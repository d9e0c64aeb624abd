"""The checkpoint reader: a safetensors directory's tensors by key, read one at a time into owned memory
(tensorfile.py), and this machine's `Stream`: one reader per machine (its local rank 0) reads (and
quantizes, quantize.py) and sends each rank what it keeps (whole tensors for `whole`; each rank's part under
FSDP: plain tensors here, packed 4-bit bytes in packed.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.weights.load import tensorfile
from finetune.util.errors import RecipeError
from finetune.weights.load.placement import Placement, comm_device
from finetune.weights.load.quantize import quantize_from

_QS_PREFIX = "quant_state.bitsandbytes__"


class Checkpoint:
    """The tensors of a safetensors checkpoint directory, by key, read one at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.headers: dict[Path, tuple[int, dict]] = {}  # file -> tensorfile.header, read once
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.where = {}
            for f in sorted(path.glob("*.safetensors")):
                self.headers[f] = tensorfile.header(f)
                self.where.update({k: f for k in self.headers[f][1]})
        self.prequantized = any(_QS_PREFIX in k for k in self.where)
        self.stacked: dict[str, list[list[str]]] = {}  # fused MoE expert parameter -> its per-expert keys
        self.renamed: dict[str, str] = {}  # model key -> the checkpoint's spelling

    def link(self, key: str, model_type: str, experts: int) -> bool:
        """Whether the checkpoint holds the model's parameter `key`: as stored, or (a hub MoE checkpoint
        under transformers 5) stacked from per-expert weights or under another name (archs.EXPERT_LAYOUTS)."""
        from finetune.plan.archs import per_expert_keys, renamed_key

        if key in self.where:
            return True
        sources = per_expert_keys(key, model_type, experts)
        if sources and all(k in self.where for parts in sources for k in parts):
            self.stacked[key] = sources
            return True
        # a multimodal checkpoint's text decoder (Gemma 3): transformers 4's and 5's spellings
        for alt in (renamed_key(key, model_type), "language_model." + key,
                    key.replace("model.", "model.language_model.", 1)):
            if alt in self.where:
                self.renamed[key] = alt
                return True
        return False

    def read(self, key: str) -> torch.Tensor:
        if key in self.stacked:
            return self.read_rows(key, 0, len(self.stacked[key]))
        return self._file_read(self.renamed.get(key, key))

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `key` (dim 0), read without reading the rest of it. A stacked expert
        parameter's rows are experts: each is read from its parts (gate and up concatenated, as
        transformers' MergeModulelist + Concatenate build it)."""
        if key in self.stacked:
            parts = self.stacked[key][start:stop]
            if not parts:  # a rank past the last expert (more ranks than experts): an empty chunk
                one = torch.cat([self.read(k) for k in self.stacked[key][0]], dim=0)
                return one.new_empty((0, *one.shape))
            return torch.stack([torch.cat([self.read(k) for k in expert], dim=0) for expert in parts])
        return self._file_read(self.renamed.get(key, key), start, stop)

    def _file_read(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """A copy in this process's memory, never a view of a map of the file (see tensorfile.py)."""
        f = self.where[key]
        if f not in self.headers:
            self.headers[f] = tensorfile.header(f)
        return tensorfile.read_rows(f, self.headers[f], key, start, stop)

    def quant_stats(self, key: str) -> dict:
        """The stored quantization state of the packed weight `key` (a `*-bnb-4bit` checkpoint)."""
        return {k[len(key) + 1:]: self.read(k) for k in self.where if k.startswith(key + ".")}


class Stream:
    """This machine's reader (its local rank 0) reads (and quantizes); the machine's other ranks receive.
    Collective: all ranks call in the same order."""

    def __init__(self, ckpt: Checkpoint, placement: Placement, dtype: torch.dtype):
        self.ckpt, self.placement, self.dtype = ckpt, placement, dtype

    def share(self, make) -> tuple[torch.Tensor, object]:
        """(tensor, info) made by the reader's `make()`, on every rank of its machine; the tensor travels as
        raw bytes so any dtype (packed bf16 storage included) crosses any backend unchanged."""
        pl = self.placement
        if pl.world == 1:
            return make()
        import torch.distributed as dist

        header = [None]
        reading = pl.rank == pl.reader
        if reading:
            t, info = make()
            header = [(tuple(t.shape), t.dtype, info)]
        dist.broadcast_object_list(header, src=pl.reader, group=pl.group)
        shape, dtype, info = header[0]
        comm = comm_device(pl)
        if reading:
            buf = t.contiguous().view(-1).view(torch.uint8).to(comm)
        else:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=comm)
        dist.broadcast(buf, src=pl.reader, group=pl.group)
        if reading:
            return t, info
        return buf.to(pl.device).view(dtype).view(shape), info

    def plain(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        dev = self.placement.device
        return self.share(lambda: (self.ckpt.read(key).to(dev, dtype), None))[0]

    def quantized(self, entry) -> tuple[torch.Tensor, object]:
        """(packed 4-bit weight, QuantState) of the load plan's `entry` on every rank."""
        from bitsandbytes.functional import QuantState

        dev = self.placement.device

        def make():
            key = entry.key
            if self.ckpt.prequantized:
                packed = self.ckpt.read(key).to(dev)
                stats = self.ckpt.quant_stats(key)
            else:
                packed, qs = quantize_from(self.ckpt, entry, self.dtype, dev)
                stats = {k: v.cpu() if torch.is_tensor(v) else v for k, v in qs.as_dict(packed=True).items()}
            return packed, stats

        packed, stats = self.share(make)
        return packed, QuantState.from_dict(dict(stats), device=dev)

    def plain_chunk(self, key: str, dtype: torch.dtype, shape: tuple, index: int, parts: int) -> torch.Tensor:
        """torch.chunk(whole, parts)[index] (empty past the last chunk) of the plain tensor `key`, on this
        rank, for FSDP2. `index`/`parts` equal this process's rank/world (the caller checks)."""
        part = self.plain_range(key, dtype, shape, self.chunk_spans(shape, parts))
        return part.view(-1, *shape[1:])

    def chunk_spans(self, shape: tuple, parts: int) -> dict[int, tuple[int, int]]:
        """Each rank of this machine -> the flat element range [start, stop) of its torch.chunk(dim 0) of a
        tensor of `shape` cut in `parts` (empty past the last chunk)."""
        rows, row = shape[0], torch.Size(shape[1:]).numel()
        size = -(-rows // parts)
        return {r: (min(r * size, rows) * row, min((r + 1) * size, rows) * row) for r in self._machine()}

    def _machine(self) -> range:
        pl = self.placement
        return range(pl.reader, pl.reader + pl.local_world)

    def plain_range(self, key: str, dtype: torch.dtype, shape: tuple, spans: dict) -> torch.Tensor:
        """Elements [start, stop) of the flattened plain tensor `key`, on this rank, where `spans` maps each
        global rank of this machine to its (start, stop) (ranks that want nothing may be left out). The
        reader reads each other rank's rows alone and sends that rank its elements alone, then reads its
        own: no process holds the whole tensor (a broadcast would make every rank hold it, which for the
        embedding or the output head is the biggest transient of the load). Collective, in the same order."""
        import torch.distributed as dist

        pl = self.placement
        comm = comm_device(pl)
        if pl.rank == pl.reader:
            for r in self._machine():
                lo, hi = spans.get(r, (0, 0))
                if r != pl.rank and hi > lo:
                    part = self._read_range(key, shape, lo, hi).to(comm, dtype).contiguous()
                    dist.send(part.view(torch.uint8), dst=r)
                    del part
            lo, hi = spans.get(pl.rank, (0, 0))
            return self._read_range(key, shape, lo, max(lo, hi)).to(pl.device, dtype).contiguous()
        lo, hi = spans.get(pl.rank, (0, 0))
        buf = torch.empty(max(0, hi - lo), dtype=dtype, device=comm)
        if hi > lo:
            dist.recv(buf.view(torch.uint8), src=pl.reader)
        return buf.to(pl.device)

    def _read_range(self, key: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
        """Flat elements [start, stop) of `key`, read as the few whole rows (dim 0) that cover them."""
        if not shape:
            return self.ckpt.read(key).reshape(-1)[start:stop]
        row = torch.Size(shape[1:]).numel()
        lo, hi = start // row, -(-stop // row)
        return self.ckpt.read_rows(key, lo, max(lo, hi)).reshape(-1)[start - lo * row:stop - lo * row]


def materialize(stream: Stream, entry):
    """The whole parameter of the load plan's `entry`, on every rank (collective)."""
    import bitsandbytes as bnb

    if entry.experts:
        from finetune.weights.experts.expert_bytes import whole_experts

        return whole_experts(stream, entry)
    if entry.packed:
        packed, qs = stream.quantized(entry)
        entry.module.quant_state = qs  # where bitsandbytes finds it again after FSDP gathers the weight
        return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, module=entry.module, bnb_quantized=True,
                                 **entry.q)
    return torch.nn.Parameter(stream.plain(entry.key, entry.dtype), requires_grad=False)


def check_stored_config(config, bnb) -> None:
    """A pre-quantized checkpoint is read as stored: the recipe's 4-bit settings must be the stored ones."""
    stored = getattr(config, "quantization_config", None) or {}
    stored = stored if isinstance(stored, dict) else stored.to_dict()
    ours = bnb.to_dict()
    fields = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
    bad = [f for f in fields if f in stored and str(stored[f]) != str(ours.get(f))]
    if bad:
        raise RecipeError([f"quantization: the checkpoint is pre-quantized with {f}={stored[f]}, the recipe asks "
                           f"for {ours.get(f)}; set the recipe to match" for f in bad])
