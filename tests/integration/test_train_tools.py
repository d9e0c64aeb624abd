"""A tool-calling, reasoning chat dataset (OpenAI message format) trains end to end on the builtin tiny model,
with a template that rewrites history (its rows split into one example per rewritten turn)."""
import json
import random

import pytest

from finetune import recipe as R
from finetune.train.loop import train
from tests.unit.test_data_tools import REWRITING, TOOLS

pytestmark = pytest.mark.slow

WORDS = ["red", "cat", "sun", "moon", "star", "dog"]


def rows(n: int, seed: int = 0) -> list[dict]:
    """Two user rounds: a tool call with reasoning, its result, an answer; then a follow-up with reasoning."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        city, sky = rng.choice(WORDS), rng.choice(WORDS)
        out.append({"tools": TOOLS, "messages": [
            {"role": "user", "content": f"weather: {city}"},
            {"role": "assistant", "content": None, "reasoning_content": "call",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "name": "get_weather", "content": sky},
            {"role": "assistant", "content": f"{city} {sky}", "reasoning_content": "answer"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": f"{sky} {city}", "reasoning_content": "reverse"}]})
    return out


def test_tool_call_dataset_trains(tmp_path):
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(24)))
    recipe = R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"sources": [{"path": str(data)}], "chat_template": REWRITING, "max_seq_len": 256,
                 "eval_split": 0},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 4, "max_steps": 4, "learning_rate": 3e-3, "log_every": 1},
        "eval": {"max_batches": 1},
        "output": {"dir": str(tmp_path / "run"), "progress_bar": False},
    })
    train(recipe, tmp_path / "run")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert len(losses) == 4 and min(losses[1:]) < losses[0] - 0.1, losses
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
