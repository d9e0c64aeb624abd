"""The load phase of a run, as the streaming loader (weights/load/reader.py, weights/load/skeleton.py) runs it: memory per GPU,
per process and per machine while the base model arrives, from shapes alone.

One reader per machine (its local rank 0) reads one checkpoint tensor at a time:
- a 4-bit target weight in blocks of rows of about PIECE elements (each read in the checkpoint dtype, cast
  to model.dtype and quantized); one process or replicas: its packed pieces concatenated at the end, then
  sent whole to every rank of the machine; under FSDP (1 or 2), each piece's packed bytes go at once to the
  ranks whose part they fall in (the quantization state, small, goes whole to every rank);
- a plain tensor (embeddings, head, norms) whole, cast to model.dtype, and sent whole; except under FSDP
  (1 or 2), where the reader reads the rows of each rank's part alone and sends them to that rank alone.

Each rank keeps its part:
- one process or replicas: the whole model, built up one tensor at a time;
- FSDP2: a dim-0 chunk of every parameter (1/world), plus the whole quantization state;
- FSDP1: its slice of every flat parameter (1/world: FSDP1 flattens and shards the model unit by unit, each
  unit given memory just before, then the slice is filled, weights/shard/fsdp1.py), plus the whole quantization
  state.

So the peak is what a process finally holds plus the biggest transient: the largest tensor in flight, or
under FSDP1 its largest unit whole twice while FSDP1 flattens it.
LoRA adapters exist whole in every process before `prepare` shards them.
"""
from __future__ import annotations

from finetune.plan.archs import Arch

CKPT_BYTES = 2  # hub checkpoints store bf16 (or fp16)


def tensors(arch: Arch) -> list[tuple[int, bool]]:
    """(elements, is a 4-bit target) of every checkpoint tensor of the largest kinds (small norms aside)."""
    lin = [(x.d_in * x.d_out, True) for x in arch.linears() for _ in range(x.count)]
    lin += [(x.d_in * x.d_out * x.count, False) for x in arch.expert_params()]  # fused 3-D, model dtype
    emb = [(arch.vocab * arch.hidden, False)] * (1 if arch.tied else 2)
    return lin + emb


PIECE = 2**18  # weights/load/quantize.QUANT_CHUNK: elements of a 4-bit weight read and quantized at once


def tables_whole(s, shard: int) -> bool:
    """FSDP leaves the frozen embedding and head whole on every rank (train.parallel.replicated_modules)."""
    return shard > 1 and s.strategy == "fsdp" and getattr(s, "tables_whole", True) and not s.offload


def table_bytes(arch: Arch, s, dtype_bytes: dict) -> int:
    """Bytes of the input embedding and output head (one table when tied), in model.dtype."""
    return arch.vocab * arch.hidden * (1 if arch.tied else 2) * dtype_bytes[s.model_dtype]


def whole_table_bytes(arch: Arch, s, dtype_bytes: dict, shard: int) -> int:
    """Bytes of the tables each rank holds whole (0 when FSDP shards them, or nothing is sharded)."""
    return table_bytes(arch, s, dtype_bytes) if tables_whole(s, shard) else 0


def fsdp1_unit_bytes(arch: Arch, s, w: dict, dtype_bytes: dict, shard: int) -> int:
    """Bytes of FSDP1's largest wrapped unit, unsharded: a decoder layer (its 4-bit weights, adapters and
    norms), or the root when it holds the tables (when FSDP shards them: offloaded runs)."""
    tables = table_bytes(arch, s, dtype_bytes)
    layer = (w["base_4bit"] + w.get("experts", 0) + w["lora"] + w["unquantized"] - tables) // arch.layers
    return max(layer, 0 if tables_whole(s, shard) else tables)


