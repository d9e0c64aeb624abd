"""The streaming 4-bit loader: the base model, tensor by tensor, so no process holds more than its share.

The model is built on the meta device from config.json (transformers' own bitsandbytes quantizer swaps
the target linears for `Linear4bit`, exactly as `from_pretrained` does). Then the checkpoint's safetensors
are read one tensor at a time by one reader per machine (its local rank 0); each linear weight is quantized
on the reader's device, in blocks of rows (or, for a pre-quantized `*-bnb-4bit` checkpoint, its packed bytes
and quantization state are read as stored). One process, or replicas, receive every tensor whole (a
broadcast); under FSDP each rank is sent only its part of every tensor, packed 4-bit bytes included, as it
is read or quantized (packed.py):

- `whole` (one process, or replicas): every tensor is set at once; the bf16 weights are never all held,
  only one tensor at a time.
- `fsdp2`: nothing is set at load time (a placeholder stands in, so LoRA can be attached); `prepare`
  shards the meta model with `fully_shard` and then `fill_fsdp2_shards` streams the checkpoint again,
  each rank keeping only its dim-0 chunk of every parameter: the packed 4-bit bytes included.
- `fsdp1`: FSDP1 flattens and shards the meta model (its `param_init_fn` leaves everything on meta), and
  then `fsdp1.fill_shards` fills each rank's slice of every flat parameter, reading only the rows that
  slice covers (fsdp1.py).

Quantization state (absmax, nested absmax, code, ...) is kept whole on every rank, on the `Linear4bit`
module (`module.quant_state`), where bitsandbytes finds it again after FSDP gathers the packed weight.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.train import tensorfile
from finetune.util.errors import RecipeError
from finetune.util.libc import trim_heap

PLACEMENTS = ("whole", "fsdp1", "fsdp2")
_QS_PREFIX = "quant_state.bitsandbytes__"


@dataclass
class Placement:
    """What this process keeps of the weights (see the module doc), and where it talks to the others."""
    mode: str = "whole"
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    reader: int = 0  # global rank of this machine's reader: its local rank 0
    local_world: int = 1  # processes on this machine: ranks reader .. reader + local_world - 1
    group: object = None  # this machine's process group; None when the job is one machine


def placement_for(accelerator) -> Placement:
    """The placement an Accelerator implies: FSDP (1 or 2) shards, anything else holds the whole model.
    One reader per machine: on several machines each gets a process group of its own processes (torchrun
    numbers ranks machine by machine), so the checkpoint crosses no network; on one machine, the default
    group."""
    import os

    from accelerate.utils import DistributedType

    mode = "whole"
    # One process under a launcher with an explicit `distributed.strategy: fsdp` shards too (into one part): the
    # same sharded load and wrap as N processes, so one GPU runs the whole FSDP path.
    if accelerator.distributed_type == DistributedType.FSDP:
        mode = f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    rank, world = accelerator.process_index, accelerator.num_processes
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    group = None
    if 1 < world and local_world < world:
        import torch.distributed as dist

        group, _ = dist.new_subgroups(group_size=local_world)  # collective: every rank creates every group
    return Placement(mode, rank, world, accelerator.device, rank - accelerator.local_process_index, local_world,
                     group)


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


def _comm_device(pl: Placement) -> torch.device:
    """Where broadcast buffers live: gloo moves host tensors only (the CPU harness); NCCL needs them on the GPU."""
    import torch.distributed as dist

    return torch.device("cpu") if dist.get_backend() == "gloo" else pl.device


class Stream:
    """This machine's reader (its local rank 0) reads (and quantizes); the machine's other ranks receive.
    Collective: all ranks call in the same order."""

    def __init__(self, ckpt: Checkpoint, placement: Placement, dtype: torch.dtype):
        self.ckpt, self.placement, self.dtype = ckpt, placement, dtype

    def _share(self, make) -> tuple[torch.Tensor, object]:
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
        comm = _comm_device(pl)
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
        return self._share(lambda: (self.ckpt.read(key).to(dev, dtype), None))[0]

    def quantized(self, key: str, module) -> tuple[torch.Tensor, object]:
        """(packed 4-bit weight, QuantState) of `module`'s weight on every rank."""
        from bitsandbytes.functional import QuantState

        dev = self.placement.device

        def make():
            if self.ckpt.prequantized:
                packed = self.ckpt.read(key).to(dev)
                stats = self.ckpt.quant_stats(key)
            else:
                packed, qs = quantize_from(self.ckpt, key, module, self.dtype, dev)
                stats = {k: v.cpu() if torch.is_tensor(v) else v for k, v in qs.as_dict(packed=True).items()}
            return packed, stats

        packed, stats = self._share(make)
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
        comm = _comm_device(pl)
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


QUANT_CHUNK = 2**18  # elements quantized at once: a multiple of every block size and storage width


