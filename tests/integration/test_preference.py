"""Preference tuning (train.method dpo | orpo) through the real loop: 2-process FSDP over gloo against one
process, SIGKILL mid-run then the same command (resumes to the uninterrupted result, reference log-probs
reused from the run dir), and no second copy of the 4-bit base in a DPO run."""
import gc
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests import killpoints as KP

from ..conftest import ROOT, warm_launch
from .procs import alive, fork_cli, metrics, trained_steps, wait_pid
from .test_fsdp_train import COMMON, STRICT, launch, single_run

pytestmark = [pytest.mark.slow]

PREF = ["data.sources=[{path: builtin:tiny-preference}]", "data.eval_sources=[]", "data.eval_split=0.02",
        "data.max_samples=200", "train.beta=0.5"]


def pref_metrics(run_dir):
    return [r for r in metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """The one-process reference run of an argument list, trained once: FSDP2's and FSDP1's DPO cases compare
    against the same run (they only read its metrics and reference log-probs)."""
    runs = {}

    def run(extra):
        if tuple(extra) not in runs:
            runs[tuple(extra)] = single_run(tmp_path_factory, extra)
        return runs[tuple(extra)]
    return run


@pytest.mark.distributed
@pytest.mark.parametrize("method,version", [("dpo", 2), ("orpo", 2), ("dpo", 1)])
def test_two_process_fsdp_matches_one_process(tmp_path, single_runs, method, version):
    extra = STRICT + PREF + [f"train.method={method}", "model.gradient_checkpointing=true"]
    single = single_runs(extra + ["train.save_every=null"])
    run = tmp_path / "fsdp"
    log = launch(run, version, extra)
    assert f"fsdp: FSDP{version} over gloo, 2 processes" in log
    ref, got = pref_metrics(single), pref_metrics(run)
    assert len(got) == len(ref) == 20
    for key in ("loss", "rewards_chosen", "rewards_rejected", "margin"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], abs=1e-2), key
    if method == "orpo":  # DPO's rewards stay ~1e-6 under STRICT's tiny updates: their sign is rounding there
        assert [r["accuracy"] for r in got] == pytest.approx([r["accuracy"] for r in ref], abs=0.07)
    if method == "dpo":  # the reference log-probs, computed in blocks over both ranks, are one process's
        a = json.loads((single / "reference" / "logps.json").read_text())["train"]
        b = json.loads((run / "reference" / "logps.json").read_text())["train"]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)


@pytest.mark.distributed
def test_two_process_ddp_matches_one_process(tmp_path, tmp_path_factory):
    extra = STRICT + PREF + ["train.method=dpo"]
    single = single_run(tmp_path_factory, extra + ["train.save_every=null"])
    run = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--multi_gpu", "--num_processes", "2", "-m", "finetune",
           str(ROOT / "recipes" / "tiny_cpu_fsdp.yaml"), "distributed.strategy=ddp", f"output.dir={run}", *COMMON, *extra]
    cmd, env = warm_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ref, got = pref_metrics(single), pref_metrics(run)
    assert len(got) == len(ref) == 20
    for key in ("loss", "rewards_chosen", "rewards_rejected", "margin"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], abs=1e-2), key


DPO_STEPS, DPO_SAVE = 12, 5


def dpo_command(run_dir):
    return ["recipes/tiny_cpu.yaml", *PREF, "train.method=dpo", f"train.max_steps={DPO_STEPS}",
            f"train.save_every={DPO_SAVE}", "train.log_every=1", "train.warmup_steps=2", "output.progress_bar=false",
            f"output.dir={run_dir}"]


def test_sigkill_mid_dpo_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Killed two steps after its checkpoint (held there: tests/killpoints.py), the run resumes from it, trains
    only the steps after it and ends where the uninterrupted run (trained beside it) ends."""
    ref_run, run, marker = tmp_path / "ref", tmp_path / "killed", tmp_path / "at"
    ref_pid = fork_cli(dpo_command(ref_run), tmp_path / "ref.log")  # one torch thread each: they share two cores
    pid = fork_cli(dpo_command(run), tmp_path / "killed.log",
                   before=lambda: KP.install(KP.Point("step", DPO_SAVE + 2), marker))
    KP.wait_for(marker, lambda: alive(pid))
    os.kill(pid, signal.SIGKILL)
    assert wait_pid(pid, 60) == -signal.SIGKILL
    assert max(r["step"] for r in pref_metrics(run)) == DPO_SAVE + 2  # steps past the checkpoint were logged
    stored = (run / "reference" / "logps.json").read_text()

    pid = fork_cli(dpo_command(run), tmp_path / "rerun.log")
    assert wait_pid(pid, 600) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    text = (tmp_path / "rerun.log").read_text()
    assert f"resume: from {run / 'checkpoints' / f'step-{DPO_SAVE}'}" in text, text[-3000:]
    assert "reference: log-probs" not in text  # reused, not recomputed
    assert trained_steps(text) == list(range(DPO_SAVE + 1, DPO_STEPS + 1)), text[-3000:]  # resumed, not restarted
    assert wait_pid(ref_pid, 600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    assert (run / "reference" / "logps.json").read_text() == stored
    ref, got = pref_metrics(ref_run), pref_metrics(run)
    assert [r["step"] for r in got] == list(range(1, DPO_STEPS + 1))
    for key in ("loss", "margin", "accuracy"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (ref_run, run))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


def test_a_dpo_run_holds_one_copy_of_the_4bit_base(tmp_path, monkeypatch):
    """Counted while the reference log-probs are computed and at every step: the 4-bit parameters alive in
    the process are exactly those of the one model."""
    import bitsandbytes as bnb

    from finetune.recipe import load
    from finetune.train import loop, refpolicy, step

    counts = []
    gc.collect()
    # 4-bit parameters an earlier test of this process still holds are not this run's: kept referenced here,
    # so their ids stay theirs, and left out of the count
    earlier = [o for o in gc.get_objects() if isinstance(o, bnb.nn.Params4bit)]
    earlier_ids = {id(o) for o in earlier}

    def count(fn):
        def wrapper(*args, **kwargs):
            gc.collect()
            counts.append(sum(1 for o in gc.get_objects()
                              if isinstance(o, bnb.nn.Params4bit) and id(o) not in earlier_ids))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(refpolicy, "sequence_logps", count(refpolicy.sequence_logps))
    monkeypatch.setattr(step, "pair_loss", count(step.pair_loss))
    # 40 pairs: every count scans the whole heap (~1-2 s in a worker that has run many tests), and 3 batches
    # of reference log-probs show the same as 13
    recipe = load(ROOT / "recipes" / "tiny_cpu.yaml", PREF + ["data.max_samples=40", "train.method=dpo",
                                                            "train.max_steps=3", "train.warmup_steps=0",
                                                            f"output.dir={tmp_path}"])
    out = loop.train(recipe, tmp_path, return_model=True)
    in_model = sum(1 for m in out["model"].modules() if isinstance(m, bnb.nn.Linear4bit))
    assert in_model == 4 * 7  # 4 layers x (q, k, v, o, gate, up, down)
    assert counts and set(counts) == {in_model}, counts
    assert (tmp_path / "reference" / "logps.json").exists()
