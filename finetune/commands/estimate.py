"""`finetune estimate [RECIPE] [key=value ...]`: per-GPU memory and per-machine CPU RAM of a run, offline,
from the model's config.json or the built-in table. Never imports torch. `--update-headers DIR` rewrites
the plan block at the top of shipped recipes."""
from __future__ import annotations

import argparse

from finetune.commands.common import GPUS_MAX, SEQ_MAX, add_recipe_arguments, count


def register(sub) -> None:
    p = sub.add_parser("estimate", help="per-GPU VRAM and CPU RAM plan",
                       description="Plan per-GPU memory and CPU RAM of a run, offline, from the model's config.json "
                                   "or the built-in table.")
    add_recipe_arguments(p, optional=True)
    p.add_argument("--model", help="hub id, local directory or builtin:tiny-llama")
    p.add_argument("--gpus", type=count(1, GPUS_MAX), help="GPUs (processes) in total, over all machines")
    p.add_argument("--machines", type=count(1, GPUS_MAX))
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 24GiB; enables the fit check")
    p.add_argument("--seq-len", type=count(1, SEQ_MAX))
    p.add_argument("--micro-batch", type=count(1, SEQ_MAX))
    p.add_argument("--lora-r", type=count(1, 65536))
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], help="plan a GPU (default) or a CPU run")
    p.add_argument("--max-seq-len", action="store_true",
                   help="the longest data.max_seq_len that fits --gpu-memory at micro-batch 1, with and without "
                        "activation offloading and the tiled MLP, and what limits it")
    p.add_argument("--host-memory", help="CPU RAM of one machine, e.g. 128GiB; --max-seq-len checks it too")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--update-headers", metavar="DIR_OR_FILE", help="rewrite the plan headers of recipes")
    p.set_defaults(run=run)


def setup_from_args(a):
    from dataclasses import replace

    from finetune import recipe as rmod  # pydantic only; no torch
    from finetune.plan.estimate import from_recipe
    from finetune.util.units import parse_size

    if a.recipe:
        r = rmod.load(a.recipe, a.overrides, world=a.gpus)
    else:
        # The schema's defaults are the default QLoRA run: plan that for --model.
        data = rmod.apply_overrides({"model": {"name": a.model or "builtin:tiny-llama"}}, a.overrides)
        r = rmod.from_dict(data, "command line")
    s = from_recipe(r)
    if a.recipe and a.device is None:
        from finetune.plan.headers import planned_device

        s = replace(s, device=planned_device(a.recipe) or s.device)  # a CPU recipe is planned as one
    updates = {"model": a.model, "gpus": a.gpus, "machines": a.machines, "seq_len": a.seq_len,
               "micro_batch": a.micro_batch, "lora_r": a.lora_r, "offload": a.offload,
               "checkpointing": a.checkpointing, "device": a.device}
    s = replace(s, **{k: v for k, v in updates.items() if v is not None})
    if s.gpus > 1 and s.strategy == "single":
        s = replace(s, strategy="fsdp")  # more than one GPU without a strategy: plan the FSDP run
    if s.offload and s.strategy != "fsdp":
        s = replace(s, strategy="fsdp")
    if a.gpu_memory:
        s = replace(s, gpu_memory=parse_size(a.gpu_memory, "--gpu-memory"))
    return s, r.model.max_memory_gib


def run(a) -> int:
    import json

    from finetune.commands.common import at_least_one, split_overrides
    from finetune.plan.checkpointing import budget, fit
    from finetune.plan.rendering import render
    from finetune.util.errors import RecipeError

    if a.update_headers:
        from finetune.plan.headers import update_headers

        for line in update_headers(a.update_headers):
            print(line)
        return 0
    at_least_one(a, "gpus", "machines", "seq_len", "micro_batch", "lora_r")
    split_overrides(a, required=False)
    if a.max_seq_len:
        return _max_seq_len(a)
    try:
        s, cap = setup_from_args(a)
        p, choice = fit(s, budget_bytes=budget(s.gpu_memory, cap))
    except ValueError as e:  # unknown model: where it looked and what it knows
        raise RecipeError([str(e)]) from None
    print(render(p))
    print(choice.line())
    if a.json:
        ck = {"setting": choice.setting, "layers": choice.layers, "of": choice.total, "planned": choice.planned,
              "budget": choice.budget, "flops_saved": round(choice.flops_saved, 4)}
        print(json.dumps({**p.to_json(), "checkpointing": ck}, sort_keys=True))
    return 0


def _max_seq_len(a) -> int:
    import json

    from finetune.plan import longest
    from finetune.util.errors import RecipeError
    from finetune.util.units import parse_size

    if not a.gpu_memory or a.device == "cpu":
        raise RecipeError(["--max-seq-len: give the GPU's memory (--gpu-memory 80GiB): the longest length is "
                           "the one that fits it"])
    host = parse_size(a.host_memory, "--host-memory") if a.host_memory else None
    try:
        s, _ = setup_from_args(a)  # the longest length checkpoints every layer: `auto` is moot there
        rows = longest.table(s, host)
    except ValueError as e:
        raise RecipeError([str(e)]) from None
    print(longest.render(s, rows, host))
    if a.json:
        print(json.dumps({"max_seq_len": rows, "gpu_memory": s.gpu_memory, "host_memory": host}, sort_keys=True))
    return 0