def quantize(weight: torch.Tensor, module) -> tuple[torch.Tensor, object]:
    """Quantize one weight exactly as transformers' loader does (Params4bit(...).to(device), that is
    bitsandbytes.functional.quantize_4bit), with the module's block size, double quantization, type and
    storage dtype, but QUANT_CHUNK elements at a time.

    Why not one call: bitsandbytes' kernel works on the whole tensor at once, and on CPU its reference
    kernel holds about 13 bytes of temporaries per element (a float32 copy, int32 codes, ...): 150 MB for
    one 2048 x 5632 weight, more than the packed model of a small run. The first quantization level is
    independent per block of `blocksize` elements, so the same kernel over block-aligned pieces gives the
    same packed bytes and absmax; the second level (double quantization: the absmax minus its mean,
    quantized in blocks of 256) runs once on the whole absmax, as bitsandbytes runs it. The result equals
    quantize_4bit's byte for byte (tests/unit/test_stream_quantize.py)."""
    flat = weight.reshape(-1)
    pieces = (flat[start:start + QUANT_CHUNK] for start in range(0, flat.numel(), QUANT_CHUNK))
    return quantize_pieces(pieces, weight.shape, weight.dtype, weight.device, module)


def quantize_from(ckpt: Checkpoint, key: str, module, dtype: torch.dtype, device) -> tuple[torch.Tensor, object]:
    """`quantize` of the checkpoint's weight `key`, read piece by piece (read_pieces), so the reader never
    holds the whole unquantized weight either."""
    pieces = read_pieces(ckpt, key, module, dtype, device)
    return quantize_pieces(pieces, torch.Size((module.out_features, module.in_features)), dtype, device, module)


def piece_bounds(module) -> tuple[bool, list[tuple[int, int]]]:
    """(by rows, the [start, stop) flat element ranges) of the pieces a 4-bit weight is quantized in: blocks
    of whole rows of about QUANT_CHUNK elements, read alone. A block must be a whole number of quantization
    blocks for the result to equal quantize_4bit's; when the row length does not allow it (no real
    model's), QUANT_CHUNK elements at a time of the weight read whole. Every rank can compute them."""
    rows, cols = module.out_features, module.in_features
    step = max(1, QUANT_CHUNK // cols)
    if (step * cols) % module._finetune_q["blocksize"]:
        n = rows * cols
        return False, [(a, min(a + QUANT_CHUNK, n)) for a in range(0, n, QUANT_CHUNK)]
    return True, [(s * cols, min(s + step, rows) * cols) for s in range(0, rows, step)]


def read_pieces(ckpt: Checkpoint, key: str, module, dtype: torch.dtype, device):
    """The pieces of `piece_bounds`, read, cast and flattened, one at a time."""
    by_rows, bounds = piece_bounds(module)
    if by_rows:
        cols = module.in_features
        for a, b in bounds:
            yield ckpt.read_rows(key, a // cols, b // cols).to(device, dtype).reshape(-1)
        return
    flat = ckpt.read(key).to(device, dtype).reshape(-1)
    for a, b in bounds:
        yield flat[a:b]


def quantize_pieces(pieces, shape: torch.Size, dtype: torch.dtype, device, module) -> tuple[torch.Tensor, object]:
    """quantize_4bit of the weight whose flat elements are the concatenation of `pieces`, each (but the
    last) a whole number of quantization blocks."""
    packed, absmax = [], []
    for piece in pieces:
        p, a = quantize_piece(piece, module)
        packed.append(p)
        absmax.append(a)
        del piece, p, a
    return torch.cat(packed), quant_state(absmax, shape, dtype, device, module)


def quantize_piece(piece: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, absmax) of one block-aligned piece: bitsandbytes' first quantization level alone."""
    q = module._finetune_q
    p, a = torch.ops.bitsandbytes.quantize_4bit.default(piece, q["blocksize"], q["quant_type"], q["quant_storage"])
    trim_heap()  # the kernel's ~13 bytes/element of temporaries (see quantize), freed but kept by malloc
    return p, a


def quant_state(absmax: list, shape: torch.Size, dtype: torch.dtype, device, module):
    """The QuantState of a weight from its pieces' absmax: the second level (double quantization: the absmax
    minus its mean, in blocks of 256) runs once on the whole absmax, as bitsandbytes runs it."""
    import bitsandbytes.functional as F

    q = module._finetune_q
    absmax = torch.cat(absmax)
    code = F.get_4bit_type(q["quant_type"], device=device)
    common = dict(shape=shape, dtype=dtype, blocksize=q["blocksize"], code=code, quant_type=q["quant_type"])
    if not q["compress_statistics"]:
        return F.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    return F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)


def materialize(stream: Stream, module, pname: str):
    """The whole parameter `pname` of `module`, on every rank (collective)."""
    import bitsandbytes as bnb

    key = module._finetune_keys[pname]
    if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
        packed, qs = stream.quantized(key, module)
        module.quant_state = qs
        return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, module=module, bnb_quantized=True,
                                 **module._finetune_q)
    return torch.nn.Parameter(stream.plain(key, module._finetune_dtypes[pname]), requires_grad=False)


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
