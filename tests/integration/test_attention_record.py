"""The run records which attention ran (RUN_DIR/memory.json, "attention"; finetune.train.sdpa)."""
import json


def test_the_run_dir_records_its_attention(trained_run):
    rec = json.loads((trained_run / "memory.json").read_text())["attention"]
    assert rec["implementation"] == "sdpa" and rec["device"] == "cpu"
    assert rec["sdpa_backends_allowed"].startswith("torch's choice")  # CPU: torch's blockwise flash kernel
