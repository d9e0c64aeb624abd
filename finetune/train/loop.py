"""The training loop: one explicit loop, readable top to bottom (`_train`).

setup (accelerator, tokenizer, data) -> load the 4-bit base for this process's placement -> adapters (LoRA,
optimizer, schedule) -> wrap for the strategy -> fill this rank's shards of the base -> restore a checkpoint's
state -> for each optimizer step: accumulate micro-batches under autocast, clip, step, log, evaluate,
checkpoint -> save the adapter.

Every collective call (a sharded forward, a reduce, a barrier) is made by every rank in the same order:
the steps below branch on the rank only around rank-0 work that is not collective.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.data import batching
from finetune.data.explain import data_notes
from finetune.data.prepare import check_method
from finetune.data.prepare import prepare as prepare_data
from finetune.plan.archs import vocab_size
from finetune.plan.attention import CPU_MATH_ATTENTION_MAX_LEN, cpu_math_kernel_possible
from finetune.recipe import Recipe
from finetune.recipe.fingerprint import fingerprint
from finetune.recipe.rundir import write_recipe
from finetune.train import guard
from finetune.train.gather import gather_full_adapter_state
from finetune.train.keepers import checkpoint, runlock
from finetune.train.keepers.metrics import Metrics
from finetune.train.keepers.trackers import Trackers, accelerator_kwargs
from finetune.train.lora import apply_lora, enable_checkpointing, load_adapter_into, trainable_report
from finetune.train.loss import loss_totals, setup_forward
from finetune.train.preference import eval_totals
from finetune.train.refpolicy import attach_reference
from finetune.train.keepers.memory import PhaseMemory, tracker_values, table as memory_table
from finetune.train.optim import build_optimizer, build_scheduler, schedule_note
from finetune.train.parallel import has_accelerator_device, host_group, make_accelerator, wrap
from finetune.train.step import global_sum, make_scaler, optimizer_step
from finetune.train.stop import StopSignal
from finetune.train.precision import resolve_cpu_precision
from finetune.weights.heap import release_cached_memory
from finetune.weights.load.model import load_with_plan
from finetune.weights.shard.fsdp import fill_shards
from finetune.weights.load.placement import placement_for
from finetune.artefacts.adapter import portable_peft_config
from finetune.artefacts.tokenizer import save_tokenizer
from finetune.weights.load.resolve import load_tokenizer
from finetune.util.errors import RecipeError
from finetune.util.log import log


@dataclass
class Run:
    """What the steps of one run share. step / epoch / cursor are the position a checkpoint records
    (cursor: micro-batches consumed in the current epoch); `batches` are this rank's for `epoch`."""
    recipe: Recipe
    run_dir: Path
    acc: object
    tok: object
    prepared: object
    model: object = None
    layout: str | None = None
    total_steps: int = 0
    optimizer: object = None
    scheduler: object = None
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    batches: list | None = None
    eval_batches: list | None = None
    metrics: Metrics | None = None
    scaler: object = None  # finetune.train.scaling.LossScaler
    resumed_from: Path | None = None
    resume_state: dict | None = None  # the checkpoint's manifest, between checkpoint_to_resume and restore
    memory: object = None  # finetune.train.keepers.memory.PhaseMemory
    offload: object = None  # the activation-offloading context of every training forward (None: off)
    host_group: object = None  # parallel.host_group: host-side agreement beside a GPU process group
    step_stats: dict | None = None  # a preference step's rewards, margin, accuracy (train.preference)

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def epoch_batches(self) -> list:
        return epoch_batches(self.prepared.train, self.epoch, self.recipe, self.acc.process_index,
                             self.acc.num_processes, self.tok.pad_token_id, self.layout)


def train(recipe: Recipe, run_dir: Path, return_model: bool = False) -> dict:
    """Run the recipe into run_dir; returns the final metrics (and the trained model, for tests and
    notebooks, when return_model)."""
    stop = StopSignal()
    try:
        with runlock.hold(run_dir):  # one run per output dir; a dead holder's lock is released by the kernel
            return _train(recipe, run_dir, stop, return_model)
    finally:
        stop.restore()


