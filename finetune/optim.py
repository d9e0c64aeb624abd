"""Optimizer and learning-rate schedule from the recipe's `train` section."""
from __future__ import annotations

import torch

from .recipe import TrainSpec

_warned = set()


def _notice_once(msg: str):
    from .distributed import print0

    if msg not in _warned:
        _warned.add(msg)
        print0(msg)


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (LoRA A/B), never on biases or norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return groups


def build_optimizer(model, train: TrainSpec) -> torch.optim.Optimizer:
    groups = param_groups(model, train.weight_decay)
    kw = dict(lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon)
    if train.optimizer == "adamw_torch":
        return torch.optim.AdamW(groups, **kw)
    import bitsandbytes as bnb

    if train.optimizer == "paged_adamw_8bit":
        if torch.cuda.is_available():
            return bnb.optim.PagedAdamW8bit(groups, **kw)
        _notice_once("optimizer: paged_adamw_8bit -> adamw_8bit (paged memory needs CUDA)")
    return bnb.optim.AdamW8bit(groups, **kw)


def build_scheduler(optimizer, train: TrainSpec, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[train.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=train.warmup_steps, num_training_steps=total_steps)
