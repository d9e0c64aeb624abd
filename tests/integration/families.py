"""The model families test_families.py trains: a tiny synthetic copy of each (the real transformers class,
2 layers, hidden 64, seeded random weights, built on first use), its shipped recipe, and the recipe
overrides a few-step CPU run uses. Shared by the test and its FSDP worker."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = "?layers=2&hidden=64&intermediate=128&heads=4&kv_heads=2&head_dim=16&vocab=384"
MOE = "&experts=4&experts_per_tok=2"

# family: (base in the architecture table, extra synthetic options, shipped recipe, tied head, MoE)
FAMILIES = {
    "qwen3": ("Qwen/Qwen3-8B", "", "qwen3_8b_qlora.yaml", False, False),
    "llama3.2": ("meta-llama/Llama-3.2-3B", "", "llama3.2_3b_qlora.yaml", True, False),
    "gemma3": ("google/gemma-3-12b-pt", "", "gemma3_12b_qlora.yaml", True, False),
    "phi4": ("microsoft/phi-4", "", "phi4_qlora.yaml", False, False),
    "qwen3moe": ("Qwen/Qwen3-30B-A3B", MOE + "&moe_intermediate=32", "qwen3_30b_a3b_qlora.yaml", False, True),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", MOE, "mixtral_8x7b_qlora.yaml", False, True),
}


def model_name(family: str) -> str:
    base, extra = FAMILIES[family][:2]
    return f"synthetic:{base}{SMALL}{extra}"


def overrides(family: str, run_dir: Path, steps: int) -> list[str]:
    """tiny_cpu.yaml on the family's synthetic model: `steps` steps of 16 rows, a checkpoint at step 2."""
    return [f"model.name={model_name(family)}", f"train.max_steps={steps}", "train.warmup_steps=0",
            "train.log_every=1", "train.save_every=2", "data.max_samples=48", "data.max_seq_len=48",
            "output.progress_bar=false", "data.eval_sources=[]", "data.eval_split=0",
            f"output.dir={run_dir}"]  # no held-out set: CI time
