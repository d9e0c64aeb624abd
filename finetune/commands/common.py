"""Argument helpers shared by the verbs: a recipe path and key=value overrides anywhere on the line."""
from __future__ import annotations

import argparse

from finetune.util.errors import RecipeError


def count(lo: int, hi: int):
    """An argparse type: a whole number in [lo, hi]. Out of range is argparse's own error (exit 2, the flag
    named), before anything loads: a count far past any real machine is a typo, not a plan to make."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo} to {hi:,}, got {n:,}")
        return n

    return parse


GPUS_MAX = 1_000_000  # more than any cluster built so far
SEQ_MAX = 10_000_000  # past every model's context


def add_recipe_arguments(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("recipe", nargs="?" if optional else None, help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides, anywhere on the line, e.g. train.max_steps=5")


def _is_override(word: str) -> bool:
    return "=" in word and not word.endswith((".yaml", ".yml"))


def split_overrides(args: argparse.Namespace, required: bool = True) -> None:
    """Sort the positionals into the recipe and its overrides, wherever each stands: argparse fills
    `recipe` with the first positional, which may be an override when the recipe is optional."""
    words = [w for w in [args.recipe, *args.overrides] if w is not None]
    args.overrides = [w for w in words if _is_override(w)]
    rest = [w for w in words if not _is_override(w)]
    if len(rest) > 1:
        raise RecipeError([f"unexpected argument '{rest[1]}': overrides are key=value, e.g. train.max_steps=5"])
    args.recipe = rest[0] if rest else None
    if required and args.recipe is None:
        raise RecipeError(["no recipe given: name a recipe YAML, e.g. recipes/tiny_cpu.yaml"])


def load_recipe(args: argparse.Namespace):
    """The recipe named on the command line, with its overrides, validated."""
    from finetune.recipe import load

    split_overrides(args)
    # --gpus is the process count `distributed.strategy: auto` is resolved for (else the launcher's).
    return load(args.recipe, args.overrides, world=getattr(args, "gpus", None))


def at_least_one(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise RecipeError([f"--{name.replace('_', '-')} must be at least 1, got {v}"])
