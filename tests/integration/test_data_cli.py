"""`python -m finetune data`: examples with trained tokens marked, stats as a last JSON line, and bad
rows as exit 2 naming file and line (no traceback) or, with skip, counted and reported."""
import json
import re

import pytest

from tests.conftest import run_cli

GOOD = [{"prompt": f"reverse: red cat {i}\n", "completion": "cat red"} for i in range(20)]


@pytest.fixture
def setup(tmp_path):
    data = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in GOOD]
    lines.insert(6, '{"prompt": "broken", "completion": ')  # line 7
    data.write_text("\n".join(lines) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  sources:\n    - path: {data}\n  eval_split: 0\n  max_seq_len: 64\n"
                      "train:\n  micro_batch_size: 4\n")
    return recipe, data, {"FINETUNE_CACHE": str(tmp_path / "cache")}


def test_broken_line_exits_2_naming_file_and_line(setup):
    recipe, data, env = setup
    r = run_cli(["data", str(recipe)], env=env)
    assert r.returncode == 2, r.stderr
    assert f"{data}:7: invalid JSON" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_skip_continues_and_reports_the_bad_row(setup):
    recipe, data, env = setup
    r = run_cli(["data", str(recipe), "data.on_bad_row=skip", "--show", "2", "--json", "--color", "never"], env=env)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["rows"] == 20 and stats["rows_skipped"] == 1
    assert stats["bad_rows"] == [f"{data}:7: invalid JSON: Expecting value (column 36)"]
    for key in ("tokens", "trained_tokens", "packing_efficiency"):
        assert key in stats
    assert "bad rows skipped: 1" in r.stdout and f"{data}:7" in r.stdout
    assert r.stdout.count("--- example") == 2
    # the default layout (auto) on a model with a chat template: the prompt as the user turn, ⟦trained⟧
    shown = r"<\|user\|>\nreverse: red cat \d+\n\n<\|assistant\|>\n\u27e6cat red<\|end\|>\n\u27e7"
    assert re.search(shown, r.stdout), r.stdout
    assert "rows train as a user and an assistant turn of the chat template (data.prompt_template: auto" in r.stdout


def test_dataset_flag_replaces_the_sources_and_detects_the_format(setup, tmp_path):
    recipe, _, env = setup
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"conversations": [{"from": "human", "value": "first: red cat"},
                                                   {"from": "gpt", "value": "red"}]}) + "\n")
    r = run_cli(["data", str(recipe), "--dataset", str(chat), "--show", "1", "--json", "--color", "never"], env=env)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["sources"][0]["format"] == "sharegpt" and stats["rows"] == 1
    assert "<|user|>\nfirst: red cat\n<|assistant|>\n\u27e6red<|end|>\n\u27e7" in r.stdout
