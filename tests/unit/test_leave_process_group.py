"""A finished training command leaves the process group before exiting: NCCL warns at exit about a group
left alive ("destroy_process_group() was not called", seen after every FSDP1 run on an H100)."""
from __future__ import annotations

import torch.distributed as dist

from finetune.train.parallel import leave_process_group


def test_the_group_is_gone_after_a_run(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    leave_process_group()
    assert not dist.is_initialized()
    leave_process_group()  # a one-process run has none: nothing to do


def test_the_training_command_leaves_it():
    import inspect

    from finetune.commands import train

    src = inspect.getsource(train.run)
    assert src.index("leave_process_group()") > src.index("result = train(")
