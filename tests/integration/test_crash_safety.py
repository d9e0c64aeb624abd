"""Crash safety: SIGKILL at chosen moments of a run, then the same command again.

Each trial starts the tiny recipe (shortened with overrides), which holds at its kill point
(tests/killpoints.py): before the first step, between steps, after a metrics line, half-way through each
kind of checkpoint file, with a checkpoint's manifest written but not renamed, after its rename before the
prune, mid-prune, half-way through the final adapter and after it. The test kills it there with SIGKILL
(the moment is an event the run reports, never a delay), checks what is on disk, and re-runs the same
command to the end. Every re-run must resume from the checkpoint the moment implies (the newest complete
one), train only the steps after it, and finish with the adapter and losses of one uninterrupted run
(relative difference <= 1e-4); no kill may leave a checkpoint that loads but is incomplete.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from finetune.train.keepers import checkpoint as C
from tests import killpoints as KP

from .procs import (
    alive,
    end_child,
    exit_code_of,
    fork_cli,
    metrics,
    trained_steps,
    wait_pid,
)

pytestmark = pytest.mark.slow

STEPS = 6
OVERRIDES = [f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.save_every=1", "train.keep_checkpoints=2",
             "train.micro_batch_size=4", "train.log_every=1", "eval.max_batches=1", "output.progress_bar=false",
             # 64 rows read, 3 of them held out: reading and encoding stay a small part of each start.
             "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 64}]", "data.eval_sources=[]"]
# Where each trial's run is killed, and the checkpoint the re-run must resume from (None: none, a fresh
# start). Every step writes a checkpoint (save_every 1) and prunes to two (keep 2).
KILLS = [
    (KP.Point("step", 0), None),  # loaded, the first step about to run: nothing saved
    (KP.Point("metrics", 2), 1),  # step 2's metrics line written, its checkpoint not begun: a line to drop
    (KP.Point("write", 2, "optimizer-rank0.pt"), 1),
    (KP.Point("write", 3, "adapter_model.safetensors"), 2),
    (KP.Point("step", 3), 3),  # between steps
    (KP.Point("manifest", 4), 3),
    (KP.Point("renamed", 4), 4),  # step-2, step-3 and step-4 visible: the re-run's first save prunes first
    (KP.Point("pruning", 5), 5),  # step-3 half deleted under a hidden name
    (KP.Point("export"), STEPS),  # the final adapter half written
    (KP.Point("exported"), STEPS),  # the final adapter in place, the process not yet ended
]


def command(run_dir) -> list[str]:
    return ["recipes/tiny_cpu.yaml", *OVERRIDES, f"output.dir={run_dir}"]


def warm():
    """Import what training imports, once, so forked runs start in a fraction of a second."""
    import accelerate  # noqa: F401
    import bitsandbytes  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from finetune.train import loop as train  # noqa: F401


def rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)) for k in a)


def check_disk_after_kill(run_dir) -> int | None:
    """Every visible checkpoint is complete and loads; a visible adapter is whole. Returns the step of the
    newest checkpoint (the one the re-run must resume from)."""
    root = run_dir / "checkpoints"
    for _, path in C.list_checkpoints(root):
        assert C.problems(path) is None, (path, C.problems(path))
        state = C.verify(path, 1)
        assert load_file(str(path / "adapter" / "adapter_model.safetensors"))
        torch.load(path / "optimizer-rank0.pt", weights_only=True)
        torch.load(path / "scheduler.pt", weights_only=True)
        assert state["step"] == int(path.name.split("-")[1])
    adapter = run_dir / "adapter"
    if adapter.exists():
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
        assert load_file(str(adapter / "adapter_model.safetensors"))
        assert (adapter / "tokenizer_config.json").exists()
    newest = C.latest(root, notice=None)
    return int(newest.name.split("-")[1]) if newest else None


def where_it_was_killed(run, point: KP.Point):
    """What the kill point leaves on disk besides complete checkpoints: proof that the kill landed there."""
    root, hidden = run / "checkpoints", sorted(p.name for p in (run / "checkpoints").glob(".*"))
    if point.kind == "write":
        assert list(root.glob(f".tmp-step-{point.step}/**/{point.name}")), hidden
    elif point.kind == "manifest":
        assert (root / f".tmp-step-{point.step}" / C.MANIFEST).exists(), hidden
    elif point.kind == "renamed":
        assert len(C.list_checkpoints(root)) == 3  # keep + 1: the prune never ran
    elif point.kind == "pruning":
        assert hidden == [".del-step-3"], hidden
    elif point.kind == "metrics":
        assert max(m["step"] for m in metrics(run)) == point.step  # a line ahead of the newest checkpoint
    elif point.kind == "export":
        assert (run / ".tmp-adapter").is_dir() and not (run / "adapter").exists()
    elif point.kind == "exported":
        assert (run / "adapter").is_dir()
    if point.kind in ("step", "renamed", "export", "exported"):
        assert hidden == [], hidden


def trial(k: int, tmp_path, point: KP.Point, expected: int | None, out: dict):
    """One kill-and-resume trial as a generator: it yields whenever it waits, so two trials can share the
    two cores (each child runs one torch thread). Results go into `out[k]`."""
    run, log, marker = tmp_path / f"t{k}", tmp_path / f"t{k}.log", tmp_path / f"t{k}.at"
    pid = fork_cli(command(run), log, before=lambda: KP.install(point, marker))
    try:
        while not marker.exists():
            assert alive(pid) or marker.exists(), f"{point}: the run ended before its kill point\n" + log.read_text()[-3000:]
            yield
        assert marker.read_text() == str(point)
        os.kill(pid, signal.SIGKILL)
        assert wait_pid(pid, 60) == -signal.SIGKILL
    finally:
        end_child(pid)
    newest = check_disk_after_kill(run)
    assert newest == expected, (point, newest)
    where_it_was_killed(run, point)

    rerun_log = tmp_path / f"t{k}.rerun.log"
    pid = fork_cli(command(run), rerun_log)
    try:
        while alive(pid):
            yield
        assert exit_code_of(pid) == 0, rerun_log.read_text()[-3000:]
    finally:
        end_child(pid)
    text = rerun_log.read_text()
    if newest is not None:
        assert f"resume: from {run / 'checkpoints' / f'step-{newest}'} (step {newest})" in text, text[-2000:]
    else:
        assert "resume:" not in text, text[-2000:]
    # It resumed, not restarted: the re-run trained exactly the steps after its checkpoint.
    assert trained_steps(text) == list(range((newest or 0) + 1, STEPS + 1)), (point, text[-2000:])
    # The metrics tell one run: each step once, in order (losses compared with the reference below).
    losses = [(m["step"], m["loss"]) for m in metrics(run) if "loss" in m]
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), (point, losses)
    out[k] = {"point": point, "resumed_from": newest, "losses": [v for _, v in losses],
              "adapter": load_file(str(run / "adapter" / "adapter_model.safetensors"))}


def run_lanes(trials, lanes: int = 2):
    """Round-robin over generator trials, `lanes` at a time. `trials` is an iterable, pulled lazily."""
    source, active = iter(trials), []
    while True:
        while len(active) < lanes:
            nxt = next(source, None)
            if nxt is None:
                break
            active.append(nxt)
        if not active:
            return
        for g in list(active):
            try:
                next(g)
            except StopIteration:
                active.remove(g)
        time.sleep(0.003)  # a polling interval: every wait above is on an event (a file, an exit)


def uninterrupted(name: str, tmp_path, out: dict):
    """A whole run as a generator (see `trial`); records its adapter and losses."""
    run, log = tmp_path / name, tmp_path / f"{name}.log"
    pid = fork_cli(command(run), log)
    while alive(pid):
        yield
    assert exit_code_of(pid) == 0, log.read_text()[-3000:]
    out[name] = {"losses": [m["loss"] for m in metrics(run) if "loss" in m],
                 "adapter": load_file(str(run / "adapter" / "adapter_model.safetensors"))}


def test_sigkill_at_chosen_moments_then_resume(tmp_path):
    warm()
    refs, out = {}, {}
    # The reference runs beside the first trials; every trial is compared with it at the end.
    run_lanes([uninterrupted("ref", tmp_path, refs)]
              + [trial(k, tmp_path, point, expected, out) for k, (point, expected) in enumerate(KILLS)])
    reference, ref_losses = refs["ref"]["adapter"], refs["ref"]["losses"]
    assert len(ref_losses) == STEPS and len(out) == len(KILLS)
    for k in sorted(out):
        diff = rel_diff(out[k]["adapter"], reference)
        assert diff <= 1e-4, (out[k]["point"], diff)
        assert out[k]["losses"] == pytest.approx(ref_losses, rel=1e-4), out[k]["point"]
    print(f"\ncrash safety: {len(out)} kills, resumed from steps {[out[k]['resumed_from'] for k in sorted(out)]}, "
          f"largest relative adapter difference {max(rel_diff(r['adapter'], reference) for r in out.values()):.1e}")
