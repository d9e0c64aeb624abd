"""Resuming into an output dir that holds another run's work: a changed recipe is refused by name (exit 2,
nothing on disk touched), a corrupt newest checkpoint falls back to the previous one, and a second run into a
dir in use stops at once naming the holder (a dead holder does not keep the dir)."""
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune import cli
from finetune.recipe import fingerprint as FP
from finetune.util.errors import RecipeError

from .procs import trained_steps

pytestmark = pytest.mark.slow

RECIPE = {
    "model": {"gradient_checkpointing": False},
    "data": {"max_seq_len": 64, "max_samples": 128, "eval_split": 0},
    "lora": {"dropout": 0.0, "r": 8},
    "train": {"micro_batch_size": 8, "max_steps": 2, "save_every": 1, "keep_checkpoints": 3, "log_every": 1,
              "optimizer": "adamw_torch"},
    "output": {"progress_bar": False},
}


def snapshot(run: Path) -> dict:
    """Every file of a run dir and its bytes (the lock file aside: it only names the last holder)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 2-step run with checkpoints step-1 and step-2, and its recipe file."""
    root = tmp_path_factory.mktemp("base")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "output": {**RECIPE["output"], "dir": str(root / "run")}}))
    assert cli.main([str(recipe)]) == 0
    return root


@pytest.fixture
def run(base, tmp_path):
    """A copy of the base run (and a recipe pointing at it) for one test to change."""
    shutil.copytree(base / "run", tmp_path / "run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "output": {**RECIPE["output"], "dir": str(tmp_path / "run")}}))
    return tmp_path / "run", str(recipe)


@pytest.mark.parametrize("override, field", [
    ("train.learning_rate=1e-3", "train.learning_rate"), ("lora.r=4", "lora.r"),
    ("lora.target_modules=[q_proj,v_proj]", "lora.target_modules"), ("train.optimizer=adamw_8bit", "train.optimizer"),
    ("train.micro_batch_size=4", "train.micro_batch_size"), ("data.max_samples=96", "data.prepared"),
])
def test_a_changed_recipe_is_refused_by_name_and_nothing_is_touched(run, override, field, capsys):
    run_dir, recipe = run
    before = snapshot(run_dir)
    assert cli.main([recipe, override, "train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of a different run" in err and f"  - {field}: " in err, err
    assert "choose a new output.dir" in err and "restore the old values" in err and "Traceback" not in err
    assert snapshot(run_dir) == before  # no checkpoint, metric line or recipe.yaml changed


def test_free_fields_may_change_and_say_so(run, capsys):
    run_dir, recipe = run
    assert cli.main([recipe, "train.max_steps=3", "train.log_every=2"]) == 0
    out = capsys.readouterr().out
    assert "train.max_steps changed from 2 to 3" in out and "train.log_every changed from 1 to 2" in out
    assert "resume: from" in out and "step-2" in out
    assert trained_steps(out) == [3], out  # resumed, not restarted
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_process_count_change_is_named():
    stored = {"lora.r": "8", "processes": "2"}
    with pytest.raises(RecipeError) as e:
        FP.compare(stored, {"lora.r": "8", "processes": "1"}, "checkpoints/step-4", "RUN")
    assert "processes: 2 when checkpoints/step-4 was written, now 1" in str(e.value)
    assert "launch the same number of processes" in str(e.value)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(run, capsys):
    """Right size, wrong content (a disk that lied about fsync): resume warns, sets it aside and resumes
    from step-1; the finished run has intact checkpoints and keeps the corrupt one for inspection."""
    run_dir, recipe = run
    f = run_dir / "checkpoints" / "step-2" / "optimizer-rank0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert cli.main([recipe, "train.max_steps=3"]) == 0
    io = capsys.readouterr()
    assert "step-2 is damaged (optimizer-rank0.pt does not have the content" in io.err
    assert "resume: from" in io.out and "step-1 (step 1)" in io.out
    assert trained_steps(io.out) == [2, 3], io.out
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["corrupt-step-2", "step-1", "step-2", "step-3"]
    from finetune.train.keepers import checkpoint as C

    assert all(C.problems(p) is None for _, p in C.list_checkpoints(run_dir / "checkpoints"))


HOLD = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)  # as runlock does: a shorter record over the last run's would leave its tail behind
os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode(), 0)
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_into_a_dir_in_use_stops_and_a_dead_holder_does_not_block(run, capsys):
    run_dir, recipe = run
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir / ".lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(run_dir)
        assert cli.main([recipe, "train.max_steps=3"]) == 3  # a run error, not bad input
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {holder.pid} on " in err and "Traceback" not in err
        assert snapshot(run_dir) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert cli.main([recipe, "train.max_steps=3"]) == 0  # the kernel released the dead holder's lock
