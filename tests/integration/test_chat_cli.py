"""`finetune chat RUN_DIR` on one tiny trained run, driven as a user drives it: through a pseudo-terminal (two
turns, then /exit), and from a script on a pipe (the history bounded by the model's context; /reset). Every
answer must equal `generate --messages` on the same conversation, greedy, so chat renders what generate renders."""
import json
import os
import shutil
from pathlib import Path

import pytest

from finetune import cli
from finetune import recipe as R

from ..conftest import run_cli
from .procs import pty_chat

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TURNS = ["reverse the words: red green blue", "and now: one two three"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from finetune.train.loop import train

    out = tmp_path_factory.mktemp("chat") / "run"
    recipe = R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"max_seq_len": 64, "max_samples": 64, "prompt_template": "chat"},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 8, "max_steps": 3, "learning_rate": 3e-3, "log_every": 1},
        "eval": {"max_batches": 1, "max_new_tokens": 8},
        "output": {"dir": str(out), "progress_bar": False}})
    train(recipe, out)
    return out


def _generate(run_dir: Path, messages: list, tmp: Path, capsys, *extra) -> str:
    path = tmp / "messages.json"
    path.write_text(json.dumps(messages))
    assert cli.main(["generate", str(run_dir), "--messages", str(path), "--max-new-tokens", "8", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["output"]


def test_chat_through_a_terminal_answers_as_generate_does(run_dir, tmp_path, capsys):
    answers, transcript, code = pty_chat([str(run_dir), "--max-new-tokens", "8"], TURNS, ENV)
    assert code == 0 and "Traceback" not in transcript, transcript
    assert len(answers) == 2
    first = _generate(run_dir, [{"role": "user", "content": TURNS[0]}], tmp_path, capsys)
    assert answers[0] == first + "\n"
    second = _generate(run_dir, [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first},
                                 {"role": "user", "content": TURNS[1]}], tmp_path, capsys)
    assert answers[1] == second + "\n"  # the second turn was prompted with the first one before it
    alone = _generate(run_dir, [{"role": "user", "content": TURNS[1]}], tmp_path, capsys)
    assert alone != second  # (so the comparison above tells a prompt with the history from one without)


def test_chat_from_a_script_drops_old_turns_to_fit_the_context(run_dir):
    # 1024 positions; each message is about 300 tokens and an answer at most 8: three turns fit, a fourth
    # pushes the oldest out
    long = " ".join(f"w{i}" for i in range(100))

    def chat(lines):
        proc = run_cli(["chat", str(run_dir), "--max-new-tokens", "8"], input="".join(line + "\n" for line in lines),
                       env=ENV)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return proc

    proc = chat([long, long + " b", "/reset", long + " c", long + " d", long + " e", "/exit", "never read"])
    assert proc.stderr.count("history cleared") == 1 and "dropped the oldest" not in proc.stderr, proc.stderr
    assert proc.stdout.count("\n") >= 5  # five answers, none for the line after /exit
    proc = chat([long, long + " b", long + " c", long + " d"])  # no /exit: end of input ends it
    assert proc.stderr.count("dropped the oldest 1 turn(s) to fit the model's context of 1024 tokens") == 1


def test_chat_without_a_chat_template_exits_2_with_one_line(run_dir, tmp_path):
    bare = tmp_path / "run"
    shutil.copytree(run_dir, bare)
    config = bare / "adapter" / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg.pop("chat_template")
    config.write_text(json.dumps(cfg))
    (bare / "adapter" / "chat_template.jinja").unlink()
    proc = run_cli(["chat", str(bare)], input="hi\n", env=ENV, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "has no chat template" in proc.stderr and proc.stdout == ""
