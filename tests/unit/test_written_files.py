"""Every file a verb writes goes through the no-follow temporary and the rename, and its names are the run dir's
written names; names that land in generated files are checked; the quantizer's binary and output are judged
by what they are. In-process and on tiny files: no model, no training."""
import json
import os

import pytest

from finetune import cli
from finetune.recipe.rundir import planted_links
from finetune.util.errors import RecipeError


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("another user's file\n")
    return victim


def test_report_html_is_never_written_through_a_link(tmp_path):
    from finetune.train.keepers.report import write_report

    run, victim = tmp_path / "run", _victim(tmp_path)
    run.mkdir()
    (run / "report.html").symlink_to(victim)  # at the final name: the rename replaces the link
    write_report(run)
    assert not (run / "report.html").is_symlink() and "finetune run" in (run / "report.html").read_text()
    (run / ".report.html.tmp").symlink_to(victim)  # at the temporary: refused by name, nothing written
    with pytest.raises(RecipeError, match=r"\.report\.html\.tmp is a symbolic link"):
        write_report(run)
    assert victim.read_text() == "another user's file\n"


@pytest.mark.parametrize("name", ["report.html", ".report.html.tmp", "trackers.json", "reference/logps.json",
                                  "predictions.jsonl", ".metrics.jsonl.tmp", "gguf"])
def test_the_preflight_names_a_link_at_every_written_name(tmp_path, name):
    run, victim = tmp_path / "run", _victim(tmp_path)
    (run / name).parent.mkdir(parents=True)
    (run / name).symlink_to(victim)
    assert [p for p in planted_links(run) if f"{run / name} is a symbolic link" in p]


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    return run


def _converter():
    from finetune.gguf import converter

    try:
        converter.require()
    except RecipeError as e:
        pytest.skip(str(e))


