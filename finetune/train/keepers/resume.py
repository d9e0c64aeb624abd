"""What a resume restores, in one place: the checkpoint `train.resume` names, opened once, and everything a
resumed run takes from it and from the run dir beside it.

`Resume.open` (collective, before anything is loaded into the model): leftovers of an interrupted checkpoint
write are cleaned, damaged checkpoints newer than the newest intact one are set aside, the checkpoint is
resolved (`train.resume`: auto, a path, or false), verified (every file's size and SHA-256, torch files
weights-only) and its fingerprint compared with this run's (a changed recipe, process count or data is
refused here). A fresh run's Resume holds no checkpoint (`path` None) and restores nothing.

A resume restores, in two calls, because the wrap shards what it finds:
- `adapter_into(model)`, before the wrap: the adapter weights, full tensors on every rank;
- `restore(...)`, after the wrap (and the shard fill), everything else: each rank's optimizer state (its
  shard under FSDP), the schedule, the RNG, the data position (step, epoch, cursor), the fp16 loss scaler,
  the experiment trackers' run ids (RUN_DIR/trackers.json) and DPO's reference log-probs
  (RUN_DIR/reference/logps.json: the model has moved on, so they are read, never recomputed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.train import refpolicy
from finetune.train.keepers import checkpoint, trackers
from finetune.train.lora import load_adapter_into
from finetune.train.optim import schedule_note
from finetune.util.errors import RunError
from finetune.util.log import log

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from finetune.train.run import Optim


@dataclass(frozen=True)
class Restored:
    """What the steps go on from: the data position, and what a resumed run reuses. A fresh run's is
    `Restored()`: step 0, new tracker runs (`tracker_ids` None), reference log-probs still to be made."""
    step: int = 0
    epoch: int = 0
    cursor: int = 0  # micro-batches consumed in `epoch`
    tracker_ids: dict | None = None  # RUN_DIR/trackers.json of the run resumed ({} when it kept none)
    reference: dict | None = None  # DPO: {"key", "train", "eval"} from RUN_DIR/reference/logps.json


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from, opened once (`open`), or none (`path` None: a fresh run)."""
    run_dir: Path
    path: Path | None = None
    manifest: dict = field(default_factory=dict)  # the checkpoint's trainer_state.json, verified

    @classmethod
    def open(cls, setting, run_dir: Path, acc: Accelerator, fingerprint: dict) -> Resume:
        """The checkpoint `setting` (train.resume) names in RUN_DIR/checkpoints, verified and matched against
        this run's `fingerprint` (RecipeError on a defining change). Collective."""
        root = run_dir / "checkpoints"
        if acc.is_main_process:
            checkpoint.clean_partial(root)  # leftovers of an interrupted checkpoint write
            checkpoint.set_aside_damaged(root)  # newer than the newest intact one: never resumed or pruned
        acc.wait_for_everyone()
        path = checkpoint.resolve_resume(setting, root)
        if path is None:
            return cls(run_dir)
        manifest = checkpoint.verify(path)
        for line in checkpoint.compare_fingerprint(manifest, fingerprint, path, run_dir):
            log.info(f"resume: {line}")
        return cls(run_dir, path, manifest)

    def adapter_into(self, model: torch.nn.Module) -> None:
        """The checkpoint's adapter weights into the unwrapped PeftModel (every rank loads the full tensors;
        the wrap then shards them). Replaces lora.init_adapter's, which a fresh run starts from."""
        if self.path is not None:
            load_adapter_into(model, self.path / "adapter")

    def restore(self, acc: Accelerator, optim: Optim, total_steps: int, reference_key: str | None) -> Restored:
        """Everything else a resume restores, into the wrapped run: optimizer, schedule and RNG, the fp16
        loss scaler, and (returned) the data position, the trackers' run ids and, for DPO (`reference_key`
        given), the reference log-probs. A fresh run: nothing, `Restored()`."""
        if self.path is None:
            return Restored()
        rank, data = acc.process_index, self.manifest["data"]
        checkpoint.load_training_state(self.path, rank, optim.optimizer, optim.scheduler)  # + the RNG
        optim.scaler.load_state_dict(checkpoint.load_scaler_state(self.path, rank))
        step = self.manifest["step"]
        log.info(f"resume: from {self.path} (step {step})")
        if note := schedule_note(optim.scheduler, step, total_steps):  # a longer run stretches the decay
            log.warning(f"resume: {note}")
        return Restored(step, data.get("epoch", 0), data["cursor"], trackers.read_state(self.run_dir),
                        None if reference_key is None else self._reference(reference_key))

    def _reference(self, key: str) -> dict:
        why = checkpoint.beside_problem(self.manifest, self.run_dir, str(refpolicy.FILE))
        if why:  # verified like the checkpoint's own files: its size and SHA-256 are in the manifest
            raise RunError([f"resume: {why} since {self.path.name} was written; the reference log-probs of a resumed "
                            "DPO run cannot be recomputed (the model has moved on): restore the file, or start a "
                            "fresh run (a new output.dir)"])
        stored = refpolicy.read_stored(self.run_dir, key)
        if stored is None:
            raise RunError([f"resume: {self.run_dir / refpolicy.FILE} is missing, damaged or was made for another recipe; "
                            "the reference log-probs of a resumed DPO run cannot be recomputed (the model has "
                            "moved on): start a fresh run"])
        return stored
