"""`train.compile` in `validate`: what cannot compile is refused before anything loads, the field named."""
from finetune import cli


def test_validate_refuses_compile_with_dora_on_a_4bit_base_and_takes_plain_lora(capsys):
    code = cli.main(["validate", "recipes/tiny_cpu.yaml", "train.compile=true", "lora.use_dora=true"])
    err = capsys.readouterr().err
    assert code == 2 and "train.compile: peft's DoRA reads the 4-bit weight's quantization state" in err
    assert "Traceback" not in err
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", "train.compile=true"]) == 0