def _train(recipe: Recipe, run_dir: Path, stop: StopSignal, return_model: bool = False) -> dict:
    # Before anything reads the precision: the run dir's recipe.yaml, the fingerprint and eval see the resolved one.
    recipe, note = resolve_cpu_precision(recipe, on_cpu=not has_accelerator_device())
    if note:
        log.info(note)
    mem = PhaseMemory.for_this_process()  # peak memory per phase, into RUN_DIR/memory.json
    with mem.phase("load"):
        run = setup(recipe, run_dir)
        # The frozen base, placed for the strategy: whole, or (FSDP) placeholders each rank's shard replaces
        # below. The plan says what each parameter is and where the reader finds it; handed on, never stored.
        run.model, plan = load_with_plan(recipe.model, recipe.quantization, placement_for(run.acc))
        add_adapters(run, plan)
    run.memory = mem
    with mem.phase("wrap"):
        resume_from = checkpoint_to_resume(run)  # its adapter weights go in now, before sharding
        run.model, run.optimizer = wrap(run.acc, run.model, run.optimizer, plan)
        fill_shards(run.model, plan)  # FSDP: every rank streams its part of the base into its shards
        restore(run, resume_from)
        run.offload = setup_forward(run.model, recipe.model.activation_offloading)  # lean modules, offloading
        attach_reference(run)  # DPO: the starting policy's log-probs of every pair, once (train.refpolicy)
    release_cached_memory()  # the load's transients stay out of the pool the steps draw from
    if run.acc.is_main_process:
        write_recipe(run_dir, recipe)
        stats = run.prepared.stats
        log.info(f"model: {trainable_report(run.model)}; data: {stats['rows']} rows, "
                 f"{stats['trained_tokens']} trained tokens; {run.total_steps} steps")
        infos, warns = data_notes(recipe.data, stats)  # where eval rows come from; what the length policy dropped
        log.info("\n".join(infos)), [log.warning(w) for w in warns]
    return steps(run, stop, return_model)


def steps(run: Run, stop: StopSignal, return_model: bool) -> dict:
    """The optimizer steps from the run's position to the end (or a stop signal), then the adapter."""
    recipe, run_dir, mem = run.recipe, run.run_dir, run.memory
    run.eval_batches = held_out_batches(run)
    trackers = Trackers(run.acc, recipe, run_dir, run.prepared.stats, run.step, run.resumed_from is not None)
    run.metrics = Metrics(run_dir, run.total_steps, run.step, recipe.output.progress_bar, trackers)
    run.model.train()
    run.batches = run.epoch_batches()
    run.scaler = make_scaler(run)
    if run.resumed_from is not None:
        run.scaler.load_state_dict(checkpoint.load_scaler_state(run.resumed_from, run.acc.process_index))
    stop.armed = True  # until now a signal stopped at once (nothing to checkpoint); now it checkpoints first
    t, rate, last = recipe.train, TokenRate(), {}
    while run.step < run.total_steps:
        with mem.phase("steps"):
            out = optimizer_step(run, stop)
        if out is None:  # stopped between micro-batches: the step was abandoned
            with mem.phase("save"):
                stop_now(run, stop)
            run.metrics.close()
            mem.write(run_dir, run.acc, run.recipe)
            return {"step": run.step, "stopped": True, **last}
        loss, grad_norm, step_tokens = out
        rate.add(step_tokens)
        last = {"loss": loss, "lr": run.scheduler.get_last_lr()[0]}
        run.metrics.step(run.step, **last)
        if run.step % t.log_every == 0 or run.step == run.total_steps or run.step == 1:
            skipped = ({"skipped_steps": run.scaler.skipped, "loss_scale": run.scaler.scale_value()}
                       if run.scaler.enabled else {})
            run.metrics.log(run.step, epoch=run.epoch, loss=round(loss, 6), lr=last["lr"],
                            grad_norm=None if grad_norm is None else round(float(grad_norm), 6),
                            tokens_per_s=rate.per_second(), **skipped, **(run.step_stats or {}))
            rate.reset()
        guard.check_step(run, loss, grad_norm, lambda v: global_sum(run.acc, v))  # NaN/inf: stop, never save it
        if t.eval_every and run.step % t.eval_every == 0 and run.eval_batches:
            with mem.phase("eval"):
                run.metrics.log(run.step, **rounded(evaluate(run)))
        with mem.phase("save"):
            stopped = save_or_stop(run, stop)
        if stopped:
            run.metrics.close()
            mem.write(run_dir, run.acc, run.recipe)
            return {"step": run.step, "stopped": True, **last}
    return finish(run, last, return_model)


