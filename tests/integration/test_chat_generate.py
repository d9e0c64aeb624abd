"""`generate` and `eval` on a run trained on chat rows: prompts are the tokens training rendered, exact match
is scored on the last assistant turn. One tiny run (builtin model, a chat jsonl made from builtin rows)."""
import json

import pytest

from finetune import cli
from finetune import recipe as R
from finetune.data import encode
from finetune.train.loop import train
from finetune.util import builtin

pytestmark = pytest.mark.slow


def _chats(rows):
    return [{"messages": [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": r["prompt"].strip()},
                          {"role": "assistant", "content": r["completion"]}]} for r in rows]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    rows = builtin.make_rows(72, seed=7)
    for name, part in (("train.jsonl", rows[:64]), ("eval.jsonl", rows[64:])):
        (root / name).write_text("".join(json.dumps(c) + "\n" for c in _chats(part)))
    r = R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"sources": [{"path": str(root / "train.jsonl")}], "eval_sources": [{"path": str(root / "eval.jsonl")}],
                 "max_seq_len": 64},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 8, "max_steps": 2, "learning_rate": 3e-3, "log_every": 1},
        "eval": {"max_batches": 1, "exact_match_samples": 4, "max_new_tokens": 8},
        "output": {"dir": str(root / "run"), "progress_bar": False},
    })
    train(r, root / "run")
    return r, root / "run", [json.loads(line) for line in (root / "eval.jsonl").read_text().splitlines()]


def test_generate_prompt_tokens_equal_training(chat_run, capsys):
    from finetune.train.inference import load_run, trains_chat

    recipe, run_dir, rows = chat_run
    _, tok, _ = load_run(run_dir)
    template = encode.chat_template(recipe.data, tok)
    assert trains_chat(recipe, tok)  # so `generate` renders its prompts as chats without --chat
    for row in rows:
        trained = encode.encode(row, "auto", tok, recipe.data)
        start = next(i for i, lab in enumerate(trained["labels"]) if lab != encode.IGNORE)  # the assistant's first token
        before, answer = encode.last_turn(row)
        assert encode.prompt_ids(tok, before, template) == trained["input_ids"][:start]
        assert answer == row["messages"][-1]["content"]
    # The command: one JSON line per prompt; seeded sampling repeats itself.
    user = rows[0]["messages"][1]["content"]
    argv = ["generate", str(run_dir), "--prompt", user, "--system", "Answer briefly.", "--max-new-tokens", "6",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and outs[0]["prompt"] == user and isinstance(outs[0]["output"], str)
    assert cli.main(["generate", str(run_dir), "--prompt", user, "--no-adapter", "--max-new-tokens", "4"]) == 0


def test_eval_json_reports_chat_exact_match_for_adapter_and_base(chat_run, capsys):
    _, run_dir, _ = chat_run
    assert cli.main(["eval", str(run_dir), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("exact_match", "base_exact_match"):
        assert isinstance(res[key], float) and 0.0 <= res[key] <= 1.0, (key, res)
    # The adapter is scored, and the base without it: two steps on the chat turns already lower the held-out
    # loss (measured: 4.71 against 5.13).
    assert 0 < res["eval_loss"] < res["base_eval_loss"] - 0.1, res
