"""`finetune validate RECIPE`: schema, FSDP+QLoRA contract, launcher environment and memory fit, before
anything loads. Exit 2 when any error is found."""
from __future__ import annotations

from finetune.commands.common import add_recipe_arguments, load_recipe


def register(sub) -> None:
    p = sub.add_parser("validate", help="schema + FSDP/QLoRA contract + memory fit, no weights",
                       description="Check a recipe before anything loads: schema, FSDP+QLoRA contract, "
                                   "launcher environment, memory fit.")
    add_recipe_arguments(p)
    p.add_argument("--gpus", type=int, help="total GPUs to plan for (default: the recipe's)")
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 24GiB")
    p.add_argument("--cpu-memory", help="RAM of one machine, e.g. 128GiB")
    p.set_defaults(run=run)


def run(a) -> int:
    from finetune.commands.common import at_least_one
    from finetune.recipe.lora_methods import describe_method
    from finetune.train.preflight import here_problems, preflight, render, run_device
    from finetune.util.units import parse_size

    gpu_mem = parse_size(a.gpu_memory, "--gpu-memory") if a.gpu_memory else None
    cpu_mem = parse_size(a.cpu_memory, "--cpu-memory") if a.cpu_memory else None
    at_least_one(a, "gpus")
    r = load_recipe(a)  # schema and contract errors raise RecipeError (exit 2)
    device = run_device(r, a.recipe, gpu_mem)  # a CPU run's activations are checked against RAM
    problems = preflight(r, a.gpus, gpu_mem, cpu_memory=cpu_mem, device=device)
    errors = sum(p.level == "error" for p in problems)
    if problems:
        print(render(problems))
    print_adapted(r)
    print_checkpointing(r, a.gpus, gpu_mem, device, cpu_mem)
    print(describe_method(r))
    for p in here_problems(r):  # this machine, not the recipe: training refuses them, validate only tells
        print(f"before training here: {p.render()}")
    warnings = len(problems) - errors
    print(f"{a.recipe}: {'FAILED' if errors else 'ok'} ({errors} error(s), {warnings} warning(s))")
    return 2 if errors else 0


def print_adapted(r) -> None:
    """The share of the base's weights that carries an adapter (nothing when the shapes are unknown)."""
    from finetune.plan import estimate
    from finetune.plan.archs import resolve

    try:
        arch, _ = resolve(r.model.name)
    except (ValueError, OSError):
        return
    print(estimate.describe_adapted(arch, estimate.from_recipe(r)))


def print_checkpointing(r, gpus: int | None, gpu_memory: int | None, device: str = "cuda",
                        cpu_memory: int | None = None) -> None:
    """The gradient-checkpointing choice in the words training logs (nothing when the shapes are unknown)."""
    from finetune.plan.archs import resolve
    from finetune.train.preflight import checkpointing_plan

    try:
        arch, _ = resolve(r.model.name)
    except (ValueError, OSError):
        return
    if device == "cpu":  # the RAM is the device (as memory_problems plans it)
        from finetune.train.preflight import machine_ram

        gpu_memory, cpu_memory = None, cpu_memory or machine_ram()
    print(checkpointing_plan(r, arch, gpus, gpu_memory, device, cpu_memory)[1].line())
