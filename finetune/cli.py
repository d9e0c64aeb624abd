"""Command line: `finetune RECIPE [key=value ...]` trains; the other verbs plan, check, merge and evaluate.

Dispatch only. Each verb lives in `finetune/commands/<verb>.py`, which registers its own subparser; its
arguments are parsed intermixed, so key=value overrides may stand anywhere on the line. Exit codes: 0 ok,
2 bad input (message, no traceback), 3 a valid run that cannot go on (diverged, output dir in use, GPU
unusable), 1 anything else (finetune.util.errors).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from finetune.commands import (accelerate_config, chat, data, estimate, evaluate, export, generate, init, merge,
                               quantize, slurm, train, validate)
from finetune.util import redact
from finetune.util.errors import RecipeError, exit_code

COMMANDS = (train, init, validate, estimate, accelerate_config, data, merge, export, generate, chat, evaluate, slurm,
            quantize)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    root = argparse.ArgumentParser(
        prog="finetune", description="QLoRA fine-tuning from one YAML recipe. `finetune RECIPE [key=value ...]` "
        "trains (also: accelerate launch -m finetune RECIPE).",
        epilog="`finetune VERB --help` shows a verb's options. Exit codes: 0 ok, 2 bad input, 3 the run cannot go "
               "on (diverged, output dir in use, GPU unusable), 1 anything else.")
    sub = root.add_subparsers(dest="verb", metavar="VERB")
    for command in COMMANDS:
        command.register(sub)
    return root, sub.choices


def _is_recipe(word: str) -> bool:
    """`finetune RECIPE ...` means `finetune train RECIPE ...`: a path with an extension, or one that exists."""
    return bool(os.path.splitext(word)[1]) or os.path.exists(word)


def dispatch(argv: list[str]) -> int:
    root, verbs = build_parser()
    if not argv or argv[0] in ("-h", "--help", "help"):
        root.print_help()
        return 0 if argv else 2
    verb = argv[0]
    if verb not in verbs:
        if verb.startswith("-"):
            raise RecipeError([f"unknown option {verb}"])
        if not _is_recipe(verb):
            close = difflib.get_close_matches(verb, list(verbs), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise RecipeError([f"unknown command or recipe '{verb}'{hint}"])
        verb, argv = "train", ["train", *argv]
    args = verbs[verb].parse_intermixed_args(argv[1:])
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    redact.install()  # secrets (HF_TOKEN, *_KEY, ...) never reach the logs, whatever prints them
    return exit_code(dispatch, list(sys.argv[1:] if argv is None else argv))
