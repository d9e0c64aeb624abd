"""The training loop: one explicit loop, readable top to bottom (`_train`).

The phases of `_train`, in order, each returning what it makes (finetune.train.run holds the small types):

    setup(recipe, run_dir)                      -> Setup(acc, tok, prepared, host_group)
    Resume.open(train.resume, run_dir, acc, fp) -> Resume: the checkpoint, verified and fingerprint-checked
                                                   (keepers.resume; `path` None for a fresh run)
    load_with_plan(model, quantization, placement) -> (model: the 4-bit base, plan: its load plan)
    add_adapters(recipe, setup, model, plan)    -> Adapters(model, layout, total_steps)
    resume.adapter_into(model)                  -> the checkpoint's adapter, before the wrap shards it
    build_optim(recipe, setup, adapters)        -> Optim(optimizer, scheduler, scaler)
    wrap(acc, model, optimizer, plan)           -> (model, optimizer) for the strategy
    fill_shards(model, plan)                    -> this rank's shards of the base, filled
    resume.restore(acc, optim, total_steps, key) -> Restored(step, epoch, cursor, tracker_ids, reference):
                                                   optimizer, schedule, RNG, scaler loaded in place
    compile_layers(model, train.compile)        -> the compiled decoder layers (None: off; train.compiled)
    setup_forward(model, offloading, tiled_mlp, compiled) -> the offloading context (None: off); lean, tiled MLPs in
    attach_reference(recipe, run_dir, setup, model, restored.reference) -> DPO's `ref` on every pair
    announce(recipe, run_dir, setup, model, total_steps) -> rank 0: RUN_DIR/recipe.yaml, what trains on what
    prepare_steps(recipe, run_dir, setup, total_steps, restored) -> (held-out batches, Metrics with trackers)
    Run(...)                                    -> what the steps share (finetune.train.run.Run)
    steps(run, stop, return_model)              -> the final metrics (and the model): the optimizer steps,
                                                   evaluation, checkpoints, then the adapter (finish)

memory.json names its phases after these (keepers.memory.PHASES): load (setup, the resume opened, the base),
adapters (with the optimizer), wrap, fill, restore, forward, reference (DPO), steps, eval, save, export.

Every collective call (a sharded forward, a reduce, a barrier) is made by every rank in the same order:
the steps below branch on the rank only around rank-0 work that is not collective.
"""
from __future__ import annotations

