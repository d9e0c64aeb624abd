"""What a resume restores, item by item (finetune.train.keepers.resume): a tiny run checkpoints, the same
command resumes it, and the run the steps start from holds exactly the checkpoint's adapter, optimizer state,
schedule, RNG, data position and fp16 loss scale, the run's tracker ids, and (DPO) the reference log-probs
read from the run dir, never recomputed. Every item goes through the one `Resume.restore` call."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from finetune import recipe as R
from finetune.train import loop, refpolicy
from finetune.train.gather import gather_full_adapter_state
from finetune.train.keepers import checkpoint
from finetune.train.keepers import resume as resume_mod
from finetune.util.errors import RunError

pytestmark = pytest.mark.slow


def tiny(run_dir, method="sft", **train):
    source = {"path": "builtin:tiny-preference" if method != "sft" else "builtin:tiny-instruct", "max_samples": 40}
    return R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"sources": [source], "eval_sources": [], "eval_split": 0.1, "max_seq_len": 64, **({"prompt_template": "raw"} if method == "sft" else {})},
        "lora": {"dropout": 0.0},
        # 36 training rows, 9 micro-batches of 4 an epoch, 2 a step: checkpoint step-5 is in the second epoch
        "train": {"method": method, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 6,
                  "save_every": 5, "warmup_steps": 1, "learning_rate": 3e-3, "log_every": 1, **train},
        "output": {"dir": str(run_dir), "progress_bar": False},
    })


def equal(a, b, where="") -> None:
    """a == b for nested state dicts of tensors, lists, numbers."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def capture(monkeypatch) -> dict:
    """From here on: the Run the steps start from, the torch RNG state as they start, and what the one
    Resume.restore call returned; the resumed run ends there (its steps are not the subject)."""
    out = {"restore_calls": 0}
    restore = resume_mod.Resume.restore

    def recording_restore(self, *args, **kwargs):
        out["restore_calls"] += 1
        out["restored"] = restore(self, *args, **kwargs)
        return out["restored"]

    def first_step(run, stop, return_model):
        out.update(run=run, rng=torch.get_rng_state(), adapter=gather_full_adapter_state(run.acc, run.model),
                   optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
                   scaler=run.scaler.state_dict())
        return {"step": run.step}

    class RecordingTrackers(loop.Trackers):
        def __init__(self, *args):
            out["trackers_given"] = args[-1]  # the kept run ids the trackers continue
            super().__init__(*args)

    monkeypatch.setattr(resume_mod.Resume, "restore", recording_restore)
    monkeypatch.setattr(loop, "steps", first_step)
    monkeypatch.setattr(loop, "Trackers", RecordingTrackers)
    return out


def train_then_lose_step_6(run_dir, recipe):
    """Train 6 steps (checkpoints at 5 and 6), then, as after a crash past step 5, drop the later checkpoint
    and the adapter: the same command resumes from checkpoints/step-5, which is returned."""
    loop.train(recipe, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-6")
    shutil.rmtree(run_dir / "adapter")
    return run_dir / "checkpoints" / "step-5"


def test_a_resume_restores_every_item_of_its_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # fp16, so the loss scaler has a state to restore
    recipe = tiny(run_dir, mixed_precision="fp16")
    recipe = recipe.model_copy(update={"quantization": recipe.quantization.model_copy(update={"compute_dtype": "float16"})})
    ckpt = train_then_lose_step_6(run_dir, recipe)
    kept_ids = {"wandb": {"id": "abc123"}, "mlflow": {"run_id": "r-1"}}  # as a tracked run keeps them
    (run_dir / "trackers.json").write_text(json.dumps(kept_ids))
    manifest = json.loads((ckpt / "trainer_state.json").read_text())
    assert manifest["step"] == 5 and manifest["data"] == {"epoch": 1, "cursor": 1}

    captured = capture(monkeypatch)
    assert loop.train(recipe, run_dir) == {"step": 5}
    run, restored = captured["run"], captured["restored"]
    assert captured["restore_calls"] == 1
    # adapter
    saved = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    equal(captured["adapter"], saved, "adapter")
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained, not the fresh zeros
    # optimizer, schedule, RNG, scaler
    equal(captured["optimizer"], torch.load(ckpt / "optimizer-rank0.pt", weights_only=True), "optimizer")
    assert captured["optimizer"]["state"]  # Adam's moments, not an empty state
    equal(captured["scheduler"], torch.load(ckpt / "scheduler.pt", weights_only=True), "scheduler")
    assert captured["scheduler"]["last_epoch"] == 5 and run.scheduler.get_last_lr() == captured["scheduler"]["_last_lr"]
    assert torch.equal(captured["rng"], torch.load(ckpt / "rng-rank0.pt", weights_only=True)["torch"])
    equal(captured["scaler"], torch.load(ckpt / "scaler-rank0.pt", weights_only=True), "scaler")
    assert captured["scaler"]["scale"] > 0
    # data position
    assert (run.step, run.epoch, run.cursor) == (5, manifest["data"]["epoch"], manifest["data"]["cursor"])
    assert (restored.step, restored.epoch, restored.cursor) == (run.step, run.epoch, run.cursor)
    # tracker ids, handed to the trackers
    assert restored.tracker_ids == kept_ids and captured["trackers_given"] == kept_ids
    assert restored.reference is None  # not a DPO run


def test_a_resumed_dpo_run_reads_its_reference_log_probs(tmp_path, monkeypatch):
    run_dir = tmp_path / "dpo"
    recipe = tiny(run_dir, "dpo", beta=0.5)
    train_then_lose_step_6(run_dir, recipe)
    stored = json.loads((run_dir / refpolicy.FILE).read_text())

    def never(*a, **k):
        raise AssertionError("a resumed run recomputed the reference log-probs")

    monkeypatch.setattr(refpolicy, "compute", never)
    captured = capture(monkeypatch)
    loop.train(recipe, run_dir)
    run, restored = captured["run"], captured["restored"]
    assert restored.reference == stored and restored.step == 5
    assert [list(e["ref"]) for e in run.prepared.train] == stored["train"]
    assert [list(e["ref"]) for e in run.prepared.eval] == stored["eval"]
    # ... a damaged file is refused by name, checked against the size and SHA-256 the checkpoint's manifest recorded
    manifest = json.loads((run_dir / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    path, whole = run_dir / refpolicy.FILE, (run_dir / refpolicy.FILE).read_bytes()
    assert manifest["beside"][str(refpolicy.FILE)]["bytes"] == len(whole)
    path.write_bytes(whole[: len(whole) // 2])  # truncated: it used to end in a JSONDecodeError traceback
    with pytest.raises(RunError, match=f"{path} has {len(whole) // 2} bytes, the checkpoint recorded {len(whole)}"):
        loop.train(recipe, run_dir)
    path.write_bytes(whole.replace(b"]", b" ]", 1)[:-1])  # same size, other bytes: the hash tells
    assert "its SHA-256 differs" in checkpoint.beside_problem(manifest, run_dir, str(refpolicy.FILE))
    # ... and without the file a resumed DPO run refuses to start rather than recompute them
    (run_dir / refpolicy.FILE).unlink()
    with pytest.raises(RunError, match="reference log-probs of a resumed DPO run cannot be recomputed"):
        loop.train(recipe, run_dir)
