"""The divergence guard: a run whose loss or gradient norm is NaN or infinite stops, and a non-finite adapter
is never published.

Without a loss scaler, a step with a non-finite gradient has already been applied when it is seen (clipping by
an infinite or NaN norm turns the gradients into NaN, and the optimizer writes them into the adapter), so
continuing cannot recover: the guard stops at the first such step, before it is checkpointed. The checkpoints
on disk are all from earlier, finite steps. (With fp16 loss scaling, the scaler skips steps whose gradients
overflow and lowers its scale; those steps are its business, not a divergence.)
"""
from __future__ import annotations

import math

import torch

from finetune.util.errors import RunError


def _finite(x) -> bool:
    return x is None or math.isfinite(float(x))


def _params_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)


def check_step(run, loss: float, grad_norm, total=lambda v: v) -> None:
    """RunError (exit 3) when this step diverged. `loss` and `grad_norm` are already the same on every rank;
    without clipping (no norm) the trained parameters are checked, and `total` (a sum over ranks) makes every
    rank agree."""
    if getattr(getattr(run, "scaler", None), "enabled", False) and _finite(loss):
        return  # fp16 loss scaling: an overflowing step was skipped by the scaler, not applied
    bad = not (_finite(loss) and _finite(grad_norm))
    if grad_norm is None and not bad:
        bad = total(0.0 if _params_finite(run.model) else 1.0) > 0
    if not bad:
        return
    what = f"loss {loss}" + (f", gradient norm {float(grad_norm)}" if grad_norm is not None else "")
    raise RunError([f"train.learning_rate: training diverged at step {run.step} ({what}); nothing of this step "
                       "was saved and no adapter was exported, the checkpoints on disk hold the last finite weights. "
                       "Start again in a new output.dir with a lower train.learning_rate or lora.alpha (or "
                       "train.max_grad_norm set, or train.mixed_precision: bf16 instead of fp16)"])


def assert_finite_adapter(state: dict) -> None:
    """Before an adapter is published: every tensor finite."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise RunError([f"train.learning_rate: the trained adapter holds NaN/inf values ({bad[0]}, "
                           f"{len(bad)} tensors); it was not exported"])
