"""MoE experts in the read-back check: the sources as llama.cpp's converter names them before its name map.

The converter writes each MoE layer's experts as one stacked tensor per projection (`blk.N.ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`: [experts, rows, cols] in Hugging Face order). It gets there from either layout
a merged checkpoint can have:
- per expert, the hub's layout (`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`):
  it collects a layer's experts and `torch.stack`s them in expert order under `<...>.experts.<proj>.weight`;
- fused 3-D, transformers 5's layout (`mlp.experts.gate_up_proj` [E, 2i, h], `mlp.experts.down_proj` [E, h, i]):
  down_proj passes as `<...>.experts.down_proj.weight`; gate_up_proj is split at half its rows into
  `<...>.experts.gate_proj.weight` (first half) and `<...>.experts.up_proj.weight` (Qwen3-MoE's converter).
`stacked_sources` presents the sources the same way, so gguf-py's own TensorNameMap (which knows those stacked
names, e.g. `model.layers.{bid}.mlp.experts.gate_proj` and `model.layers.{bid}.block_sparse_moe.experts.w1`)
maps them, and every stacked GGUF tensor is compared with the merged weights it came from. Stacks are built
when read, one at a time, so the check never holds a second copy of all the experts.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_PER_EXPERT = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")
_FUSED_GATE_UP = "experts.gate_up_proj"


class StackedSources(Mapping):
    """HF name -> tensor, with per-expert weights stacked and fused gate_up split (see the module doc);
    every other source unchanged. `parts[name]` says what a derived name was built from, for the report."""

    def __init__(self, sources: Mapping):
        self._sources = sources
        self._build: dict[str, tuple] = {}
        self.parts: dict[str, str] = {}
        groups: dict[tuple[str, str], dict[int, str]] = {}
        for name in sources:
            m = _PER_EXPERT.match(name)
            if m:
                groups.setdefault((m["stem"], m["proj"]), {})[int(m["expert"])] = name
            elif name.endswith(_FUSED_GATE_UP) and sources[name].dim() == 3:
                stem = name[: -len("gate_up_proj")]
                for half, proj in enumerate(("gate_proj", "up_proj")):
                    self._build[f"{stem}{proj}.weight"] = ("half", name, half)
                    self.parts[f"{stem}{proj}.weight"] = name
            elif ".experts." in name and not name.endswith(".weight") and sources[name].dim() == 3:
                self._build[f"{name}.weight"] = ("same", name)  # the converter's name for a fused down_proj
                self.parts[f"{name}.weight"] = name
            else:
                self._build[name] = ("same", name)
        for (stem, proj), by_expert in groups.items():
            names = [by_expert[e] for e in sorted(by_expert)]
            if sorted(by_expert) != list(range(len(names))):  # a gap: the converter would fail; compare each alone
                self._build.update({n: ("same", n) for n in names})
                continue
            self._build[f"{stem}.{proj}.weight"] = ("stack", names)
            self.parts[f"{stem}.{proj}.weight"] = f"{names[0]} .. {names[-1]} ({len(names)} experts)"

    def __getitem__(self, name: str) -> torch.Tensor:
        how = self._build[name]
        if how[0] == "same":
            return self._sources[how[1]]
        if how[0] == "stack":
            return torch.stack([self._sources[n] for n in how[1]])
        fused = self._sources[how[1]]
        half = fused.shape[1] // 2
        return fused[:, how[2] * half:(how[2] + 1) * half, :]

    def __iter__(self):
        return iter(self._build)

    def __len__(self) -> int:
        return len(self._build)
