"""`finetune accelerate-config RECIPE [--gpus N] [--machines M]`: the Accelerate launcher YAML that matches
a recipe, so the recipe and the launcher never drift."""
from __future__ import annotations

from finetune.commands.common import GPUS_MAX, add_recipe_arguments, count


def register(sub) -> None:
    p = sub.add_parser("accelerate-config", help="the launcher YAML for this recipe",
                       description="Write the Accelerate launcher YAML that matches a recipe.")
    add_recipe_arguments(p)
    p.add_argument("--gpus", type=count(1, GPUS_MAX), help="total processes (default: distributed.num_processes)")
    p.add_argument("--machines", type=count(1, GPUS_MAX), help="machines (default: distributed.num_machines)")
    p.add_argument("--cpu", action="store_true", help="for a machine without GPUs (use_cpu: true)")
    p.add_argument("--output", "-o", help="write here instead of stdout")
    p.set_defaults(run=run)


def run(a) -> int:
    from pathlib import Path

    from finetune.commands.common import at_least_one, load_recipe
    from finetune.plan.launcher import HEADER, accelerate_config, render_config
    from finetune.util import atomic
    from finetune.util.errors import RecipeError
    from finetune.util.redact import redact

    at_least_one(a, "gpus", "machines")
    r = load_recipe(a)
    from finetune.plan.starter import comment

    # escaped: a line break in a path or an override would otherwise end the header comment and add config keys
    shown = comment(" ".join([a.recipe] + a.overrides))
    # The command line is copied into the file's header: a secret pasted into an override stays out of it.
    text = redact(render_config(r, accelerate_config(r, a.gpus, a.machines, cpu=a.cpu), shown))
    if a.output:
        out = Path(a.output)
        if out.is_dir() or out.is_symlink() or (out.exists() and not out.read_bytes().startswith(HEADER.encode())):
            raise RecipeError([f"--output: {out} exists and is not a launcher config that accelerate-config wrote "
                               "(the recipe itself?); name another file"])
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out, text)
        print(f"wrote {a.output}")
    else:
        print(text, end="")
    return 0