def finish(run: Run, last: dict, return_model: bool) -> dict:
    """After the last step: the final eval, the adapter in RUN_DIR/adapter, the final metrics."""
    mem, final = run.memory, {"step": run.step, **last}
    if run.scaler.enabled:
        final["skipped_steps"] = run.scaler.skipped
    if run.eval_batches:
        with mem.phase("eval"):
            final.update(evaluate(run))
        run.metrics.log(run.step, **rounded({k: v for k, v in final.items() if k.startswith("eval_")}))
    with mem.phase("export"):
        export_adapter(run)
    memory = mem.write(run.run_dir, run.acc, run.recipe)
    if memory is not None:
        log.info("memory per phase (largest rank; RUN_DIR/memory.json):\n" + memory_table(memory))
        if run.metrics.trackers is not None:  # the measured peaks beside the plan the config holds
            run.metrics.trackers.log(run.step, tracker_values(memory))
    run.metrics.close()
    run.acc.wait_for_everyone()
    if return_model:
        final["model"] = run.acc.unwrap_model(run.model)
    return final


def setup(recipe: Recipe, run_dir: Path) -> Run:
    """The Accelerator, the tokenizer and the data; no weights yet."""
    acc = make_accelerator(recipe.distributed, recipe.fsdp, recipe.train, recipe.model.dtype,
                           **accelerator_kwargs(recipe.output.report_to, run_dir))
    torch.manual_seed(recipe.train.seed)
    tok = load_tokenizer(recipe.model)
    with acc.local_main_process_first():  # builtin assets and data caches are built once per node
        prepared = prepare_data(recipe.data, tok, vocab_size(recipe.model.name))
    check_method(prepared, recipe.train.method)
    start = recipe.lora.init_adapter
    if start and not (Path(start) / "adapter_model.safetensors").exists():  # before any weights load
        raise RecipeError([f"lora.init_adapter: {start} holds no adapter_model.safetensors (an earlier run's "
                           "RUN_DIR/adapter; train that run first)"])
    return Run(recipe, run_dir, acc, tok, prepared, host_group=host_group(acc))


def add_adapters(run: Run, plan=None) -> None:
    """Fresh LoRA adapters on the loaded base (gradient checkpointing first), the packing layout its
    attention allows, the step count, the optimizer and the schedule; nothing is wrapped yet. `plan`: the
    load plan of a placeholder base (FSDP), which DoRA reads its magnitudes through."""
    recipe, acc, t = run.recipe, run.acc, run.recipe.train
    enable_checkpointing(run.model, recipe.model)
    run.model = apply_lora(run.model, recipe.lora, seed=t.seed, plan=plan)
    if recipe.lora.init_adapter:  # start from an earlier run's adapter (a resume's checkpoint replaces it later)
        load_adapter_into(run.model, Path(recipe.lora.init_adapter))
    attn = acc.unwrap_model(run.model).config._attn_implementation
    run.layout = batching.packing_layout(recipe.data.packing, attn)
    if attn == "sdpa" and cpu_math_kernel_possible(acc.device.type, t.mixed_precision):
        log.info(f"attention: batches of up to {CPU_MATH_ATTENTION_MAX_LEN} tokens use SDPA's math kernel (on "
                 "CPU in bf16 its backward is about twice as fast as the flash kernel's)")
    _, run.total_steps = plan_steps(recipe, run.prepared.train, acc.num_processes, run.layout)
    run.optimizer = build_optimizer(run.model, t, recipe.lora.loraplus_lr_ratio)
    run.scheduler = build_scheduler(run.optimizer, t, run.total_steps)  # stepped by us, once per step: never prepared


