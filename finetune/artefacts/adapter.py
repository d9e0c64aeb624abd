"""The adapter's files in the form other clients read (adapter_config.json's base reference), and the quiet
peft wrap every adapter is made or loaded under.

The adapter's `base_model_name_or_path` is where a client finds the base: peft records the directory
transformers loaded, an absolute path on the training machine. `base_reference` says what we write instead.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

_HF_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{40})/?$")


def base_reference(recipe_name: str, loaded_from: str | None) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for adapter_config.json, portable across machines:
    - a hub id is written as is (the revision is the recipe's);
    - a directory inside the Hugging Face cache (`models--ORG--NAME/snapshots/REV`) is that hub id at REV;
    - `builtin:`/`synthetic:` names are written as the name: finetune rebuilds these bases anywhere
      (`finetune merge` resolves them); no hub holds them, so other clients take the base as an argument;
    - any other local directory: its path as the recipe wrote it when relative, else only its last
      component (an absolute path is meaningless on another machine; RUN_DIR/recipe.yaml keeps the path).
    """
    for candidate in (recipe_name, loaded_from or ""):
        m = _HF_CACHE_SNAPSHOT.search(candidate)
        if m:
            return f"{m['org']}/{m['name']}", m["rev"]
    if recipe_name.startswith(("builtin:", "synthetic:")):
        return recipe_name, None
    expanded = Path(recipe_name).expanduser()
    if expanded.is_dir():
        return (recipe_name, None) if not expanded.is_absolute() and not recipe_name.startswith("~") \
            else (expanded.resolve().name, None)
    return recipe_name, None  # a hub id


def portable_peft_config(peft_config, spec):
    """A copy of the live LoraConfig whose base reference travels (base_reference); `spec` is the
    recipe's model section. The live config is left alone: peft reads it while training."""
    import copy

    cfg = copy.copy(peft_config)
    name, revision = base_reference(spec.name, getattr(peft_config, "base_model_name_or_path", None))
    from finetune.util.redact import redact

    cfg.base_model_name_or_path = redact(name) if name else name
    rev = revision or getattr(spec, "revision", None)
    # A secret pasted where the revision goes (a token in model.revision) is never written: dropped, not
    # masked, since a masked revision would name no commit.
    cfg.revision = rev if rev is None or redact(rev) == rev else None
    return cfg


@contextlib.contextmanager
def quiet_peft_wrap():
    """Around every PeftModel construction (get_peft_model, PeftModel.from_pretrained): peft 0.21 reads
    transformers' deprecated `is_gradient_checkpointing` alias, and transformers 5 then prints a FutureWarning
    that no user can act on; the value read is the same."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
