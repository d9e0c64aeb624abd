"""Argument helpers shared by the verbs: a recipe path and key=value overrides anywhere on the line."""
from __future__ import annotations

import argparse

from finetune.util.errors import RecipeError


def add_recipe_arguments(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("recipe", nargs="?" if optional else None, help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides, anywhere on the line, e.g. train.max_steps=5")


def split_overrides(args: argparse.Namespace) -> None:
    """Check the overrides; with an optional recipe, a first argument that is an override is one."""
    if args.recipe and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.recipe)
        args.recipe = None
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise RecipeError([f"unexpected argument '{bad[0]}': overrides are key=value, e.g. train.max_steps=5"])


def load_recipe(args: argparse.Namespace):
    """The recipe named on the command line, with its overrides, validated."""
    from finetune.recipe import load

    split_overrides(args)
    return load(args.recipe, args.overrides)


def at_least_one(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise RecipeError([f"--{name.replace('_', '-')} must be at least 1, got {v}"])