def checkpoint_to_resume(run: Run) -> Path | None:
    """The checkpoint `train.resume` names (None: a fresh run), verified and matched against this run's
    fingerprint; its adapter weights are loaded now, into the unwrapped model (every rank loads the full
    tensors, FSDP then shards them). Collective."""
    acc = run.acc
    if acc.is_main_process:
        checkpoint.clean_partial(run.ckpt_root)  # leftovers of an interrupted checkpoint write
        checkpoint.set_aside_damaged(run.ckpt_root)  # newer than the newest intact one: never resumed or pruned
    acc.wait_for_everyone()
    resume_from = checkpoint.resolve_resume(run.recipe.train.resume, run.ckpt_root)
    if resume_from is not None:
        run.resume_state = checkpoint.verify(resume_from)
        # A changed recipe (or process count, or data) is refused before anything is loaded into the model.
        for line in checkpoint.compare_fingerprint(run.resume_state, run_fingerprint(run), resume_from, run.run_dir):
            log.info(f"resume: {line}")
        load_adapter_into(run.model, resume_from / "adapter")
    return resume_from


def restore(run: Run, resume_from: Path | None) -> None:
    """The checkpoint's optimizer / scheduler / RNG state and data position, into the wrapped run."""
    if resume_from is None:
        return
    state = run.resume_state
    checkpoint.load_training_state(resume_from, run.acc.process_index, run.optimizer, run.scheduler)
    run.step, run.epoch, run.cursor = state["step"], state["data"]["epoch"], state["data"]["cursor"]
    run.resumed_from = resume_from
    log.info(f"resume: from {resume_from} (step {run.step})")
    if note := schedule_note(run.scheduler, run.step, run.total_steps):  # a longer run stretches the decay
        log.warning(f"resume: {note}")


