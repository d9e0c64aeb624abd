"""A finished run dir's files, checked before anything heavy loads: `eval`, `generate` and `chat` refuse a
missing, damaged or unsafe run dir with one line at once, not after seconds of importing torch. Torch-free
(tests/unit/test_architecture.py runs a refusal and looks at what was imported)."""
from __future__ import annotations

from pathlib import Path

from finetune.util.errors import RecipeError


def checked_run(run_dir: Path):
    """The recipe of a finished run dir whose adapter may be loaded: a RecipeError (exit 2) when the dir is not
    a finished run, its adapter is a pickle the recipe does not allow, empty or truncated, or its model needs
    remote code the recipe does not trust."""
    from finetune.recipe.rundir import read_recipe
    from finetune.train.preflight import refuse_remote_code
    from finetune.util.untrusted import adapter_problem

    adapter = run_dir / "adapter"
    if not (run_dir / "recipe.yaml").exists() or not (adapter / "adapter_config.json").exists():
        raise RecipeError([f"{run_dir}: not a finished run dir (needs recipe.yaml and adapter/)"])
    recipe = read_recipe(run_dir)
    if not (adapter / "adapter_model.safetensors").exists() and not recipe.model.allow_pickle:
        # PEFT would fall back to adapter_model.bin: a pickle, which can run code when loaded.
        raise RecipeError([f"{adapter}: no adapter_model.safetensors (pickle adapters are refused); convert it, "
                           "or set model.allow_pickle: true in its recipe.yaml"])
    refuse_remote_code(recipe)
    why = adapter_problem(adapter)  # empty or truncated: one line, not safetensors' header traceback
    if why:
        raise RecipeError([why])
    return recipe
