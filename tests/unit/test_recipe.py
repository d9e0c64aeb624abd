from pathlib import Path

import pytest

from finetune import recipe as R

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def problems(path, overrides=()):
    with pytest.raises(R.RecipeError) as e:
        R.load(path, list(overrides))
    return e.value.problems


def test_defaults_fill_every_section():
    r = R.from_dict({})
    assert r.quantization.mode == "nf4" and r.quantization.double_quant
    assert r.effective_quant_storage() == r.model.dtype == "float32"
    assert r.train.optimizer == "paged_adamw_8bit"


def test_every_error_at_once_with_paths_and_suggestions(tmp_path):
    p = write(tmp_path, "model:\n  nmae: x\n  dtype: float64\nlora:\n  r: 0\ntrian: {}\n")
    ps = problems(p)
    assert len(ps) == 4
    text = "\n".join(ps)
    assert "model.nmae: unknown key (did you mean 'name'?)" in text
    assert "trian: unknown section (did you mean 'train'?)" in text
    assert "model.dtype" in text and "float64" in text
    assert "lora.r" in text


@pytest.mark.parametrize("text,needle", [
    ("", "empty"),
    ("model: [unclosed\n", "invalid YAML"),
    ("- a\n- b\n", "mapping"),
    ("train:\n  micro_batch_size: many\n", "train.micro_batch_size"),
    ("lora:\n  target_modules: []\n", "lora.target_modules"),
])
def test_bad_files_name_the_problem(tmp_path, text, needle):
    assert needle in "\n".join(problems(write(tmp_path, text)))


def test_missing_file_is_named(tmp_path):
    ps = problems(tmp_path / "nope.yaml")
    assert "no such file" in ps[0] and "nope.yaml" in ps[0]


def test_overrides_go_through_validation(tmp_path):
    p = write(tmp_path, "train:\n  max_steps: 10\n")
    r = R.load(p, ["train.max_steps=5", "output.dir=/tmp/x", "lora.target_modules=[q_proj, v_proj]"])
    assert r.train.max_steps == 5 and r.output.dir == "/tmp/x" and r.lora.target_modules == ["q_proj", "v_proj"]
    ps = problems(p, ["train.max_stesp=5", "lora.r=-1"])
    assert any("did you mean 'max_steps'" in x for x in ps) and any("lora.r" in x for x in ps)
    assert "key=value" in problems(p, ["train.max_steps"])[0]


def test_fsdp_contract_is_checked():
    with pytest.raises(R.RecipeError) as e:
        R.from_dict({"distributed": {"strategy": "fsdp"}, "fsdp": {"version": 1},
                     "model": {"dtype": "bfloat16"}, "quantization": {"quant_storage": "uint8"}})
    text = "\n".join(e.value.problems)
    assert "quantization.quant_storage" in text and "lora.dtype" in text


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    R.load(path)


def test_field_docs_cover_every_field():
    rows = R.field_docs()
    keys = {k for k, _, _ in rows}
    assert {"model.name", "lora.r", "fsdp.version", "train.optimizer"} <= keys
    undocumented = [k for k, _, d in rows if not d and not k.startswith("train.adam_")]
    assert not undocumented, undocumented


def test_removed_settings_are_named_and_old_run_dirs_still_load(tmp_path):
    """Settings that did nothing were removed: a recipe that sets one is told which and why; a run dir's
    recipe.yaml written before (every default written out) still loads for merge, eval and generate."""
    import yaml

    from finetune.recipe import RecipeError, from_dict
    from finetune.recipe.rundir import read_recipe

    with pytest.raises(RecipeError) as e:
        from_dict({"fsdp": {"cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT"},
                   "model": {"low_cpu_mem_usage": True}})
    assert sorted(p.split(":")[0] for p in e.value.problems) == [
        "fsdp.cpu_ram_efficient_loading", "fsdp.state_dict_type", "model.low_cpu_mem_usage"]
    assert all("removed" in p and "Fix: delete it" in p for p in e.value.problems)
    old = {"model": {"name": "builtin:tiny-llama", "low_cpu_mem_usage": True},
           "fsdp": {"sync_module_states": None, "cpu_ram_efficient_loading": True, "state_dict_type": "FULL_STATE_DICT"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(old))
    assert read_recipe(tmp_path).model.name == "builtin:tiny-llama"