import time
from dataclasses import replace
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
from finetune.train import balance, guard
from finetune.train.gather import gather_full_adapter_state
from finetune.train.keepers import checkpoint, runlock
from finetune.train.keepers.memory import PhaseMemory
from finetune.train.keepers.memory import table as memory_table
from finetune.train.keepers.memory import tracker_values
from finetune.train.keepers.metrics import Metrics
from finetune.train.keepers.resume import Restored, Resume
from finetune.train.keepers.trackers import Trackers, accelerator_kwargs
from finetune.train.compiled import compile_layers
from finetune.train.lora import apply_lora, enable_checkpointing, load_adapter_into, trainable_report
from finetune.train.sdpa import attention_setup
from finetune.train.kernels import apply_kernels
from finetune.train.loss import loss_totals, setup_forward, unwrapped
from finetune.train.optim import build_optimizer, build_scheduler
from finetune.train.parallel import has_accelerator_device, host_group, make_accelerator, wrap
from finetune.train.preference import eval_totals
from finetune.train.refpolicy import FILE as REFERENCE_FILE
from finetune.train.recompute import resolve as resolve_checkpointing
from finetune.train.refpolicy import attach_reference, dpo_key
from finetune.train.run import Adapters, Optim, Run, Setup, held_out_batches, plan_steps
from finetune.train.step import global_sum, make_scaler, optimizer_step
from finetune.train.stop import StopSignal
from finetune.train.precision import resolve_cpu_precision
from finetune.artefacts.adapter import portable_peft_config
from finetune.artefacts.tokenizer import save_tokenizer
from finetune.weights.heap import release_cached_memory
from finetune.weights.load.model import load_with_plan
from finetune.weights.load.placement import placement_for
from finetune.weights.load.resolve import load_tokenizer
from finetune.weights.shard.fsdp import fill_shards
from finetune.util.errors import RecipeError
from finetune.util.log import log


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
        s = setup(recipe, run_dir)
        # A changed recipe (or process count, or data) is refused here, before any weights load.
        resume = Resume.open(recipe.train.resume, run_dir, s.acc, run_fingerprint(recipe, s))
        # The frozen base, placed for the strategy: whole, or (FSDP) placeholders each rank's shard replaces
        # in the fill. The plan says what each parameter is and where the reader finds it; handed on, never stored.
        model, plan = load_with_plan(recipe.model, recipe.quantization, placement_for(s.acc))
    with mem.phase("adapters"):
        a = add_adapters(recipe, s, model, plan, start_rss=mem.start_rss)
        mem.checkpointed = a.checkpointed  # memory.json's plan is of the layers that run checkpointed
        resume.adapter_into(a.model)  # now, into the unwrapped model: the wrap shards what it finds
        optim = build_optim(recipe, s, a)
    with mem.phase("wrap"):
        model, optimizer = wrap(s.acc, a.model, optim.optimizer, plan)
        optim = replace(optim, optimizer=optimizer)
    with mem.phase("fill"):
        fill_shards(model, plan)  # FSDP: every rank streams its part of the base into its shards
    with mem.phase("restore"):  # everything else a resume restores, in one call (keepers.resume)
        restored = resume.restore(s.acc, optim, a.total_steps, dpo_key(recipe, s.prepared.stats))
    with mem.phase("forward"):
        apply_kernels(unwrapped(model), recipe.train.kernels)  # first: lean.apply leaves the patched modules be
        compiled = compile_layers(s.acc.unwrap_model(model), recipe.train.compile)  # None: train.compile off
        # lean modules, tiled MLPs, offloading
        offload = setup_forward(model, recipe.model.activation_offloading, recipe.model.tiled_mlp, compiled)
        # which attention runs, and on CUDA SDPA only its memory-linear kernels; recorded in memory.json
        mem.attention = attention_setup(unwrapped(model), s.acc.device, recipe.train.mixed_precision)
    if recipe.train.method == "dpo":
        with mem.phase("reference"):  # the starting policy's log-probs of every pair, once (train.refpolicy)
            attach_reference(recipe, run_dir, s, model, restored.reference)
    release_cached_memory()  # the load's transients stay out of the pool the steps draw from
    announce(recipe, run_dir, s, model, a.total_steps)
    eval_batches, metrics = prepare_steps(recipe, run_dir, s, a.total_steps, restored)
    run = Run(recipe, run_dir, s.acc, s.tok, s.prepared, s.host_group, model=model, layout=a.layout,
              total_steps=a.total_steps, optimizer=optim.optimizer, scheduler=optim.scheduler,
              scaler=optim.scaler, offload=offload, memory=mem, metrics=metrics, eval_batches=eval_batches,
              step=restored.step, epoch=restored.epoch, cursor=restored.cursor, compiled=compiled)
    if run.aux_coef:  # the weight Run worked out (finetune.train.balance)
        log.info(balance.words(recipe.train, run.aux_coef))
    return steps(run, stop, return_model)


def setup(recipe: Recipe, run_dir: Path) -> Setup:
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
    return Setup(acc, tok, prepared, host_group(acc))


def add_adapters(recipe: Recipe, s: Setup, model: torch.nn.Module, plan=None, start_rss: int | None = None
                 ) -> Adapters:
    """Fresh LoRA adapters on the loaded base (gradient checkpointing first), the packing layout its
    attention allows and the step count; nothing is wrapped yet. `plan`: the load plan of a placeholder
    base (FSDP), which DoRA reads its magnitudes through. `start_rss`: this process's RSS when the run
    began (keepers.memory), which a CPU run's `auto` plans with."""
    t = recipe.train
    checkpointed = resolve_checkpointing(recipe, s.acc, start_rss)  # auto: the planner's fewest layers that fit
    enable_checkpointing(model, recipe.model, checkpointed)
    model = apply_lora(model, recipe.lora, seed=t.seed, plan=plan)
    if recipe.lora.init_adapter:  # start from an earlier run's adapter (a resume's checkpoint replaces it next)
        load_adapter_into(model, Path(recipe.lora.init_adapter))
    attn = s.acc.unwrap_model(model).config._attn_implementation
    layout = batching.packing_layout(recipe.data.packing, attn)
    if attn == "sdpa" and cpu_math_kernel_possible(s.acc.device.type, t.mixed_precision):
        log.info(f"attention: batches of up to {CPU_MATH_ATTENTION_MAX_LEN} tokens use SDPA's math kernel (on "
                 "CPU in bf16 its backward is about twice as fast as the flash kernel's)")
    _, total_steps = plan_steps(recipe, s.prepared.train, s.acc.num_processes, layout)
    return Adapters(model, layout, total_steps, checkpointed)


