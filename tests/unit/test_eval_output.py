"""`finetune eval`'s human lines: a figure that could not be measured reads n/a, with the reason once."""
import argparse
from pathlib import Path

from finetune.commands import evaluate


def test_exact_match_without_prompts_reads_na_with_the_reason(monkeypatch, capsys):
    import finetune.train.inference as inference
    import finetune.train.runcheck as runcheck

    res = {"eval_loss": 0.5, "exact_match": None, "base_eval_loss": 1.7, "base_exact_match": None}
    monkeypatch.setattr(runcheck, "checked_run", lambda run_dir: None)
    monkeypatch.setattr(inference, "run_eval", lambda run_dir, max_rows: dict(res))
    args = argparse.Namespace(run_dir=Path("run"), max_rows=10, show=0, json=True)
    assert evaluate.run(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert "exact_match: n/a" in out and "base_exact_match: n/a" in out and "eval_loss: 0.5000" in out
    assert sum("no held-out row has a prompt" in line for line in out) == 1
    assert out[-1] == '{"eval_loss": 0.5, "exact_match": null, "base_eval_loss": 1.7, "base_exact_match": null}'
