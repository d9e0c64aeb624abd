"""Every shipped recipe is runnable documentation: its header holds the launch command and the planned
memory, and this test regenerates them so a header cannot drift from the planner or the recipe."""
import shutil
from pathlib import Path

import pytest

from finetune import cli
from finetune.plan import headers
from finetune.train import preflight as validate
from finetune.util.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
MINE = ["llama3_8b_qlora.yaml", "llama3_70b_qlora.yaml", "mistral_7b_qlora.yaml", "qwen2.5_7b_qlora.yaml",
        "tiny_cpu_fsdp.yaml"]
WITH_BLOCK = sorted({p.name for p in (ROOT / "recipes").glob("*.yaml") if headers.split_header(p.read_text())[1]}
                    | set(MINE))


@pytest.mark.parametrize("name", WITH_BLOCK)
def test_header_matches_a_fresh_plan(name):
    path = ROOT / "recipes" / name
    _, block, _ = headers.split_header(path.read_text())
    assert block, f"{name} has no plan header; add one with `python -m finetune estimate --update-headers {path}`"
    assert block == headers.plan_block(path), f"{name}: header drifted; run python -m finetune estimate " \
                                              "--update-headers recipes/"


@pytest.mark.parametrize("name", MINE)
def test_shipped_recipe_validates_and_fits_its_gpus(name, capsys, monkeypatch):
    for k in validate.LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    path = ROOT / "recipes" / name
    text = path.read_text()
    assert "planned for:" in text and "# launch:" in text
    size = headers.PLANNED_FOR.search(text).group(2)
    args = [] if size == "cpu" else ["--gpu-memory", size]
    assert cli.main(["validate", str(path)] + args) == 0, capsys.readouterr().out
    if size != "cpu":
        assert "fits with" in text


def test_update_headers_repairs_a_drifted_header(tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "recipes").mkdir()
    good = (ROOT / "recipes" / "llama3_8b_qlora.yaml").read_text()
    drifted = good.replace("micro_batch_size: 2", "micro_batch_size: 3")
    target = tmp_path / "recipes" / "llama3_8b_qlora.yaml"
    target.write_text(drifted)
    old_block = headers.split_header(drifted)[1]
    assert headers.plan_block(target) != old_block  # the old numbers no longer describe the recipe
    assert headers.update_headers(tmp_path / "recipes") == [f"{target}: updated"]
    new_text = target.read_text()
    assert headers.split_header(new_text)[1] == headers.plan_block(target)
    assert new_text.replace("\n".join(headers.split_header(new_text)[1]), "") == \
        drifted.replace("\n".join(old_block), "")  # only the block changed
    assert headers.update_headers(target) == [f"{target}: up to date"]


def test_planned_for_line_sets_the_gpu_size():
    assert parse_size(headers.PLANNED_FOR.search("# planned for: 2 x 24GiB GPU").group(2)) == 24 * 2**30
