"""The values the phases of a run hand on (finetune.train.loop._train), and `Run`: what the optimizer steps share.

Each phase returns what it makes: `Setup` (setup), `Adapters` (add_adapters), `Optim` (build_optim); `Run` is
made once, after the last phase before the steps, from those and what the restore, the forward setup and
prepare_steps returned. Also here: this rank's micro-batches of an epoch (`epoch_batches`), the step count
(`plan_steps`) and the held-out micro-batches (`held_out_batches`), which the phases and the steps both use.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.data import batching
from finetune.train import balance
from finetune.recipe import Recipe
from finetune.util.errors import RecipeError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

    from finetune.data.prepare import Prepared
    from finetune.train.compiled import CompiledLayers
    from finetune.train.keepers.memory import PhaseMemory
    from finetune.train.keepers.metrics import Metrics
    from finetune.train.offload import ActivationOffload
    from finetune.train.scaling import LossScaler


@dataclass(frozen=True)
class Setup:
    """setup's values: the Accelerator, the tokenizer, the prepared data, the host-side group (None: one
    process, or the default group is gloo already)."""
    acc: Accelerator
    tok: PreTrainedTokenizerBase
    prepared: Prepared
    host_group: ProcessGroup | None


@dataclass(frozen=True)
class Adapters:
    """add_adapters' values: the PeftModel (not wrapped yet), the packing layout its attention allows (None:
    dynamic padding), the run's optimizer step count and the decoder layers checkpointed (None: all)."""
    model: torch.nn.Module
    layout: str | None
    total_steps: int
    checkpointed: int | None = None


@dataclass(frozen=True)
class Optim:
    """build_optim's values: the optimizer over the adapters, its schedule (stepped by the loop once per
    applied step, never prepared by Accelerate) and the fp16 loss scaler (disabled otherwise)."""
    optimizer: Optimizer
    scheduler: LRScheduler
    scaler: LossScaler


@dataclass
class Run:
    """What the optimizer steps share. step / epoch / cursor are the data position a checkpoint records
    (cursor: micro-batches consumed in the current epoch); `batches` are this rank's for `epoch`;
    `step_stats` the last preference step's rewards, margin and accuracy (train.preference); `aux_coef` the weight
    of an MoE router's balance loss (train.balance)."""
    recipe: Recipe
    run_dir: Path
    acc: Accelerator
    tok: PreTrainedTokenizerBase
    prepared: Prepared
    host_group: ProcessGroup | None  # parallel.host_group: host-side agreement beside a GPU process group
    model: torch.nn.Module  # wrapped for the strategy
    layout: str | None
    total_steps: int
    optimizer: Optimizer
    scheduler: LRScheduler
    scaler: LossScaler
    offload: ActivationOffload | None  # the context of every training forward (None: off)
    memory: PhaseMemory
    metrics: Metrics
    eval_batches: list[dict]  # this rank's held-out micro-batches
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    step_stats: dict | None = None
    host_s: float = 0.0  # host CPU time of the steps since the last logged one (train.step.optimizer_step)
    compiled: CompiledLayers | None = None  # train.compile's layers (finetune.train.compiled; None: off)
    step_aux: float | None = None  # the last step's MoE balance loss, averaged over ranks (None: not trained)
    batches: batching.EpochBatches = field(init=False)
    aux_coef: float = field(init=False)  # its weight in the trained loss (finetune.train.balance; 0: off)

    def __post_init__(self):
        self.batches = self.epoch_batches()
        self.aux_coef = balance.coefficient(self.recipe.train, self.acc.unwrap_model(self.model))

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def epoch_batches(self) -> batching.EpochBatches:
        return epoch_batches(self.prepared.train, self.epoch, self.recipe, self.acc.process_index,
                             self.acc.num_processes, self.tok.pad_token_id, self.layout)


def epoch_batches(examples, epoch: int, spec, rank: int, world: int, pad_id: int, layout: str | None):
    """This rank's micro-batches for an epoch. The order depends only on (shuffle_seed, epoch), so a
    resumed run sees the same data, and each global batch is split across ranks. `layout` is the packing
    layout the attention backend supports (data.packing_layout), None for dynamic padding."""
    order = batching.shuffled(examples, random.Random(spec.data.shuffle_seed * 1000 + epoch))
    if layout:
        order = batching.pack(order, spec.data.max_seq_len)
    # Collated lazily, one micro-batch when the loop reaches it (data.batching.EpochBatches).
    return batching.EpochBatches(order, spec.train.micro_batch_size, world, rank, pad_id, layout)


def plan_steps(recipe: Recipe, examples: list, world: int, layout: str | None) -> tuple[int, int]:
    """(micro-batches per epoch per rank, total optimizer steps)."""
    t = recipe.train
    rows = len(batching.pack(examples, recipe.data.max_seq_len)) if layout else len(examples)
    per_epoch = rows // (t.micro_batch_size * world)
    if per_epoch < t.gradient_accumulation_steps:
        raise RecipeError([f"data: {rows} rows make {per_epoch} micro-batches of {t.micro_batch_size} x "
                           f"{world} processes, fewer than one optimizer step "
                           f"({t.gradient_accumulation_steps} micro-batches)"])
    total = t.max_steps or math.ceil(t.epochs * per_epoch / t.gradient_accumulation_steps)
    return per_epoch, total


def held_out_batches(recipe: Recipe, s: Setup) -> list[dict]:
    """This rank's share of the held-out rows, in micro-batches."""
    world = s.acc.num_processes
    # Every rank must run the same number of forwards (a sharded forward is collective): drop the remainder.
    held = s.prepared.eval[: len(s.prepared.eval) // world * world]
    return batching.batches(held[s.acc.process_index::world], recipe.train.micro_batch_size,
                            s.tok.pad_token_id, False, recipe.data.max_seq_len)