def test_export_refuses_a_link_at_its_report_before_converting(tmp_path, capsys):
    _converter()
    run, victim = _run_dir(tmp_path), _victim(tmp_path)
    (run / "gguf").mkdir()
    (run / "gguf" / "adapter-f16.gguf.json").symlink_to(victim)
    assert cli.main(["export", str(run), "--adapter-only", "--greedy-prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'gguf' / 'adapter-f16.gguf.json'} is a symbolic link" in err and "Traceback" not in err
    assert victim.read_text() == "another user's file\n" and sorted(os.listdir(run / "gguf")) == ["adapter-f16.gguf.json"]


def test_export_replaces_only_a_gguf_it_wrote_unless_forced(tmp_path, capsys):
    from finetune.gguf.write import refuse_foreign_output, write_report

    _converter()
    run = _run_dir(tmp_path)
    foreign = tmp_path / "base.gguf"
    foreign.write_bytes(b"GGUF" + b"\1" * 100)  # a GGUF from elsewhere (a downloaded base model)
    assert cli.main(["export", str(run), "--adapter-only", "--greedy-prompts", "0", "--output", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert f"--output: {foreign} is a GGUF file that export did not write" in err and "--force" in err
    assert foreign.read_bytes() == b"GGUF" + b"\1" * 100
    refuse_foreign_output(foreign, force=True)  # --force replaces it
    write_report(foreign, {"format": "gguf"})  # what export leaves beside a GGUF it wrote
    refuse_foreign_output(foreign)
    foreign.write_bytes(b"GGUF" + b"\2" * 100)  # the file changed since: no longer the one export wrote
    with pytest.raises(RecipeError, match="did not write"):
        refuse_foreign_output(foreign)


@pytest.mark.parametrize("outtype", ["f16", "q4_k_m"])
def test_a_line_break_in_the_output_name_is_refused_before_anything_is_written(tmp_path, capsys, outtype):
    run = _run_dir(tmp_path)
    out = tmp_path / "m.gguf\nFROM /etc/passwd\n#"
    assert cli.main(["export", str(run), "--outtype", outtype, "--greedy-prompts", "0", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "control character '\\n'" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_the_modelfile_text_refuses_a_name_that_would_add_directives(tmp_path):
    from pathlib import Path

    from finetune.gguf.modelfile import modelfile_text

    text = modelfile_text(Path("/x/model.gguf"), None, None, [])
    assert text.count("\nFROM ") == 1
    with pytest.raises(RecipeError, match="control character"):
        modelfile_text(Path("/x/m\nADAPTER /evil\n.gguf"), None, None, [])


def test_a_bad_quantizer_variable_is_named_and_its_output_judged(tmp_path, monkeypatch):
    from finetune.gguf import quantizer

    monkeypatch.setenv("FINETUNE_LLAMA_QUANTIZE", str(tmp_path / "nope"))
    assert quantizer.find() is None
    why = quantizer.missing_advice(tmp_path / "a.gguf", tmp_path / "b.gguf", "q4_k_m")
    assert f"FINETUNE_LLAMA_QUANTIZE='{tmp_path / 'nope'}' does not exist" in why and "not installed" not in why
    out = tmp_path / "q.gguf"
    assert "wrote no file" in quantizer.output_problem("llama-quantize", out)
    out.write_bytes(b"")
    assert "wrote an empty file" in quantizer.output_problem("llama-quantize", out)
    out.write_bytes(b"hello world")
    assert "11 bytes that are not a GGUF file" in quantizer.output_problem("llama-quantize", out)
    out.write_bytes(b"GGUF\3\0\0\0")
    assert quantizer.output_problem("llama-quantize", out) is None  # a GGUF's start: the read-back judges the rest


@pytest.mark.parametrize("writes", ["", "printf 'not a gguf' > \"$2\"", "printf 'GGUF\\003junk' > \"$2\""])
def test_a_quantizer_that_exits_0_without_a_gguf_is_a_run_error_naming_it(tmp_path, writes):
    # The binary really runs (a wrapper or another tool at FINETUNE_LLAMA_QUANTIZE); what it wrote is judged as
    # `finetune export --outtype q4_k_m` judges it after the checked f16 (a RunError: exit 3, no traceback).
    from finetune.gguf import quantizer
    from finetune.gguf.write import _quantized_tensors
    from finetune.util.builtin import builtin_dir
    from finetune.util.errors import RunError

    _converter()
    fake = tmp_path / "fake-quantize"
    fake.write_text(f"#!/bin/sh\n{writes}\nexit 0\n")
    fake.chmod(0o755)
    src, tmp, out = tmp_path / "model-f16.gguf", tmp_path / ".m.gguf.tmp-1", tmp_path / "m.gguf"
    tmp.write_bytes(b"")  # export's locked temporary exists before the binary runs
    assert quantizer.quantize(str(fake), src, tmp, "q4_k_m").returncode == 0
    f16 = {"source": str(builtin_dir("builtin:tiny-llama")), "tensors": {"tensors": 39}}
    with pytest.raises(RunError) as e:
        _quantized_tensors(str(fake), src, tmp, out, f16)
    said = str(e.value)
    assert f"{fake} exited 0 but wrote " in said and f"Nothing was written to {out}" in said
    assert ("an empty file" if not writes else "not a GGUF file" if "not a" in writes
            else "gguf-py cannot read as GGUF") in said


def test_accelerate_config_keeps_a_line_break_of_its_command_line_inside_the_header(tmp_path, capsys):
    import yaml

    out = tmp_path / "launch.yaml"
    assert cli.main(["accelerate-config", "recipes/tiny_cpu.yaml", f"output.dir={tmp_path}/x\ninjected_key: 7",
                     "-o", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())  # the line break used to end the comment and add the key
    assert "injected_key" not in cfg and "\\ninjected_key: 7" in out.read_text()  # escaped in the comment


def test_the_model_card_front_matter_holds_a_base_name_as_one_value():
    from types import SimpleNamespace

    import yaml

    from finetune.merge.card import _front_matter

    lines = _front_matter(SimpleNamespace(base_name="org/model\nlicense: mit"))
    meta = yaml.safe_load("\n".join(lines[1:lines.index("---", 1)]))
    assert meta["base_model"] == "org/model\nlicense: mit" and "license" not in meta
