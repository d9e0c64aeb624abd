"""docs/walkthrough_70b.md's layout table says what `finetune estimate` plans today: each row's GPU and CPU
figures equal the planner's (to the 0.1 GiB the table prints). The table went stale twice when the planner
changed; this keeps it honest."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from finetune import cli

ROOT = Path(__file__).resolve().parents[2]
ROWS = {"2 x 24 GB, one machine, cpu offload (the recipe)": [],
        "4 x 24 GB, one machine, no offload": ["--gpus", "4", "--no-offload"],
        "16 x 24 GB, two machines of 8, no offload": ["--gpus", "16", "--machines", "2", "--no-offload"]}


@pytest.mark.parametrize("layout", list(ROWS))
def test_the_walkthrough_table_row_is_the_plan(layout, capsys):
    text = (ROOT / "docs" / "walkthrough_70b.md").read_text()
    row = re.search(rf"^\| {re.escape(layout)} \| ([\d.]+) GiB[^|]*\| ([\d.]+) GiB \|$", text, re.M)
    assert row, f"no table row for {layout!r}"
    assert cli.main(["estimate", str(ROOT / "recipes/llama3_70b_qlora.yaml"), *ROWS[layout], "--gpu-memory", "24GiB",
                     "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert float(row[1]) == round(plan["gpu_bytes_per_device"] / 2**30, 1)
    assert float(row[2]) == round(plan["cpu_bytes_peak"] / 2**30, 1)