def _sizes(arch: Arch, s, dtype_bytes: dict, shard: int, four_bit_kind: bool) -> tuple[int, int]:
    """(bytes in flight on the reader for the biggest tensor, bytes a receiver holds for it) among the 4-bit
    targets or the plain tensors (`four_bit_kind`), `shard` the FSDP shard count (1: whole)."""
    mb = dtype_bytes[s.model_dtype]
    per_rank = shard > 1 and s.strategy == "fsdp"
    reader = received = 0
    for numel, four_bit in tensors(arch):
        if four_bit != four_bit_kind:
            continue
        if not four_bit and tables_whole(s, shard):
            # a replicated table: read whole and cast on the reader, received into the parameter kept
            flight, got = numel * (CKPT_BYTES + (mb if mb != CKPT_BYTES else 0)), 0
        elif four_bit and s.quant in ("nf4", "fp4") and per_rank:
            # FSDP: each piece is sent on as it is quantized (weights/load/packed.py): the reader holds one row
            # block read and cast and its packed bytes; a rank receives only what it keeps
            piece = min(numel, PIECE)
            flight, got = piece * (CKPT_BYTES + mb) + piece // 2, 0
        elif four_bit and s.quant in ("nf4", "fp4"):
            packed = (numel + 1) // 2
            # one row block read and cast, beside the packed pieces; their concatenation is the weight kept
            # (counted in what the process finally holds), so nothing arrives beyond it (measured on an H200:
            # the 8B's whole load peaks 0.02 GiB over the loaded weights, benchmarks/RESULTS_GPU.md)
            flight, got = min(numel, PIECE) * (CKPT_BYTES + mb) + packed, 0
        elif per_rank:
            part = -(-numel // shard)  # FSDP: each rank's rows alone
            flight, got = part * (CKPT_BYTES + (mb if mb != CKPT_BYTES else 0)), part * mb
        else:
            # whole: the tensor read arrives as the tensor kept; a cast to model.dtype holds the checkpoint's copy
            flight, got = numel * (CKPT_BYTES if mb != CKPT_BYTES else 0), 0
        reader, received = max(reader, flight), max(received, got)
    return reader, received


def process_bytes(arch: Arch, s, w: dict, shard: int, dtype_bytes: dict, reader: bool) -> int:
    """Peak bytes one process holds while loading (on its device: the GPU, or RAM in a CPU run), beyond
    what it held before. `w`: estimate.weight_terms; `shard`: the FSDP shard count (1: whole)."""
    on_device = 0 if s.offload else 1  # FSDP's CPU offload keeps the shards in RAM (machine_bytes)
    tables = whole_table_bytes(arch, s, dtype_bytes, shard)
    plain = on_device * (tables + -(-(w["unquantized"] - tables) // shard))
    # Under FSDP the adapters are attached to CPU placeholders, so they reach the device sharded; whole
    # otherwise. The quantization state is whole on every rank.
    final = w["quant_constants"] + plain + on_device * (-(-(w["base_4bit"] + w.get("experts", 0)) // shard)
                                                        + -(-w["lora"] // shard))
    peak = final
    # Plain tensors load first (weights/load/skeleton.py, fsdp1.py, fsdp2.py), so their transients come beside
    # the plain tensors alone; a 4-bit weight's beside everything.
    for four_bit, held in ((False, plain), (True, final)):
        flight, received = _sizes(arch, s, dtype_bytes, shard, four_bit)
        # what arrives, beside the part of it kept (an FSDP rank's part of a packed weight is a copy)
        transient = received + (received // shard if shard > 1 else 0)
        if reader:
            transient = max(transient, flight + (received // shard if shard > 1 else 0))
        peak = max(peak, held + transient)
    if s.strategy == "fsdp" and s.fsdp_version == 1:
        # FSDP1 flattens each unit from memory param_init gave it (weights/shard/fsdp1.py): the unit's parameters
        # and their concatenation, on the device, beside the shards of the units before it (the whole tables
        # come after the wrap); then this rank's slice of it stays
        unit = fsdp1_unit_bytes(arch, s, w, dtype_bytes, shard)
        peak = max(peak, final - on_device * tables + 2 * unit - unit // shard)
    return peak


def machine_bytes(arch: Arch, s, w: dict, shard: int, dtype_bytes: dict, process_ram: int) -> int:
    """Peak CPU RAM of one machine while loading: its processes, and on a CPU run their weights too; on
    GPUs only the reader's host copy of what it reads at once (safetensors' read: a row block of a 4-bit
    weight, a plain tensor or, under FSDP, one rank's rows of it)."""
    procs = s.per_machine
    if s.device == "cpu":
        return procs * process_ram + process_bytes(arch, s, w, shard, dtype_bytes, True) + \
            (procs - 1) * process_bytes(arch, s, w, shard, dtype_bytes, False)
    per_rank = shard > 1 and s.strategy == "fsdp"
    quantized = s.quant in ("nf4", "fp4")
    biggest = max(min(n, PIECE) if four_bit and quantized else (-(-n // shard) if per_rank else n)
                  for n, four_bit in tensors(arch)) * CKPT_BYTES  # the reader's host copy of what it reads
    offloaded = (-(-(w["base_4bit"] + w.get("experts", 0)) // shard) + -(-w["unquantized"] // shard)) * procs if s.offload else 0
    adapters = w["lora"] * procs if s.strategy == "fsdp" and shard > 1 else 0  # whole until prepare shards them
    return procs * process_ram + biggest + offloaded + adapters
