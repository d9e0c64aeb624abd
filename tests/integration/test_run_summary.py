"""The end of a run and its resume, as the command line shows them: parameter counts in parameters
(not packed 4-bit bytes), the held-out source, a summary instead of `done: {dict}`, `time` going on across a
resume, and a resume that lengthens the run saying what the learning-rate schedule does."""
import json
import re

import pytest
import yaml

from ..conftest import run_cli

pytestmark = pytest.mark.slow

ARGS = ["recipes/tiny_cpu.yaml", "train.log_every=5", "train.save_every=10", "train.warmup_steps=2",
        "data.max_samples=320", "eval.max_batches=2", "output.progress_bar=false"]


def test_a_run_ends_in_a_summary_and_its_resume_keeps_time_and_names_the_schedule(tmp_path):
    run = tmp_path / "run"
    first = run_cli([*ARGS, "train.max_steps=10", f"output.dir={run}"])
    assert first.returncode == 0, first.stderr[-2000:]
    out = first.stdout
    assert "done: {" not in out
    # The tiny Llama: 2.56M parameters in the base (2.36M of them in its 4-bit linears) + 262k of LoRA r=16.
    assert re.search(r"^model: 2\.82M parameters, 2\.36M of them in 4 bits, 262k trainable \(9\.3%\);", out, re.M), out
    assert "data: training on builtin:tiny-instruct; held out for eval: data.eval_sources builtin:tiny-instruct " \
           "(split eval)" in out
    assert re.search(r"^finished: 10 steps; [\d.]+ s wall for this command, [\d.]+ s of training in all, \d+ tokens/s$",
                     out, re.M), out
    assert re.search(r"^loss: [\d.]+ at step 1 -> [\d.]+ at step 10$", out, re.M)
    assert re.search(r"^held out: eval_loss [\d.]+ ", out, re.M)
    assert re.search(r"^peak memory: [\d.]+ GiB RSS per process \(phase \w+;", out, re.M)
    assert f"adapter: {run / 'adapter'}" in out and f"finetune merge {run}" in out
    assert f"report: {run / 'report.html'} (loss and learning-rate curves, memory per phase)" in out

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    t10 = max(r["time"] for r in records if r["step"] == 10)
    second = run_cli([*ARGS, "train.max_steps=20", f"output.dir={run}"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert re.search(r"resume: the learning-rate schedule now spans 20 steps: step 10 ran at 0, the next steps run "
                     r"from [\d.e-]+ and decay to 0 at step 20", second.stderr), second.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r["time"] for r in records if r["step"] > 10]
    assert after and min(after) > t10, (t10, after)  # the clock goes on from the checkpoint's time


def test_eval_writes_and_shows_predictions_and_generate_takes_instruction_rows_and_conversations(run, tmp_path):
    # `run`: a copy of the session's trained tiny run (tests/integration/conftest.py); eval reads its settings
    # from the run's recipe.yaml: 4 prompts compared, 2 held-out batches scored
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["eval"].update({"exact_match_samples": 4, "max_batches": 2})
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    shown = run_cli(["eval", str(run), "--show", "2"])
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert rows and set(rows[0]) == {"prompt", "expected", "adapter", "base", "match", "base_match"}
    assert f"predictions: {run / 'predictions.jsonl'}" in shown.stdout
    assert shown.stdout.count("--- prediction ") == 2 and f"expected: {rows[0]['expected']!r}" in shown.stdout

    # an instruction row's fields render as training renders them: the same tokens as the layout typed out
    by_fields = run_cli(["generate", str(run), "--instruction", "Reverse the words.", "--input", "cloud rocket river",
                         "--max-new-tokens", "6"])
    typed = run_cli(["generate", str(run), "--prompt", "Reverse the words.\\ncloud rocket river\\n",
                     "--max-new-tokens", "6"])
    assert by_fields.returncode == 0 and typed.returncode == 0, by_fields.stderr[-2000:]
    assert by_fields.stdout == typed.stdout and '"prompt": "Reverse the words.\\ncloud rocket river\\n"' in typed.stdout
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "reverse: a b"},
                                             {"role": "assistant", "content": "b a"},
                                             {"role": "user", "content": "reverse: c d"}]}))
    multi = run_cli(["generate", str(run), "--messages", str(conv), "--max-new-tokens", "4"])
    assert multi.returncode == 0, multi.stderr[-2000:]
    out = json.loads(multi.stdout.strip().splitlines()[-1])
    assert out["prompt"][-1] == {"role": "user", "content": "reverse: c d"} and isinstance(out["output"], str)
    bad = run_cli(["generate", str(run), "--input", "x"])
    assert bad.returncode == 2 and "--input: give --instruction with it" in bad.stderr


def test_each_logged_step_records_its_host_time_within_its_wall_time(trained_run):
    # trained_run: 3 steps of the tiny recipe, logged at steps 1 and 3. The host time is the training thread's
    # CPU time up to the step's read of its loss; it cannot exceed the step's wall time, and on CPU, where that
    # thread computes, it is not nothing.
    from finetune.train.keepers.summary import summary

    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 3]
    for r in steps:
        assert 0 < r["host_s_per_step"] <= r["s_per_step"] * 1.01 + 1e-3, r
    line = [ln for ln in summary(trained_run, {"step": 3}, 1.0) if ln.startswith("host time: ")]
    assert re.fullmatch(r"host time: [\d.]+ ms of [\d.]+ ms a step on the training thread \(Python, launches, "
                        r"optimizer bookkeeping\)", line[0]), line


def test_host_time_is_per_step_since_the_last_log_and_restarts_there():
    from types import SimpleNamespace

    from finetune.train.loop import TokenRate

    rate, run = TokenRate(), SimpleNamespace(host_s=0.0)
    for host in (0.1, 0.2):  # two steps' host time, as optimizer_step adds it
        run.host_s += host
        rate.add(100)
    got = rate.host_and_wall(run)
    assert got["host_s_per_step"] == 0.15 and got["s_per_step"] >= 0 and run.host_s == 0.0
    rate.reset()
    run.host_s += 0.05
    rate.add(100)
    assert rate.host_and_wall(run)["host_s_per_step"] == 0.05  # the earlier steps' time is not counted again
