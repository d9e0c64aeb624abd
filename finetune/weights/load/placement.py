"""What this process keeps of the base model's weights (`whole`, `fsdp1`, `fsdp2`: see the package doc) and
where it talks to the other processes of its machine."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PLACEMENTS = ("whole", "fsdp1", "fsdp2")


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


def default_placement() -> Placement:
    """One process holding the whole model, where transformers' `from_pretrained` puts a 4-bit model: the
    current CUDA device when there is one (bitsandbytes' 4-bit kernels are fast there), else the CPU. What
    `eval`, `generate`, `quantize` and the merge's check load with; training passes `placement_for`."""
    if torch.cuda.is_available():
        return Placement(device=torch.device("cuda", torch.cuda.current_device()))
    return Placement()


def placement_for(accelerator) -> Placement:
    """The placement an Accelerator implies: FSDP (1 or 2) shards, anything else holds the whole model.
    One reader per machine: on several machines each gets a process group of its own processes (torchrun
    numbers ranks machine by machine), so the checkpoint crosses no network; on one machine, the default
    group."""
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
    # Accelerate names the CPU `cpu:0` under a launcher; torch copies a tensor between `cpu` and `cpu:0`, so
    # a rank receiving a broadcast table would hold it twice (measured: +1 GiB for a 1 GiB fp32 embedding).
    device = torch.device("cpu") if accelerator.device.type == "cpu" else accelerator.device
    return Placement(mode, rank, world, device, rank - accelerator.local_process_index, local_world, group)


def comm_device(pl: Placement) -> torch.device:
    """Where broadcast buffers live: gloo moves host tensors only (the CPU harness); NCCL needs them on the GPU."""
    import torch.distributed as dist

    return torch.device("cpu") if dist.get_backend() == "gloo" else pl.device
