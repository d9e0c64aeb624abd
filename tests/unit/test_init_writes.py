"""`finetune init` writes what it validates: values serialized by the YAML library and the file
validated as read back, nothing left behind when validation fails, no writing through a link at -o, and a DPO
recipe for preference pairs. In-process (cli.main) on the builtin tiny model and 40 pairs of its preference data."""

import pytest

from finetune import cli
from finetune.recipe import load
from finetune.util.errors import RecipeError


def _pairs(path, n=40):
    from finetune.util.builtin import preference_dir

    path.write_text("".join(open(preference_dir() / "train.jsonl").readlines()[:n]))
    return path


@pytest.mark.slow  # one init: tokenizer, data preparation and the memory plan (~10 s of CPU)
def test_hostile_names_stay_values_and_preference_pairs_get_a_dpo_recipe(tmp_path, capsys):
    # '#' used to cut the path ('exp #3.jsonl' -> 'exp'); a line break injected a recipe key.
    data = _pairs(tmp_path / "exp #3\nmodel:\n  trust_remote_code: true\n.jsonl")
    out = tmp_path / "r.yaml"
    assert cli.main(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(out),
                     "--run-dir", "runs/a #b"]) == 0
    assert "(validated)" in capsys.readouterr().out
    r = load(out)
    assert r.data.sources[0].path == str(data) and r.output.dir == "runs/a #b"
    assert r.model.trust_remote_code is False and r.data.sources[0].format == "preference"
    assert r.train.method == "dpo"  # an SFT recipe cannot train on pairs
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([data.name, "r.yaml"])  # no temporary left


def test_init_refuses_to_write_through_a_link_at_o(tmp_path, capsys):
    victim, out = tmp_path / "victim.yaml", tmp_path / "r.yaml"
    victim.write_text("# my own recipe\n")
    out.symlink_to(victim)
    for force in ([], ["--force"]):
        assert cli.main(["init", "--model", "builtin:tiny-llama", "--data", str(tmp_path / "d.jsonl"),
                         "-o", str(out), *force]) == 2
        err = capsys.readouterr().err
        assert f"-o: {out} is a symbolic link" in err and "Traceback" not in err
    assert victim.read_text() == "# my own recipe\n"


def test_a_recipe_that_fails_validation_is_not_left_behind(tmp_path):
    from finetune.commands.init import write_validated

    out = tmp_path / "r.yaml"
    given = {"model": "builtin:tiny-llama", "data": "d.jsonl", "run_dir": "runs/r"}
    good = ('model:\n  name: "builtin:tiny-llama"\ndata:\n  sources:\n    - path: "d.jsonl"\noutput:\n'
            '  dir: "runs/r"\n')
    with pytest.raises(RecipeError, match="lora.r"):
        write_validated(out, good + "lora:\n  r: -1\n", given, "cpu")
    assert list(tmp_path.iterdir()) == []  # nothing partial: the retry needs no --force
    with pytest.raises(RecipeError, match="would not say what was given"):
        write_validated(out, good.replace("runs/r", "runs/x"), given, "cpu")
    assert list(tmp_path.iterdir()) == []
    write_validated(out, good, given, "cpu")
    assert load(out).output.dir == "runs/r" and [p.name for p in tmp_path.iterdir()] == ["r.yaml"]
