"""`finetune RECIPE [key=value ...]` (also `finetune train RECIPE`, `accelerate launch -m finetune RECIPE`):
the preflight, then the run into `output.dir`."""
from __future__ import annotations

import sys

from finetune.commands.common import add_recipe_arguments, load_recipe


def register(sub) -> None:
    p = sub.add_parser("train", help="train a recipe (`finetune RECIPE` is the same)",
                       description="Train a recipe into its output.dir; re-running the same command resumes.")
    add_recipe_arguments(p)
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished run in output.dir (an adapter, no checkpoint to resume) trained with "
                        "other values; without it such a run is refused")
    p.set_defaults(run=run)


def run(a) -> int:
    import os
    import time
    from pathlib import Path

    # Nothing downloads during a run (the hub would be retried for about 50 s when the weights are missing);
    # here_problems says what to fetch instead. Set before the hub libraries are imported: they read it once.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from finetune.train.preflight import here_problems, preflight
    from finetune.util.errors import RecipeError, RunError
    from finetune.util.log import log

    t0 = time.perf_counter()
    recipe = load_recipe(a)
    # Every check that needs no weights runs before any process loads them.
    problems = preflight(recipe) + here_problems(recipe)
    for p in problems:
        if p.level == "warning":
            print(f"warning: {p.render()}", file=sys.stderr)
    errors = [p for p in problems if p.level == "error"]
    if errors and all(p.path == "device" for p in errors):  # the recipe is fine; this machine's GPU is not
        raise RunError([p.render() for p in errors], a.recipe)
    if errors:
        raise RecipeError([p.render() for p in errors], a.recipe)
    from finetune.recipe.rundir import finished_run

    replaced = None if a.overwrite else finished_run(Path(recipe.output.dir), recipe)
    if replaced:
        raise RecipeError([replaced], a.recipe)
    from finetune.train.keepers.report import write_report
    from finetune.train.keepers.summary import summary
    from finetune.train.loop import train
    from finetune.train.parallel import leave_process_group
    from finetune.util.log import is_main

    result = train(recipe, Path(recipe.output.dir))
    leave_process_group()
    if is_main():  # the run dir's files are the main process's to read
        write_report(Path(recipe.output.dir))
        log.info("\n".join(summary(Path(recipe.output.dir), result, time.perf_counter() - t0)))
    return 0
