"""A new user's path with their own files: a 200-row chat JSONL with tool calls, a 200-row
alpaca JSON and a CSV, each through `init`, `data --show`, training, `eval` on the user's own held-out rows
(predictions written); then `generate`, `chat` through a terminal, `merge` and a GGUF export with its Ollama
Modelfile (where llama.cpp's converter is fetched). Every
command ends with exit 0 and no traceback; the tool-call rows the tiny model's template cannot render are
named with the reason, and skipped by the setting `init` names."""
import csv
import json
import os

import pytest

from finetune.gguf import converter

from ..conftest import run_cli
from .procs import pty_chat

pytestmark = pytest.mark.slow

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _files(tmp_path):
    triples = [WORDS[i % 8: i % 8 + 3] for i in range(200)]
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i, w in enumerate(triples):
            call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": w[0]})}}]}
            row = ({"tools": TOOLS, "messages": [{"role": "user", "content": f"weather in {w[0]}?"}, call,
                                                 {"role": "tool", "tool_call_id": "c", "content": "sunny"},
                                                 {"role": "assistant", "content": "Sunny."}]} if i % 4 == 0 else
                   {"messages": [{"role": "user", "content": "reverse: " + " ".join(w)},
                                 {"role": "assistant", "content": " ".join(w[::-1])}]})
            f.write(json.dumps(row) + "\n")
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Reverse the words.", "input": " ".join(w),
                                   "output": " ".join(w[::-1])} for w in triples]))
    table = tmp_path / "pairs.csv"
    with open(table, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["prompt", "completion"])
        out.writerows([[f"first: {' '.join(w)}\n", w[0]] for w in triples])
    return chat, alpaca, table


def _ok(args, timeout=600):
    res = run_cli(args, timeout=timeout)
    assert res.returncode == 0 and "Traceback" not in res.stderr, (args, res.stderr[-3000:])
    return res


def test_own_files_from_init_to_a_merged_model(tmp_path):
    for data in _files(tmp_path):
        recipe, run = tmp_path / f"{data.stem}.yaml", tmp_path / "runs" / data.stem
        made = _ok(["init", "--model", "builtin:tiny-llama", "--data", str(data), "-o", str(recipe),
                    "--run-dir", str(run)])
        extra = []
        if data.suffix == ".jsonl":  # the tool-call rows: named, with the setting that skips them
            assert "50 rows are bad" in made.stdout and "the chat template reads 'content'" in made.stdout
            extra = ["data.on_bad_row=skip"]
        shown = _ok(["data", str(recipe), "--show", "1", *extra])
        assert "held out for eval: data.eval_split 0.05 of the training rows" in shown.stdout
        trained = _ok([str(recipe), "train.max_steps=8", "train.warmup_steps=2", "output.progress_bar=false", *extra])
        assert "finished: 8 steps" in trained.stdout and f"adapter: {run / 'adapter'}" in trained.stdout
        scored = _ok(["eval", str(run), "--show", "1"])
        assert "--- prediction 1 of " in scored.stdout and (run / "predictions.jsonl").exists()
    _ok(["generate", str(tmp_path / "runs" / "alpaca"), "--instruction", "Reverse the words.", "--input",
         "alpha bravo charlie", "--max-new-tokens", "4"])
    _ok(["merge", str(tmp_path / "runs" / "pairs")])
    assert (tmp_path / "runs" / "pairs" / "merged" / "config.json").exists()
    answers, transcript, code = pty_chat([str(tmp_path / "runs" / "chat"), "--max-new-tokens", "6"],
                                         ["reverse: alpha bravo charlie", "and: delta echo"], dict(os.environ))
    assert code == 0 and len(answers) == 2 and "Traceback" not in transcript, transcript
    if (converter.converter_dir() / "convert_hf_to_gguf.py").is_file():
        _ok(["export", str(tmp_path / "runs" / "pairs"), "--outtype", "f32", "--greedy-prompts", "0"])
        modelfile = (tmp_path / "runs" / "pairs" / "gguf" / "model-f32.Modelfile").read_text()
        assert "FROM ./model-f32.gguf" in modelfile and 'TEMPLATE """' in modelfile
