"""Command line: `finetune RECIPE [key=value ...]` trains; other verbs plan, check, merge and evaluate.

Heavy libraries are imported lazily inside each verb, so `--help` and bad input answer at once.
Exit codes: 0 ok, 2 bad input (message, no traceback), 1 anything else.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from . import redact
from .diskcheck import OutputWriteError
from .recipe import RecipeError

USAGE = """usage: finetune RECIPE [key=value ...]          train (also: accelerate launch -m finetune RECIPE)
       finetune validate RECIPE                   schema + FSDP/QLoRA contract + memory fit, no weights
       finetune estimate [RECIPE] [--gpus N] ...  per-GPU VRAM and CPU RAM plan
       finetune accelerate-config RECIPE --gpus N the launcher YAML for this recipe
       finetune data RECIPE [--show N]            look at what trains
       finetune merge RUN_DIR [--output DIR]      fold the adapter into the base (streaming)
       finetune generate RUN_DIR --prompt TEXT    sample from the trained adapter
       finetune eval RUN_DIR [--json]             held-out loss and exact match"""

# verb -> (module, function); modules are imported only when their verb runs.
VERBS = {
    "validate": ("finetune.validate", "main"),
    "estimate": ("finetune.estimate", "main"),
    "accelerate-config": ("finetune.launcher", "main"),
    "data": ("finetune.datacli", "main"),
    "merge": ("finetune.merge", "main"),
    "generate": ("finetune.evaluate", "main_generate"),
    "eval": ("finetune.evaluate", "main_eval"),
}


def train_main(argv: list[str]) -> int:
    from . import recipe as recipe_mod

    path, overrides = argv[0], argv[1:]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise RecipeError([f"unexpected argument '{bad[0]}': overrides are key=value, e.g. train.max_steps=5"])
    recipe = recipe_mod.load(path, overrides)
    try:
        validate = importlib.import_module("finetune.validate")
    except ModuleNotFoundError:
        validate = None
    if validate is not None and hasattr(validate, "preflight"):
        # Every check that needs no weights runs before any process loads them.
        problems = validate.preflight(recipe)
        for p in problems:
            if p.level == "warning":
                print(f"warning: {p.render()}", file=sys.stderr)
        errors = [p.render() for p in problems if p.level == "error"]
        if errors:
            raise RecipeError(errors, path)
    from .train import train

    result = train(recipe, Path(recipe.output.dir))
    from .distributed import print0

    print0(f"done: {result}; run dir {recipe.output.dir}")
    return 0


def run_module(main_fn) -> int:
    """`python -m finetune.X` entry for verb modules: same exit codes and error rendering as `finetune X`."""
    try:
        return int(main_fn(sys.argv[1:]) or 0)
    except RecipeError as e:
        print(e.render(), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    redact.install()  # secrets (HF_TOKEN, *_KEY, ...) never reach the logs, whatever prints them
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    verb = argv[0]
    try:
        if verb in VERBS:
            module, fn = VERBS[verb]
            return int(getattr(importlib.import_module(module), fn)(argv[1:]) or 0)
        if verb.startswith("-"):
            raise RecipeError([f"unknown option {verb}"])
        if not os.path.splitext(verb)[1] and not os.path.exists(verb):
            import difflib

            close = difflib.get_close_matches(verb, list(VERBS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise RecipeError([f"unknown command or recipe '{verb}'{hint}"])
        return train_main(argv)
    except RecipeError as e:
        print(e.render(), file=sys.stderr)
        return 2
    except OutputWriteError as e:  # disk full or unwritable mid-run: the message says what was kept
        print(f"error: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