def build_optim(recipe: Recipe, s: Setup, a: Adapters) -> Optim:
    """The optimizer over the adapters, the schedule over the run's steps and the fp16 loss scaler; the
    wrap hands the optimizer the sharded parameters."""
    optimizer = build_optimizer(a.model, recipe.train, recipe.lora.loraplus_lr_ratio)
    scheduler = build_scheduler(optimizer, recipe.train, a.total_steps)  # stepped by us, once per step: never prepared
    return Optim(optimizer, scheduler, make_scaler(recipe.train, s.acc))


def announce(recipe: Recipe, run_dir: Path, s: Setup, model: torch.nn.Module, total_steps: int) -> None:
    """Rank 0: the resolved recipe into RUN_DIR/recipe.yaml, and what is trained on what, in a few lines."""
    if not s.acc.is_main_process:
        return
    write_recipe(run_dir, recipe)
    stats = s.prepared.stats
    log.info(f"model: {trainable_report(model)}; data: {stats['rows']} rows, "
             f"{stats['trained_tokens']} trained tokens; {total_steps} steps")
    infos, warns = data_notes(recipe.data, stats)  # where eval rows come from; what the length policy dropped
    log.info("\n".join(infos)), [log.warning(w) for w in warns]


def prepare_steps(recipe: Recipe, run_dir: Path, s: Setup, total_steps: int, restored: Restored
                  ) -> tuple[list[dict], Metrics]:
    """What the steps report through: this rank's held-out micro-batches, and the metrics sink with the
    experiment trackers (continuing a resumed run's tracker runs, `restored.tracker_ids`)."""
    trackers = Trackers(s.acc, recipe, run_dir, s.prepared.stats, restored.step, restored.tracker_ids)
    metrics = Metrics(run_dir, total_steps, restored.step, recipe.output.progress_bar, trackers)
    return held_out_batches(recipe, s), metrics


def steps(run: Run, stop: StopSignal, return_model: bool) -> dict:
    """The optimizer steps from the run's position to the end (or a stop signal), then the adapter."""
    recipe, run_dir, mem = run.recipe, run.run_dir, run.memory
    run.model.train()
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
        if run.compiled is not None:
            run.compiled.step_done(run.step)  # step 1 made the graphs: said once, then counted
        rate.add(step_tokens)
        aux = {} if run.step_aux is None else {"aux_loss": round(run.step_aux, 6)}  # MoE balance, beside the loss
        last = {"loss": loss, **aux, "lr": run.scheduler.get_last_lr()[0]}
        run.metrics.step(run.step, **last)
        if run.step % t.log_every == 0 or run.step == run.total_steps or run.step == 1:
            skipped = ({"skipped_steps": run.scaler.skipped, "loss_scale": run.scaler.scale_value()}
                       if run.scaler.enabled else {})
            run.metrics.log(run.step, epoch=run.epoch, loss=round(loss, 6), **aux, lr=last["lr"],
                            grad_norm=None if grad_norm is None else round(float(grad_norm), 6),
                            tokens_per_s=rate.per_second(), **rate.host_and_wall(run), **skipped,
                            **(run.step_stats or {}),
                            **({"recompiles": run.compiled.recompiles()} if run.compiled is not None else {}))
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
    if run.compiled is not None:
        final["recompiles"] = run.compiled.recompiles()  # graphs made after step 1 (finetune.train.compiled)
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
        stop.launcher_died()  # said here if `requested` asked too early (see StopSignal.launcher_died)
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
    stop.launcher_died()
    log.info(f"stopped by signal {stop.signum} during step {run.step + 1}, which was abandoned: {where}; "
             "re-run the same command to resume")


class TokenRate:
    """Trained tokens per second since the last logged step."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.steps, self.since = 0, 0, time.perf_counter()

    def add(self, tokens: float):
        self.tokens += tokens
        self.steps += 1

    def host_and_wall(self, run) -> dict:
        """Host CPU time and wall time per step since the last log (the run's host time restarts)."""
        steps, host = max(self.steps, 1), run.host_s
        run.host_s = 0.0
        return {"host_s_per_step": round(host / steps, 4),
                "s_per_step": round((time.perf_counter() - self.since) / steps, 4)}

    def per_second(self) -> float:
        return round(self.tokens / max(time.perf_counter() - self.since, 1e-9), 1)


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
                    fingerprint=fingerprint(run.recipe, run.acc.num_processes, run.prepared.stats),
                    scaler_state=run.scaler.state_dict(),
                    beside=(str(REFERENCE_FILE),) if dpo_key(run.recipe, run.prepared.stats) else ())


def run_fingerprint(recipe: Recipe, s: Setup) -> dict:
    """What this run's checkpoints were trained with (finetune.recipe.fingerprint)."""
    return fingerprint(recipe, s.acc.num_processes, s.prepared.stats)


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
