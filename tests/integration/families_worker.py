"""Worker for test_families.py: under `torchrun --nproc_per_node 2`, for every family in turn, train the
family's synthetic model 2 steps with FSDP2 (the real loop: streaming 4-bit loader, LoRA, FSDP prepare,
checkpoint at step 2), then run the recipe again to 3 steps, which resumes from that checkpoint. One
launch for all families keeps the CI cost to one interpreter start per rank.

    torchrun --nproc_per_node 2 families_worker.py OUT FAMILY [FAMILY ...]

Rank 0 writes OUT/FAMILY.json: the two runs' final steps, what the second run said it resumed from and
which steps it trained (its metrics lines), and whether the output head stayed the input embedding (tied
families) on the FSDP-wrapped model.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's finetune, not an installed one

from tests.integration.families import FAMILIES, ROOT, overrides  # noqa: E402


def tied_on_wrapped_model(model) -> bool:
    """The FSDP2-wrapped model's head weight is its embedding weight: one tensor (FSDP2 keeps the frozen tables
    whole on every rank, train.parallel.replicated_modules), filled once."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_output_embeddings().weight is base.get_input_embeddings().weight


class Said(logging.Handler):
    """What a run logs (every rank's records; rank 0 keeps the facts)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_family(family: str, out: Path) -> dict:
    from finetune.recipe import load
    from finetune.train.loop import train

    run_dir = out / family
    facts = {}
    for steps in (2, 3):
        recipe = load(ROOT / "recipes" / "tiny_cpu.yaml",
                      overrides(family, run_dir, steps) + ["distributed.strategy=fsdp", "fsdp.version=2"])
        said = Said()
        logging.getLogger("finetune").addHandler(said)
        try:
            result = train(recipe, run_dir, return_model=True)
        finally:
            logging.getLogger("finetune").removeHandler(said)
        facts[f"resumed_{steps}"] = [m for m in said.lines if m.startswith("resume: from")]
        facts[f"trained_{steps}"] = [int(n) for m in said.lines for n in re.findall(r"^step=(\d+) .*\bloss=", m)]
        facts[f"step_after_{steps}"] = result["step"]
        facts[f"loss_after_{steps}"] = result["loss"]
        if FAMILIES[family][3]:
            facts[f"tied_after_{steps}"] = tied_on_wrapped_model(result["model"])
        del result
    return facts


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    for family in sys.argv[2:]:
        facts = run_family(family, out)
        if torch.distributed.get_rank() == 0:
            (out / f"{family}.json").write_text(json.dumps(facts))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
