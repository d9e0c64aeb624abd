"""The load plan: what the streaming loader found for every parameter of the base (its checkpoint key, dtype,
shape, 4-bit arguments) and the reader that streams it. The loader returns it beside the model; `wrap` and
the shard fill (fsdp2.py, fsdp1.py) take it as an argument. Nothing of it is written onto the model's
modules, so once the fill is done and the plan is dropped, nothing of the reader stays alive.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Source:
    """What a load reads and how, resolved once from the recipe before anything is read (load/model.py):
    each module below takes what it needs from here, and nothing is resolved twice."""
    path: Path  # the local checkpoint directory
    config: object  # its text decoder's transformers config
    dtype: torch.dtype  # the dtype of every parameter that is not 4-bit (model.dtype)
    bnb: object  # the 4-bit BitsAndBytesConfig (weights/bnb.py), or None for an unquantized base
    placement: object  # placement.Placement: what this process keeps and where
    attn: str  # the attention kernel this machine runs (resolve.resolve_attention)
    trust_remote_code: bool


@dataclass
class Entry:
    """One parameter the checkpoint holds, set through its owning module (a tied one is set once)."""
    module: torch.nn.Module
    name: str  # the parameter's name on `module`
    key: str  # its checkpoint key
    dtype: torch.dtype  # the dtype it is stored in here (a 4-bit weight's: its packed storage dtype)
    shape: tuple  # its shape in the model (a 4-bit weight's: the unquantized (out, in))
    q: dict | None = None  # a 4-bit weight's quantization arguments (blocksize, quant_type, ...)
    experts: int = 0  # packed MoE experts (weights/experts/module.py): how many; `shape` is then [E, out, in]

    @property
    def packed(self) -> bool:
        return self.q is not None

    @property
    def rows(self) -> int:
        """Rows of one quantized matrix (of one expert, for packed experts)."""
        return self.shape[1] if self.experts else self.module.out_features

    @property
    def cols(self) -> int:
        return self.shape[2] if self.experts else self.module.in_features

    def packed_elements(self) -> int:
        """Elements (of the storage dtype) of the packed weight: bitsandbytes' (n + 1) // (2 * itemsize);
        packed experts hold one such run per expert."""
        size = torch.empty((), dtype=self.q["quant_storage"]).element_size()
        return max(1, self.experts) * ((self.rows * self.cols + 1) // (2 * size))

    def full_shape(self) -> tuple[int, ...]:
        """The parameter's shape when set: packed 4-bit weights are (bytes / storage itemsize, 1), as
        bitsandbytes' quantize_4bit returns them."""
        return (self.packed_elements(), 1) if self.packed else self.shape


@dataclass
class LoadPlan:
    """Every entry in model order, the machine's reader, and what the fill needs from the wrap."""
    stream: object  # reader.Stream
    entries: list[Entry]
    offload: bool = False  # FSDP2 keeps the shards in CPU memory (set by the wrap from the FSDP plugin)
    materialized: set = field(default_factory=set)  # FSDP1: id() of each parameter param_init gave memory to

    def __post_init__(self):
        self._by_param = {(id(e.module), e.name): e for e in self.entries}

    def find(self, module, name: str) -> Entry | None:
        return self._by_param.get((id(module), name))

    def release(self) -> None:
        """Drop the reader and the entries: after the fill nothing here is needed again."""
        self.entries, self._by_param, self.materialized, self.stream = [], {}, set(), None
