"""`finetune slurm RECIPE [key=value ...] [--exec]`: the `accelerate launch` command for this node of a
SLURM job, read from SLURM's environment (scripts/slurm/finetune.sbatch runs it once per node)."""
from __future__ import annotations

from finetune.commands.common import add_recipe_arguments, count


def register(sub) -> None:
    p = sub.add_parser("slurm", help="this SLURM node's accelerate launch command",
                       description="Build the `accelerate launch` command for one node of a SLURM job.")
    add_recipe_arguments(p)
    p.add_argument("--config-file", help="Accelerate launcher YAML (its machine/process fields are overridden)")
    p.add_argument("--gpus-per-node", type=count(1, 1024), help="default: SLURM_GPUS_ON_NODE")
    p.add_argument("--exec", action="store_true", help="replace this process with the launch command")
    p.set_defaults(run=run)


def run(a) -> int:
    import os
    import shlex
    from pathlib import Path

    from finetune.commands.common import split_overrides
    from finetune.plan.slurm import launch_args
    from finetune.util.errors import RecipeError

    split_overrides(a)
    if a.config_file and not Path(a.config_file).is_file():
        raise RecipeError([f"--config-file {a.config_file}: no such file"])
    args = launch_args(os.environ, a.recipe, a.config_file, a.gpus_per_node, a.overrides)
    print(shlex.join(args), flush=True)
    if a.exec:
        os.execvp(args[0], args)
    return 0
