"""The run directory describes itself: the resolved recipe (with library versions) sits beside the results."""
from __future__ import annotations

import os
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


# What finetune writes in a run dir (and its temporaries): a symbolic link planted at one of these names would
# make the run write through it to a file outside the dir (in a shared output folder, another user's).
WRITTEN = (".lock", "recipe.yaml", ".recipe.yaml.tmp", "metrics.jsonl", "memory.json", ".memory.json.tmp", "adapter",
           ".tmp-adapter", ".del-adapter", "checkpoints", "reference", "merged",
           # every other file a verb writes there, and the no-follow temporary it is renamed from
           ".metrics.jsonl.tmp", "report.html", ".report.html.tmp", "trackers.json", ".trackers.json.tmp",
           "reference/logps.json", "reference/.logps.json.tmp", "predictions.jsonl", ".predictions.jsonl.tmp",
           "tensorboard", "wandb", "gguf")


def planted_links(run_dir: Path) -> list[str]:
    """Symbolic links where the run writes: RUN_DIR's own files and every entry of RUN_DIR/checkpoints."""
    run_dir = Path(run_dir)
    found = [run_dir / n for n in WRITTEN if (run_dir / n).is_symlink()]
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and not ckpts.is_symlink():
        found += [p for p in sorted(ckpts.iterdir()) if p.is_symlink()]
        found += [f for p in sorted(ckpts.iterdir()) if p.is_dir() and not p.is_symlink()
                  for f in sorted(p.rglob("*")) if f.is_symlink()]
    return [f"{p} is a symbolic link (to {os.readlink(p)}); finetune does not write through links in a run dir"
            for p in found]


def finished_run(run_dir: Path, recipe: Recipe) -> str | None:
    """Why re-running `recipe` into `run_dir` would replace a finished run's work silently: RUN_DIR holds an
    adapter and finetune's recipe.yaml with a different value of a key that defines the result, and no
    checkpoint to resume (the checkpoints' own fingerprint guards a run that has them; a finished run with
    pruned checkpoints would retrain from scratch and replace adapter, metrics and recipe)."""
    from finetune.recipe import fingerprint as fp

    run_dir = Path(run_dir)
    if not (run_dir / "adapter" / "adapter_model.safetensors").exists() or foreign_recipe(run_dir) \
            or not (run_dir / "recipe.yaml").is_file():
        return None
    if any((p / "trainer_state.json").exists() for p in (run_dir / "checkpoints").glob("step-*")):
        return None
    try:
        old = fp.fingerprint(read_recipe(run_dir), 1)
    except RecipeError:
        return (f"output.dir: {run_dir} holds a finished run whose recipe.yaml no longer loads; choose another "
                "output.dir, or pass --overwrite to replace that run")
    new = fp.fingerprint(recipe, 1)
    changed = [f"{k}: {old[k]} -> {new[k]}" for k in sorted(old.keys() & new.keys())
               if old[k] != new[k] and not fp.is_free(k)]
    if not changed:
        return None
    return (f"output.dir: {run_dir} holds a finished run (an adapter, no checkpoint to resume) trained with other "
            f"values ({'; '.join(changed[:5])}{'; ...' if len(changed) > 5 else ''}); re-running would replace it. "
            "Choose another output.dir, or pass --overwrite to replace that run")


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
