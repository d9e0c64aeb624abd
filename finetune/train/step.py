"""One optimizer step of the loop: micro-batches to the device, forward/backward with gradient sync only on
the last micro-batch, the fp16 loss scaler, clipping, the optimizer and schedule, and a stop check between
micro-batches. `run` is the loop's Run (finetune.train.loop)."""
from __future__ import annotations

import contextlib

import torch

from finetune.weights.device import to_device
from finetune.train.loss import batch_kernels, token_loss_sum, trained_tokens
from finetune.train.scaling import LossScaler


def next_micro_batches(run) -> list[dict]:
    """The next optimizer step's micro-batches on the device, going on to the next epoch at an epoch's end."""
    micro = []
    while len(micro) < run.recipe.train.gradient_accumulation_steps:
        if run.cursor >= len(run.batches):
            run.epoch, run.cursor = run.epoch + 1, 0
            run.batches = run.epoch_batches()
        micro.append(to_device(run.batches[run.cursor], run.acc.device))
        run.cursor += 1
    return micro


def optimizer_step(run, stop=None) -> tuple[float, torch.Tensor | None, float] | None:
    """One optimizer step: accumulate the micro-batches' gradients, clip, step the optimizer (through the
    fp16 loss scaler) and the schedule. Returns (mean token loss of the step over all ranks, gradient norm
    before clipping or None, trained tokens of the step over all ranks); None when `stop` was requested
    between micro-batches: the step is abandoned and the position rewound to its start, so the checkpoint
    written next is exactly the state after the previous step."""
    acc, t, device_type = run.acc, run.recipe.train, run.acc.device.type
    start = (run.epoch, run.cursor)
    # Gather this step's micro-batches first: the loss is normalised by the trained tokens of the
    # whole step on every rank, which must be known before the first backward.
    micro = next_micro_batches(run)
    step_tokens = global_sum(acc, sum(trained_tokens(b) for b in micro))
    loss_total = 0.0
    for i, b in enumerate(micro):
        last = i == len(micro) - 1
        with gradient_sync(run, last), batch_kernels(b, device_type, t):
            loss_sum, _ = token_loss_sum(run.model, b, device_type, t, run.recipe.model.activation_offloading)
            # Gradients are averaged over ranks by DDP/FSDP, hence the factor `world`.
            acc.backward(run.scaler.scale(loss_sum * acc.num_processes / step_tokens))
        loss_total += loss_sum.item()
        # A preempted worker is killed ~30 s after SIGTERM; a whole step can take longer. Every rank asks
        # after every micro-batch (one scalar all-reduce, so all agree on where to stop).
        if not last and stop is not None and stop.requested(acc):
            run.optimizer.zero_grad(set_to_none=True)
            rewind(run, start)
            return None
    run.scaler.unscale(run.optimizer)
    grad_norm = acc.clip_grad_norm_(run.model.parameters(), t.max_grad_norm) if t.max_grad_norm else None
    # A skipped fp16 step (inf/nan gradients) is counted and logged by the scaler; like Accelerate, the
    # schedule then does not advance either (it counts parameter updates).
    if run.scaler.step(run.optimizer, run.step + 1):
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return global_sum(acc, loss_total) / step_tokens, grad_norm, step_tokens


def gradient_sync(run, last: bool):
    """No gradient all-reduce / reduce-scatter on the micro-batches before a step's last (DDP's no_sync,
    FSDP2's set_requires_gradient_sync). Not for FSDP1: its flat parameters mix the frozen 4-bit storage
    with the adapters, and skipping the reduce-scatter keeps a full-size (unsharded) gradient of the
    whole flat parameter on every rank, about the size of the entire packed model."""
    from accelerate.utils import DistributedType

    acc = run.acc
    fsdp1 = acc.distributed_type == DistributedType.FSDP and acc.state.fsdp_plugin.fsdp_version == 1
    if last or fsdp1 or acc.num_processes == 1:
        return contextlib.nullcontext()
    return acc.no_sync(run.model)


def rewind(run, start: tuple[int, int]) -> None:
    """Back to the data position `start` (epoch, cursor), e.g. after an abandoned step."""
    if run.epoch != start[0]:
        run.epoch = start[0]
        run.batches = run.epoch_batches()
    run.cursor = start[1]


def global_sum(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum").item())


def make_scaler(run) -> LossScaler:
    from accelerate.utils import DistributedType

    sharded = run.acc.distributed_type == DistributedType.FSDP
    return LossScaler(run.recipe.train.mixed_precision, run.acc.device.type, sharded)
