"""One optimizer step of the loop: micro-batches to the device, forward/backward with gradient sync only on
the last micro-batch, the fp16 loss scaler, clipping, the optimizer and schedule, and a stop check between
micro-batches. `run` is what the steps share (finetune.train.run.Run).

On a GPU the host waits for the device once per step: the step's loss stays on the device until the end,
where it is reduced over ranks and read with the gradient norm in one transfer. What must be agreed on
before (the step's trained tokens, counted on the CPU batches) and between micro-batches (the stop flag, a
host value) goes over a host-side group (`run.host_group`, gloo), which never waits for the GPU; so the stop
is still seen after every micro-batch. (fp16's loss scaler reads its overflow flag once more per step.)"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from finetune.train.loss import batch_kernels, device_batch, token_loss_sum, trained_tokens
from finetune.train.preference import pair_loss, pair_units, step_metrics
from finetune.train.scaling import LossScaler

if TYPE_CHECKING:
    from finetune.train.run import Run


def next_micro_batches(run: Run) -> tuple[list[dict], int, list[int]]:
    """(the next optimizer step's micro-batches on the device, their trained tokens on this rank, counted on
    the host copies, and for preference batches their [pairs, chosen tokens]), going on to the next epoch at
    an epoch's end."""
    micro, tokens, units = [], 0, [0, 0]
    while len(micro) < run.recipe.train.gradient_accumulation_steps:
        if run.cursor >= len(run.batches):
            run.epoch, run.cursor = run.epoch + 1, 0
            run.batches = run.epoch_batches()
        batch = run.batches[run.cursor]
        tokens += trained_tokens(batch)
        if "ref_logps" in batch:
            units = [u + v for u, v in zip(units, pair_units(batch))]
        micro.append(device_batch(batch, run.acc.device))
        run.cursor += 1
    return micro, tokens, units


def optimizer_step(run: Run, stop=None) -> tuple[float, torch.Tensor | None, float] | None:
    """One optimizer step: accumulate the micro-batches' gradients, clip, step the optimizer (through the
    fp16 loss scaler) and the schedule. Returns (mean token loss of the step over all ranks, gradient norm
    before clipping or None, trained tokens of the step over all ranks); None when `stop` was requested
    between micro-batches: the step is abandoned and the position rewound to its start, so the checkpoint
    written next is exactly the state after the previous step."""
    acc, t, device_type = run.acc, run.recipe.train, run.acc.device.type
    host0 = time.thread_time()  # this thread's CPU time: Python, kernel launches, optimizer bookkeeping
    start = (run.epoch, run.cursor)
    # Gather this step's micro-batches first: the loss is normalised by the trained tokens of the
    # whole step on every rank, which must be known before the first backward.
    micro, tokens, units = next_micro_batches(run)
    step_tokens = host_sum(run, tokens)
    # Preference steps: the loss is a mean over the step's pairs (and ORPO's NLL over its chosen tokens).
    norm = (host_sum(run, units[0]), host_sum(run, units[1])) if t.method != "sft" else None
    loss_total, stats = None, {}  # on the device until the end of the step
    for i, b in enumerate(micro):
        last = i == len(micro) - 1
        aux = [] if run.aux_coef else None  # an MoE router's balance loss (train.balance): asked for only when trained
        with gradient_sync(run, last), batch_kernels(b, device_type, t):
            # Gradients are averaged over ranks by DDP/FSDP, hence the factor `world`.
            if norm is None:
                loss_sum, _ = token_loss_sum(run.model, b, device_type, t, run.offload, aux)
                objective = loss_sum * acc.num_processes / step_tokens
            else:  # already divided by the step's pairs: loss_sum is this micro-batch's share of the mean
                loss_sum, b_stats = pair_loss(run.model, b, device_type, t, run.offload, norm, aux)
                objective = loss_sum * acc.num_processes
                stats = {k: stats.get(k, 0) + v for k, v in b_stats.items()}
            if aux:
                # Each forward's balance loss is a mean over its own tokens: the step trains its mean over the
                # micro-batches and (the gradient average, no factor `world`) over the ranks.
                objective = objective + run.aux_coef * aux[0] / len(micro)
                stats["aux_loss"] = stats.get("aux_loss", 0) + aux[0].detach()
            acc.backward(run.scaler.scale(objective))
        loss_total = loss_sum.detach() if loss_total is None else loss_total + loss_sum.detach()
        # A preempted worker is killed ~30 s after SIGTERM; a whole step can take longer. Every rank asks
        # after every micro-batch (one scalar all-reduce over the host group, so all agree on where to stop).
        if not last and stop is not None and stop.requested(acc, run.host_group):
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
    # Up to the step's one planned wait for the device (the read below): on a GPU, host time near the step's
    # wall time means the device waits on the host. (A wait before it, if any, counts too: CUDA spins.)
    run.host_s += time.thread_time() - host0
    loss, grad_norm, sums = read_step_values(acc, loss_total, grad_norm, stats)
    # the step's mean balance loss, averaged over ranks as the loss is (None: not trained)
    run.step_aux = sums.pop("aux_loss") / (len(micro) * acc.num_processes) if "aux_loss" in sums else None
    if norm is not None:
        run.step_stats = step_metrics(sums)
        return loss, grad_norm, step_tokens
    return loss / step_tokens, grad_norm, step_tokens


def read_step_values(acc, loss_total: torch.Tensor, grad_norm, sums: dict | None = None
                     ) -> tuple[float, float | None, dict]:
    """(the step's loss summed over ranks, the gradient norm, each of `sums` summed over ranks: a preference
    step's statistics) as floats, in one reduce and one device-to-host read: the step's only wait for the
    GPU (measured on an H200, benchmarks/gpu/syncs.py). The norm is already the same on every rank (clipping
    reduces it)."""
    keys = sorted(sums or {})
    summed = torch.stack([loss_total.reshape(()).to(torch.float64)]
                         + [torch.as_tensor(sums[k]).to(loss_total.device, torch.float64).reshape(()) for k in keys])
    if acc.num_processes > 1:
        summed = acc.reduce(summed, reduction="sum")
    values = [summed]
    if grad_norm is not None:
        from torch.distributed.tensor import DTensor

        norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else torch.as_tensor(grad_norm)
        values.append(norm.to(summed.device, torch.float64).reshape(1))
    read = torch.cat(values).tolist()
    return read[0], (read[-1] if grad_norm is not None else None), dict(zip(keys, read[1:1 + len(keys)]))


def gradient_sync(run: Run, last: bool):
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


def rewind(run: Run, start: tuple[int, int]) -> None:
    """Back to the data position `start` (epoch, cursor), e.g. after an abandoned step."""
    if run.epoch != start[0]:
        run.epoch = start[0]
        run.batches = run.epoch_batches()
    run.cursor = start[1]


def host_sum(run: Run, value: float) -> float:
    """`value` summed over ranks through the host group (no wait for the GPU), or global_sum without one."""
    if run.acc.num_processes == 1:
        return value
    if run.host_group is None:
        return global_sum(run.acc, value)
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=run.host_group)
    return float(t.item())


def global_sum(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum").item())


def make_scaler(train_spec, acc) -> LossScaler:
    """The fp16 loss scaler of the run's steps (disabled for any other precision)."""
    from accelerate.utils import DistributedType

    sharded = acc.distributed_type == DistributedType.FSDP
    return LossScaler(train_spec.mixed_precision, acc.device.type, sharded)
