"""`lora.init_adapter` checked from its files alone, before any weights load (the preflight calls it)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from finetune.util.errors import Problem

if TYPE_CHECKING:
    from finetune.recipe import Recipe


def init_adapter_problems(r: Recipe) -> list[Problem]:
    """lora.init_adapter, read before any weights load: the directory with a PEFT config and a sound safetensors
    file, of this section's rank and DoRA setting (every weight is loaded: another rank was a size-mismatch
    traceback after the model had loaded)."""
    import json

    from finetune.util.untrusted import adapter_problem

    start = r.lora.init_adapter
    if not start:
        return []
    cfg_path = Path(start) / "adapter_config.json"

    def bad(message: str, fix: str) -> list[Problem]:
        return [Problem(level="error", path="lora.init_adapter", message=message, fix=fix)]

    if not cfg_path.is_file():
        return bad(f"{start} is not an adapter directory (no {cfg_path.name})" if Path(start).exists()
                   else f"{start} does not exist", "name an earlier run's RUN_DIR/adapter, or null for fresh adapters")
    try:
        cfg = json.loads(cfg_path.read_bytes())
    except (OSError, ValueError) as e:
        return bad(f"{cfg_path} cannot be read as JSON ({type(e).__name__})", "restore it from the run it came from")
    if not isinstance(cfg, dict):
        return bad(f"{cfg_path} is not a PEFT adapter config", "restore it from the run it came from")
    why = adapter_problem(Path(start))
    if why:
        return bad(why, "name an adapter that is whole")
    out = []
    if cfg.get("r") != r.lora.r:
        out += bad(f"{start} has rank {cfg.get('r')!r}, lora.r is {r.lora.r}", f"set lora.r: {cfg.get('r')} (the "
                   "adapter's), or start from fresh adapters (lora.init_adapter: null)")
    if bool(cfg.get("use_dora")) != r.lora.use_dora:
        out += bad(f"{start} was {'' if cfg.get('use_dora') else 'not '}trained with DoRA, lora.use_dora is "
                   f"{str(r.lora.use_dora).lower()}", f"set lora.use_dora: {str(bool(cfg.get('use_dora'))).lower()}")
    return out
