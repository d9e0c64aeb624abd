"""docs/recipe_reference.md is generated from the schema and must not drift from it."""
from __future__ import annotations

from pathlib import Path

from finetune.recipe import field_docs
from finetune.recipe import reference as docs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "recipe_reference.md"


def test_committed_reference_matches_the_schema():
    assert PAGE.read_text(encoding="utf-8") == docs.render(), \
        "docs/recipe_reference.md is stale: run `python -m finetune.recipe.reference` and commit the result"


def test_check_mode_detects_drift(tmp_path):
    stale = tmp_path / "ref.md"
    assert docs.main(["--output", str(stale)]) == 0
    assert docs.main(["--check", "--output", str(stale)]) == 0
    stale.write_text(stale.read_text().replace("LoRA rank.", "LoRA rank (old text)."))
    assert docs.main(["--check", "--output", str(stale)]) == 1


def test_every_field_is_documented_with_its_default():
    page = docs.render()
    for key, _default, doc in field_docs():
        assert doc, f"{key} has no docstring in finetune/recipe/schema.py"
        assert f"| `{key}` |" in page
    assert "| `lora.r` | int (>= 1, <= 4096) | `16` |" in page
    assert "| `model.revision` | str / null | `null` |" in page
    assert "| `data.sources[].path` | str | `(required)` |" in page


def test_gpu_paths_rows_name_existing_tests():
    """docs/gpu_paths.md: every row names the CPU test that executes it, and that test exists."""
    import re

    table = (ROOT / "docs" / "gpu_paths.md").read_text(encoding="utf-8").split("\n## Running the GPU proof")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Where")]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cells[4])
        assert named, f"no CPU test named in: {row}"
        for path, name in named:
            source = (ROOT / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} (docs/gpu_paths.md) does not exist"
        assert cells[5], f"no GPU check named in: {row}"