def held_out_batches(run: Run) -> list:
    """This rank's share of the held-out rows, in micro-batches."""
    world = run.acc.num_processes
    # Every rank must run the same number of forwards (a sharded forward is collective): drop the remainder.
    held = run.prepared.eval[: len(run.prepared.eval) // world * world]
    return batching.batches(held[run.acc.process_index::world], run.recipe.train.micro_batch_size,
                            run.tok.pad_token_id, False, run.recipe.data.max_seq_len)


def evaluate(run: Run) -> dict:
    """{"eval_loss": mean held-out token loss} (all ranks take part: a sharded model needs every rank's
    forward); for preference runs the mean pair loss, and the reward accuracy and margin."""
    acc, t = run.acc, run.recipe.train
    run.model.eval()
    if t.method != "sft":
        totals = eval_totals(run.model, run.eval_batches, acc.device.type, t, run.recipe.eval.max_batches, acc.device)
        run.model.train()
        pairs = max(global_sum(acc, totals.get("pairs", 0.0)), 1.0)
        return {f"eval_{k}": round(global_sum(acc, totals.get(k, 0.0)) / pairs, 6) for k in ("loss", "accuracy", "margin")}
    total, count = loss_totals(run.model, run.eval_batches, acc.device.type, t,
                               run.recipe.eval.max_batches, device=acc.device)
    run.model.train()
    total, count = global_sum(acc, total), global_sum(acc, count)
    return {"eval_loss": total / max(count, 1)}


def rounded(values: dict) -> dict:
    return {k: round(v, 6) for k, v in values.items()}


def save_or_stop(run: Run, stop: StopSignal) -> bool:
    """Checkpoint when `train.save_every` (or the last step) says so; on a stop signal, checkpoint this
    step if that did not and say how to resume. True when the run stops here. Collective."""
    t = run.recipe.train
    saved = (t.save_every and run.step % t.save_every == 0) or run.step == run.total_steps
    if saved:
        save_checkpoint(run)
    # Checked after a scheduled save too: with save_every 1 every step saves, and a stop must still stop.
    if run.step < run.total_steps and stop.requested(run.acc, run.host_group):
        if not saved:
            save_checkpoint(run)
        log.info(f"stopped by signal {stop.signum}: wrote checkpoints/step-{run.step}; re-run the same command "
                 "to resume")
        return True
    return False


def stop_now(run: Run, stop: StopSignal) -> None:
    """Stopped inside a step: checkpoint the last finished step (unless it is on disk) and say how to resume."""
    # Rank 0 decides (a checkpoint is one directory); every rank must take part in the save or none.
    on_disk = run.acc.is_main_process and (run.ckpt_root / f"step-{run.step}").exists()
    if run.step > 0 and not global_sum(run.acc, float(on_disk)):
        save_checkpoint(run)
    where = f"checkpoints/step-{run.step}" if run.step else "no checkpoint (no step finished)"
    log.info(f"stopped by signal {stop.signum} during step {run.step + 1}, which was abandoned: {where}; "
             "re-run the same command to resume")


class TokenRate:
    """Trained tokens per second since the last logged step."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, tokens: float):
        self.tokens += tokens

    def per_second(self) -> float:
        return round(self.tokens / max(time.perf_counter() - self.since, 1e-9), 1)


def epoch_batches(examples, epoch: int, spec, rank: int, world: int, pad_id: int, layout: str | None):
    """This rank's micro-batches for an epoch. The order depends only on (shuffle_seed, epoch), so a
    resumed run sees the same data, and each global batch is split across ranks. `layout` is the packing
    layout the attention backend supports (data.packing_layout), None for dynamic padding."""
    order = batching.shuffled(examples, random.Random(spec.data.shuffle_seed * 1000 + epoch))
    if layout:
        order = batching.pack(order, spec.data.max_seq_len)
    # Collated lazily, one micro-batch when the loop reaches it (data.batching.EpochBatches).
    return batching.EpochBatches(order, spec.train.micro_batch_size, world, rank, pad_id, layout)


def plan_steps(recipe: Recipe, examples: list, world: int, layout: str | None) -> tuple[int, int]:
    """(micro-batches per epoch per rank, total optimizer steps)."""
    t = recipe.train
    rows = len(batching.pack(examples, recipe.data.max_seq_len)) if layout else len(examples)
    per_epoch = rows // (t.micro_batch_size * world)
    if per_epoch < t.gradient_accumulation_steps:
        raise RecipeError([f"data: {rows} rows make {per_epoch} micro-batches of {t.micro_batch_size} x "
                           f"{world} processes, fewer than one optimizer step "
                           f"({t.gradient_accumulation_steps} micro-batches)"])
    total = t.max_steps or math.ceil(t.epochs * per_epoch / t.gradient_accumulation_steps)
    return per_epoch, total


def save_checkpoint(run: Run):
    """checkpoints/step-N of the run's current position. Collective: every rank calls it."""
    acc, t = run.acc, run.recipe.train
    state = gather_full_adapter_state(acc, run.model)  # full shapes on rank 0, {} elsewhere
    cfg = acc.unwrap_model(run.model).peft_config["default"]
    checkpoint.save(run.ckpt_root, run.step, rank=acc.process_index, world=acc.num_processes,
                    barrier=acc.wait_for_everyone,
                    adapter=(portable_peft_config(cfg, run.recipe.model), state) if acc.is_main_process else None,
                    optimizer=run.optimizer, scheduler=run.scheduler,
                    data_state={"epoch": run.epoch, "cursor": run.cursor}, keep=t.keep_checkpoints,
                    fingerprint=run_fingerprint(run), scaler_state=run.scaler.state_dict() if run.scaler else None)


def run_fingerprint(run: Run) -> dict:
    """What this run's checkpoints were trained with (finetune.recipe.fingerprint)."""
    return fingerprint(run.recipe, run.acc.num_processes, run.prepared.stats)


def export_adapter(run: Run):
    """RUN_DIR/adapter: PEFT format, full shapes, with the tokenizer beside it. Collective."""
    acc = run.acc
    state = gather_full_adapter_state(acc, run.model)
    if acc.is_main_process:
        guard.assert_finite_adapter(state)
        cfg = acc.unwrap_model(run.model).peft_config["default"]

        def build(out: Path):
            checkpoint.write_adapter(out, portable_peft_config(cfg, run.recipe.model), state)
            save_tokenizer(run.tok, out)  # in the form transformers 4 and llama.cpp read too

        checkpoint.publish_dir(run.run_dir / "adapter", build)  # atomic: a crash never leaves half an adapter
