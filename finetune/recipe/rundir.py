"""The run directory describes itself: the resolved recipe (with library versions) sits beside the results."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import yaml

from finetune.recipe import Recipe, load
from finetune.util import atomic
from finetune.util.redact import redact_obj

LIBRARIES = ("finetune", "torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "trl")


def versions() -> dict:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_recipe(run_dir: Path, recipe: Recipe):
    """RUN_DIR/recipe.yaml: every default filled in, so the run can be understood and repeated alone.
    Versions go in a comment header so the file still loads as a recipe."""
    run_dir.mkdir(parents=True, exist_ok=True)
    header = "# resolved recipe written by finetune\n" + "".join(f"# {k}=={v}\n" for k, v in versions().items())
    body = yaml.safe_dump(redact_obj(recipe.to_yaml_dict()), sort_keys=False)  # a pasted token stays out
    atomic.write_text(run_dir / "recipe.yaml", header + body)


def read_recipe(run_dir: Path) -> Recipe:
    return load(Path(run_dir) / "recipe.yaml")
