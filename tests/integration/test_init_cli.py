"""`finetune init` on real files: from a model and a data file to a commented recipe that validates,
sized by the memory plan from the lengths the model's tokenizer measures, with a held-out share of the user's
own rows."""
import csv
import json

import pytest

from finetune.recipe import load

from ..conftest import run_cli

pytestmark = pytest.mark.slow

WORDS = "apple river stone cloud tiger lemon piano rocket garden silver".split()


def _alpaca(path, n=200):
    rows = [{"instruction": "Reverse the words.", "input": " ".join(WORDS[i % 7: i % 7 + 3]),
             "output": " ".join(WORDS[i % 7: i % 7 + 3][::-1])} for i in range(n)]
    path.write_text(json.dumps(rows))
    return path


def test_init_writes_a_recipe_that_validates_and_holds_out_the_users_rows(tmp_path):
    data, recipe = _alpaca(tmp_path / "alpaca.json"), tmp_path / "mine.yaml"
    res = run_cli(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(recipe),
                   "--run-dir", str(tmp_path / "run")])
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"data: {data}: 200 rows of instruction (input, instruction, output);" in res.stdout
    assert f"wrote {recipe} (validated)" in res.stdout and f"python -m finetune {recipe}" in res.stdout
    r = load(recipe)
    assert r.data.sources[0].path == str(data) and r.data.sources[0].format == "instruction"
    assert not r.data.eval_sources and r.data.eval_split == 0.05  # 10 of the user's own rows
    assert r.data.max_seq_len % 64 == 0 and r.train.micro_batch_size == 16
    assert r.data.prompt_template == "chat"  # the tiny model has a chat template: rows train as a chat
    text = recipe.read_text()
    assert "# memory:      " in text and f"# launch:      python -m finetune {recipe}" in text
    assert "  eval_split: 0.05   # 0.05 of your rows (10) are held out, never trained" in text
    shown = run_cli(["data", str(recipe), "--show", "1"])
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "held out for eval: data.eval_split 0.05 of the training rows (never trained), 10 examples" in shown.stdout
    again = run_cli(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(recipe)])
    assert again.returncode == 2 and "exists; choose another path or add --force" in again.stderr


def test_init_reads_a_csv_and_plans_fsdp_for_several_gpus(tmp_path):
    data, recipe = tmp_path / "pc.csv", tmp_path / "pc.yaml"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        w.writerows([[f"first word of: {' '.join(WORDS[i % 7:i % 7 + 3])}\n", WORDS[i % 7]] for i in range(200)])
    res = run_cli(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(recipe), "--gpus", "2",
                   "--gpu-memory", "16GiB"])
    assert res.returncode == 0, res.stderr[-2000:]
    r = load(recipe)
    assert r.data.sources[0].format == "prompt_completion"
    assert r.distributed.strategy == "fsdp" and r.distributed.num_processes == 2 and r.model.dtype == "bfloat16"
    assert "# planned for: 2 x 16GiB GPU" in recipe.read_text()
    assert f"accelerate launch --config_file configs/fsdp.yaml --num_processes 2 -m finetune {recipe}" in res.stdout


def test_init_says_why_rows_the_models_template_cannot_render_would_stop_the_run(tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}
    rows = [{"tools": tools, "messages": [{"role": "user", "content": "weather?"}, call,
                                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                                          {"role": "assistant", "content": "Sunny."}]} if i % 2 else
            {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(200)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(tmp_path / "c.yaml")])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "100 bad rows skipped" in res.stdout
    assert (f"note: 100 rows are bad and the recipe stops on them (data.on_bad_row: error); fix them, or set "
            f"data.on_bad_row: skip to train without them. The first: {data}:2: messages[1] (assistant, with "
            "tool_calls): the chat template reads 'content'") in res.stdout
