"""The run directory describes itself: the resolved recipe (with library versions) sits beside the results."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import yaml

from finetune.recipe import Recipe, load
from finetune.util import atomic
from finetune.util.errors import RecipeError
from finetune.util.redact import redact_obj

HEADER = "# resolved recipe written by finetune\n"

LIBRARIES = ("finetune", "torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "trl")


def versions() -> dict:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def foreign_recipe(run_dir: Path) -> str | None:
    """A problem when RUN_DIR/recipe.yaml exists but finetune did not write it (the user keeps their own
    recipe in the run dir): writing the resolved recipe would overwrite the user's file."""
    p = Path(run_dir) / "recipe.yaml"
    try:
        with open(p, "rb") as f:
            head = f.read(len(HEADER))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return f"cannot read {p}: {e.strerror}"
    if head == HEADER.encode():
        return None
    return (f"{p} was not written by finetune (your own recipe?); the run writes its resolved recipe there and "
            "would overwrite it")


def write_recipe(run_dir: Path, recipe: Recipe):
    """RUN_DIR/recipe.yaml: every default filled in, so the run can be understood and repeated alone.
    Versions go in a comment header so the file still loads as a recipe. Never replaces a recipe.yaml
    that finetune did not write."""
    why = foreign_recipe(run_dir)
    if why:
        raise RecipeError([f"output.dir: {why}; move that file or choose another output.dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    header = HEADER + "".join(f"# {k}=={v}\n" for k, v in versions().items())
    body = yaml.safe_dump(redact_obj(recipe.to_yaml_dict()), sort_keys=False)  # a pasted token stays out
    atomic.write_text(run_dir / "recipe.yaml", header + body)


def read_recipe(run_dir: Path) -> Recipe:
    return load(Path(run_dir) / "recipe.yaml", old_keys_ok=True)  # written with every default of its day
