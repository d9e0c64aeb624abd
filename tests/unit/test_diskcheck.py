"""An output dir that cannot be written, or a disk too small for the planned checkpoints, is an error
before any weights load (`finetune validate` and the training preflight)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from finetune import recipe as R
from finetune.plan import disk as D
from finetune.plan.archs import resolve

ROOT = Path(__file__).resolve().parents[2]
Usage = namedtuple("Usage", "total used free")


def llama8b(tmp_path, **train):
    r = R.load(ROOT / "recipes" / "llama3_8b_qlora.yaml", [f"output.dir={tmp_path / 'run'}"]
               + [f"train.{k}={v}" for k, v in train.items()])
    return r, resolve(r.model.name)[0]


def test_planned_checkpoint_size_follows_the_recipe(tmp_path):
    r, arch = llama8b(tmp_path)
    need = D.planned_bytes(r, arch, 1)
    # Llama-3-8B, r=16 on all 7 linears of 32 layers: 41.9M adapter parameters, fp32.
    assert need.adapter == pytest.approx(41_943_040 * 4 + D.SMALL_FILES, rel=1e-6)
    # 8-bit AdamW: two one-byte moments per parameter (+ absmax): about half the fp32 adapter again.
    assert 0.5 < (need.checkpoint - need.adapter) / need.adapter < 0.6
    assert need.copies == r.train.keep_checkpoints + 1
    bigger = D.planned_bytes(R.from_dict({**r.model_dump(), "lora": {"r": 64}}), arch, 1)
    assert bigger.checkpoint == pytest.approx(4 * need.checkpoint, rel=0.05)
    few = D.planned_bytes(R.from_dict({**r.model_dump(), "train": {"max_steps": 10}}), arch, 1)
    assert few.copies == 2  # one save at the end, plus the one being written


def test_too_little_free_space_is_an_error_with_the_numbers(tmp_path):
    r, arch = llama8b(tmp_path)
    need = D.planned_bytes(r, arch, 1).total
    low = D.output_problems(r, arch, 1, disk_usage=lambda p: Usage(10 * need, 9 * need, need - 1))
    assert len(low) == 1 and low[0].level == "error" and low[0].path == "output.dir"
    assert "free" in low[0].message and "3 checkpoints" in low[0].message and "keep_checkpoints" in low[0].fix
    assert D.output_problems(r, arch, 1, disk_usage=lambda p: Usage(10 * need, 0, need + 1)) == []


def test_this_disk_cannot_hold_a_plan_larger_than_itself(tmp_path):
    """The real free space of tmp_path's disk against a real plan no disk holds: 1000 kept checkpoints of a
    rank-4096 adapter on a 70B model."""
    r = R.load(ROOT / "recipes" / "llama3_70b_qlora.yaml",
               [f"output.dir={tmp_path / 'run'}", "lora.r=4096", "train.keep_checkpoints=1000",
                "train.save_every=1", "train.max_steps=5000"])
    arch = resolve(r.model.name)[0]
    (problem,) = D.output_problems(r, arch, 8)
    assert "TiB" in problem.message and problem.level == "error"


def test_a_file_in_the_way_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    r = R.from_dict({"output": {"dir": str(tmp_path / "file" / "run")}})
    (problem,) = D.output_problems(r)
    assert "is a file" in problem.message


@pytest.mark.parametrize("bad", ["/tmp/a\x00b", "  "])
def test_an_unusable_path_is_an_error(bad):
    (problem,) = D.output_problems(R.from_dict({"output": {"dir": bad}}))
    assert "not a usable path" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_dir_is_an_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        (problem,) = D.output_problems(R.from_dict({"output": {"dir": str(ro / "run")}}))
        assert "permission denied" in problem.message
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs")
def test_a_file_system_that_refuses_new_files_is_an_error():
    """sysfs refuses to create files, even for root: the probe sees what os.access cannot."""
    (problem,) = D.output_problems(R.from_dict({"output": {"dir": "/sys/kernel/finetune-run"}}))
    assert problem.level == "error" and "cannot write to /sys/kernel" in problem.message
    assert not os.path.exists("/sys/kernel/finetune-run")


def test_a_writable_dir_passes_and_the_probe_leaves_nothing(tmp_path):
    r = R.from_dict({"output": {"dir": str(tmp_path / "a" / "b")}})
    assert D.output_problems(r) == []
    assert list(tmp_path.iterdir()) == []


def test_validate_cli_reports_it_and_exits_2(tmp_path):
    (tmp_path / "file").write_text("x")
    out = subprocess.run([sys.executable, "-m", "finetune", "validate", "recipes/llama3_8b_qlora.yaml",
                          f"output.dir={tmp_path / 'file' / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "output.dir" in out.stdout and "is a file" in out.stdout, out


def test_training_stops_before_loading_anything(tmp_path):
    """The training verb runs the same preflight first: exit 2 in well under a second of work, no
    traceback, nothing created."""
    (tmp_path / "file").write_text("x")
    out = subprocess.run([sys.executable, "-m", "finetune", "recipes/tiny_cpu.yaml",
                          f"output.dir={tmp_path / 'file' / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "is a file" in out.stderr and "Traceback" not in out.stderr, out
    assert "torch" not in out.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
