"""Values and recipe input that used to pass validation or crash: each is exit 2 naming the field or file."""
import os
from pathlib import Path

import pytest
import yaml

from finetune import cli
from finetune import recipe as R
from finetune.recipe.rundir import write_recipe
from finetune.util.errors import RecipeError

from ..conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


@pytest.mark.parametrize("override, field", [
    ("train.learning_rate=.inf", "train.learning_rate"), ("lora.alpha=1e999", "lora.alpha"),
    ("train.epochs=.inf", "train.epochs"), ("train.epochs=.nan", "train.epochs"),
    ("distributed.timeout_minutes=.inf", "distributed.timeout_minutes"),
    ("distributed.timeout_minutes=1e300", "distributed.timeout_minutes"),
    ("train.seed=99999999999999999999999", "train.seed"), ("data.shuffle_seed=-1", "data.shuffle_seed"),
])
def test_infinite_and_out_of_range_values_are_refused(override, field, capsys, tmp_path):
    code = cli.main(["validate", TINY, override, f"output.dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and field in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "huge"])
def test_recipe_path_must_be_a_small_regular_file(kind, tmp_path, capsys):
    if kind == "dev_zero":
        path = "/dev/zero"
    elif kind == "fifo":
        path = str(tmp_path / "pipe.yaml")
        os.mkfifo(path)  # opening it would block forever: it must be refused before it is opened
    else:
        path = str(tmp_path / "huge.yaml")
        Path(path).write_text("model: {}\n" + "#" * (2 << 20))
    assert cli.main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert path in err and ("not a regular file" in err or "larger than 1 MiB" in err)


def test_a_section_mapping_override_merges_into_the_section():
    """`train={max_steps: 50}` changes max_steps and keeps every other key the recipe set in train."""
    r = R.load(TINY, ["train={max_steps: 50}"])
    assert r.train.max_steps == 50 and r.train.micro_batch_size == 16 and r.train.learning_rate == 2e-3
    assert R.load(TINY, ["train.max_steps=50"]) == r


def test_users_recipe_in_the_output_dir_is_never_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    mine = run / "recipe.yaml"
    text = "# my notes\n" + Path(TINY).read_text().replace("runs/tiny_cpu", str(run))
    mine.write_text(text)
    assert cli.main(["train", str(mine), "train.max_steps=30"]) == 2
    err = capsys.readouterr().err
    assert "output.dir" in err and "not written by finetune" in err
    assert mine.read_text() == text and sorted(p.name for p in run.iterdir()) == ["recipe.yaml"]
    # The file finetune writes itself may be replaced (re-running a run dir's own recipe resumes it).
    other = tmp_path / "other"
    write_recipe(other, R.load(TINY))
    write_recipe(other, R.load(TINY, ["train.max_steps=30"]))
    assert yaml.safe_load((other / "recipe.yaml").read_text())["train"]["max_steps"] == 30
    (other / "recipe.yaml").write_text(text)
    with pytest.raises(RecipeError, match="not written by finetune"):
        write_recipe(other, R.load(TINY))


@pytest.mark.parametrize("name", ["./models/llama-3", "/nonexistent/model", "FILE"])
def test_path_like_model_name_is_named_not_read_as_config(name, capsys, tmp_path):
    if name == "FILE":  # an existing file (transformers would parse it as a config.json)
        name = str(tmp_path / "config.json")
        Path(name).write_text("{}")
    assert cli.main(["validate", TINY, f"model.name={name}", f"output.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().out
    assert f"model.name: {name}" in err and "Traceback" not in err


def test_uncached_hub_model_without_network_is_one_error(tmp_path):
    """A model that is neither local nor cached stops the run before anything loads: exit 2, one message
    naming model.name and the download command, no traceback."""
    out = run_cli([TINY, "model.name=nobody/not-cached-model", f"output.dir={tmp_path}/run"],
                  env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr
    assert "model.name: the weights of nobody/not-cached-model are not in the local Hugging Face cache" in out.stderr
    assert "hf download nobody/not-cached-model" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_override_keeps_its_line_breaks():
    """YAML folds a plain scalar's newline into a space; a multi-line override value is kept as typed."""
    from finetune.recipe.read import parse_override

    assert parse_override("data.chat_template={{ a }}\n{{ b }}")[1] == "{{ a }}\n{{ b }}"
    assert parse_override("output.dir=runs/a\nb")[1] == "runs/a\nb"
    assert parse_override("train.max_steps=5")[1] == 5 and parse_override("x=[1,\n 2]")[1] == [1, 2]
