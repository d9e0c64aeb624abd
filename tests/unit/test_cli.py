"""The command line: verbs from commands/, did-you-mean, and key=value overrides anywhere on the line."""
import json
from pathlib import Path

import pytest

from finetune import cli

ROOT = Path(__file__).resolve().parents[2]
R8 = str(ROOT / "recipes" / "llama3_8b_qlora.yaml")
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def test_help_lists_every_verb(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in ("train", "validate", "estimate", "accelerate-config", "data", "merge", "generate", "chat", "eval",
                 "slurm"):
        assert verb in out
    assert cli.main([]) == 2  # no arguments: the help, as an error


def test_verb_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", "--help"])
    assert e.value.code == 0 and "--gpu-memory" in capsys.readouterr().out


def test_unknown_verb_suggests_the_closest(capsys):
    assert cli.main(["estimat", "x"]) == 2
    assert "did you mean 'estimate'?" in capsys.readouterr().err


def test_bad_option_is_exit_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", R8, "--no-such-flag"])
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["estimate", R8, "train.micro_batch_size=1", "--gpus", "2", "--json"],
    ["estimate", "--gpus", "2", R8, "--json", "train.micro_batch_size=1"],
    ["estimate", "--json", "train.micro_batch_size=1", "--gpus", "2", R8],
])
def test_estimate_takes_overrides_anywhere(argv, capsys):
    assert cli.main(argv) == 0
    setup = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["setup"]
    assert (setup["micro_batch"], setup["gpus"]) == (1, 2)


def test_estimate_overrides_without_a_recipe(capsys):
    assert cli.main(["estimate", "--model", "meta-llama/Llama-3.1-8B", "lora.r=64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["setup"]["lora_r"] == 64


def test_override_without_equals_is_named(capsys):
    assert cli.main(["validate", TINY, "max_steps"]) == 2
    assert "unexpected argument 'max_steps'" in capsys.readouterr().err


def test_validate_and_accelerate_config_take_overrides_between_options(capsys, tmp_path):
    assert cli.main(["validate", "--gpus", "1", TINY, "train.max_steps=30", "--gpu-memory", "24GiB"]) == 0
    out = tmp_path / "acc.yaml"
    assert cli.main(["accelerate-config", R8, "--gpus", "2", "distributed.strategy=fsdp", "--output", str(out)]) == 0
    assert "distributed_type: FSDP" in out.read_text()


def test_data_takes_overrides_after_dataset(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {w}\n", "completion": w}) + "\n"
                            for w in ("red", "blue", "green", "gold")))
    assert cli.main(["data", TINY, "--dataset", str(rows), "data.eval_split=0", "--show", "1", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (stats["rows"], stats["eval_rows"]) == (4, 0)


def test_recipe_may_follow_its_overrides_but_must_be_given(capsys):
    assert cli.main(["validate", "train.max_steps=30", TINY]) == 0
    capsys.readouterr()
    assert cli.main(["validate", "train.max_steps=30"]) == 2
    assert "no recipe given" in capsys.readouterr().err


def test_validate_refuses_activation_offloading_without_a_gpu(capsys):
    # This machine has no CUDA device: offloading would have nothing to move, so validate says so (exit 2).
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["validate", TINY, "model.activation_offloading=true", "model.gradient_checkpointing=true"]) == 2
    out = capsys.readouterr().out
    assert "model.activation_offloading" in out and "no CUDA GPU" in out
    assert cli.main(["validate", TINY, "model.activation_offloading=true", "model.gradient_checkpointing=false"]) == 2
    assert "gradient_checkpointing" in capsys.readouterr().err


def test_estimate_plans_activation_offloading_and_states_allocated_memory(capsys):
    assert cli.main(["estimate", R8, "--json"]) == 0
    on = cli.main(["estimate", R8, "model.activation_offloading=true", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    plain, offloaded = (json.loads(line) for line in out if line.startswith("{"))
    assert on == 0
    assert "peak allocated" in "\n".join(out)
    # the checkpointed layer inputs (32 x 2 x 2048 x 4096 bf16 = 1 GiB) and the embedding table leave the GPU...
    assert plain["gpu_bytes_allocated"] - offloaded["gpu_bytes_allocated"] > 1.9 * 2**30
    # ...and land in pinned CPU memory
    assert offloaded["cpu_bytes"]["training"] - plain["cpu_bytes"]["training"] > 1.9 * 2**30
    assert offloaded["gpu_bytes_allocated"] <= 6.0 * 2**30


def _finished_run_files(run: Path) -> Path:
    """The files of a finished run dir that generate checks before loading (train/runcheck.py): a resolved
    recipe and a well-formed (here one-tensor) adapter."""
    import torch
    import yaml
    from safetensors.torch import save_file

    from finetune import recipe

    (run / "adapter").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe.from_dict({}).model_dump(mode="json")))
    (run / "adapter" / "adapter_config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(run / "adapter" / "adapter_model.safetensors"))
    return run


def test_generate_prints_non_ascii_prompts_as_typed(capsys, monkeypatch, tmp_path):
    """`generate --prompt "café"` once printed "cafÃ©" (and prompted the model with it): the escapes a shell
    cannot type are decoded, nothing else."""
    from finetune.train import inference

    run = _finished_run_files(tmp_path / "run")
    seen = []

    class Model:
        def disable_adapter(self):  # pragma: no cover - not used without --no-adapter
            raise AssertionError

    monkeypatch.setattr(inference, "load_run", lambda run_dir, merged=False: (None, object(), Model()))
    monkeypatch.setattr(inference, "generate", lambda model, tok, prompts, *a: seen.extend(prompts) or ["ok"] * len(prompts))
    assert cli.main(["generate", str(run), "--prompt", "café ☕", "--prompt", r"a\nb \\n"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert seen == ["café ☕", "a\nb \\n"]
    assert [line["prompt"] for line in lines] == seen


def test_chat_checks_its_arguments_before_loading(capsys, tmp_path):
    """`chat` shares generate's checks: a bad number is exit 2 with the flag named, before any model loads (the
    run dir here does not even exist)."""
    for flag, value in (("--temperature", "-1"), ("--top-p", "2"), ("--max-new-tokens", "0"), ("--seed", "-3")):
        assert cli.main(["chat", str(tmp_path / "no-run"), flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
