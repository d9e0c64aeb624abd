"""The training loop: one explicit loop, readable top to bottom.

setup (accelerator, tokenizer, 4-bit base, LoRA, data, optimizer) -> resume -> for each optimizer step:
accumulate micro-batches under autocast, clip, step, log, evaluate, checkpoint -> save the adapter.
"""
from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from finetune.train import checkpoint
from finetune.data import batching
from finetune.data.encode import IGNORE
from finetune.data.prepare import prepare as prepare_data
from finetune.plan.attention import CPU_MATH_ATTENTION_MAX_LEN, attention_kernels, cpu_math_kernel_possible
from finetune.train.distributed import autocast, gather_full_adapter_state, make_accelerator, prepare
from finetune.util.log import print0
from finetune.train.lora import apply_lora, trainable_report
from finetune.train.metrics import Metrics
from finetune.train.model import enable_checkpointing, load_model, load_tokenizer
from finetune.train.optim import build_optimizer, build_scheduler
from finetune.recipe import Recipe
from finetune.util.errors import RecipeError
from finetune.recipe.rundir import write_recipe


def token_loss_sum(model, batch: dict, device_type: str, train_spec) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over trained tokens, and their count.

    Summing (not averaging) per micro-batch lets the caller divide by the tokens of the whole optimizer
    step across all ranks, so micro-batch x accumulation x processes never changes the result.

    The output head runs only on the positions whose next token is trained (see `trained_rows_only`):
    prompt and padding positions never get logits, so neither their head matmul nor their fp32 upcast for
    the loss is paid. Callers run it, and its backward, inside `batch_kernels`."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE  # position t predicts token t + 1
    with trained_rows_only(model, keep), autocast(train_spec, device_type):
        logits = model(**inputs, use_cache=False).logits  # [trained tokens, vocab]
    targets = labels[:, 1:][keep[:, :-1]]
    if logits.dim() != 2 or logits.size(0) != targets.numel():
        raise RuntimeError(f"{type(extract_model_from_parallel(model)).__name__} computed its logits without "
                           "calling its output-embeddings module; finetune's loss needs that module")
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")  # fp32 loss under bf16 autocast
    return loss, targets.numel()


def batch_kernels(batch: dict, device_type: str, train_spec):
    """The SDPA kernels for this batch (finetune.attention), to hold over its forward AND its backward:
    gradient checkpointing recomputes attention during backward, and the recomputation must save the same
    tensors as the forward did, so it must run the same kernel."""
    return attention_kernels(device_type, train_spec.mixed_precision, batch["input_ids"].size(1))


@contextlib.contextmanager
def trained_rows_only(model, keep: torch.Tensor):
    """While active, the model's output head sees only the hidden states at `keep` ([B, T] bool):
    [B, T, hidden] becomes [N, hidden] and the model returns logits [N, vocab].

    Why: in instruction data most positions are prompt or padding, and the logits are the largest
    activation of a large-vocabulary model (Llama 3: 128k x 4 bytes per position in fp32). A forward
    pre-hook on the head keeps this inside the model's own forward, so FSDP's hooks (which gather the
    head's weights) run exactly as they do without it."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][keep], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def epoch_batches(examples, epoch: int, spec, rank: int, world: int, pad_id: int, layout: str | None):
    """This rank's micro-batches for an epoch. The order depends only on (shuffle_seed, epoch), so a
    resumed run sees the same data, and each global batch is split across ranks. `layout` is the packing
    layout the attention backend supports (data.packing_layout), None for dynamic padding."""
    order = list(examples)
    random.Random(spec.data.shuffle_seed * 1000 + epoch).shuffle(order)
    mb = spec.train.micro_batch_size
    if layout:
        order = batching.pack(order, spec.data.max_seq_len)
    global_batches = [order[i: i + mb * world] for i in range(0, len(order) - mb * world + 1, mb * world)]
    if layout:
        return [batching.collate_packed(g[rank * mb:(rank + 1) * mb], pad_id, flat=layout == "flat")
                for g in global_batches]
    return [batching.collate(g[rank * mb:(rank + 1) * mb], pad_id) for g in global_batches]


def global_sum(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum").item())


@torch.no_grad()
def evaluate(model, batches, accelerator, train_spec, max_batches=None) -> float:
    """Mean held-out token loss (all ranks take part: a sharded model needs every rank's forward)."""
    model.eval()
    total = count = 0.0
    for i, b in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        b = {k: v.to(accelerator.device) for k, v in b.items()}
        with batch_kernels(b, accelerator.device.type, train_spec):
            loss, n = token_loss_sum(model, b, accelerator.device.type, train_spec)
        total += float(loss)
        count += n
    model.train()
    total, count = global_sum(accelerator, total), global_sum(accelerator, count)
    return total / max(count, 1)


def setup(recipe: Recipe):
    acc = make_accelerator(recipe.distributed, recipe.fsdp, recipe.train, recipe.model.dtype)
    torch.manual_seed(recipe.train.seed)
    tok = load_tokenizer(recipe.model)
    with acc.local_main_process_first():  # builtin assets and data caches are built once per node
        prepared = prepare_data(recipe.data, tok)
    model = load_model(recipe.model, recipe.quantization, notice=print0)
    enable_checkpointing(model, recipe.model)
    model = apply_lora(model, recipe.lora, seed=recipe.train.seed)
    return acc, tok, model, prepared


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


class StopSignal:
    """SIGTERM (preemption) or SIGINT: finish the current step, write a checkpoint, exit 0.
    Every rank gets the signal from the launcher; the flag is also OR-ed across ranks so they agree."""

    def __init__(self):
        self.signum = None
        self.previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker): no handler, no preemption save
                pass

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self, acc) -> bool:
        return global_sum(acc, 1.0 if self.signum is not None else 0.0) > 0

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(recipe: Recipe, run_dir: Path, return_model: bool = False) -> dict:
    """Run the recipe into run_dir; returns the final metrics (and the trained model, for tests and
    notebooks, when return_model)."""
    stop = StopSignal()
    try:
        result = _train(recipe, run_dir, stop, return_model)
        return result
    finally:
        stop.restore()


def _train(recipe: Recipe, run_dir: Path, stop: StopSignal, return_model: bool = False) -> dict:
    acc, tok, model, prepared = setup(recipe)
    rank, world, dev = acc.process_index, acc.num_processes, acc.device
    attn = acc.unwrap_model(model).config._attn_implementation
    layout = batching.packing_layout(recipe.data.packing, attn)
    if attn == "sdpa" and cpu_math_kernel_possible(dev.type, recipe.train.mixed_precision):
        print0(f"attention: batches of up to {CPU_MATH_ATTENTION_MAX_LEN} tokens use SDPA's math kernel (on CPU "
               "in bf16 its backward is about twice as fast as the flash kernel's)")
    per_epoch, total_steps = plan_steps(recipe, prepared.train, world, layout)
    t = recipe.train
    optimizer = build_optimizer(model, t)
    scheduler = build_scheduler(optimizer, t, total_steps)  # stepped by us, once per step: never prepared
    ckpt_root = run_dir / "checkpoints"
    step, epoch, cursor = 0, 0, 0  # cursor: micro-batches consumed in the current epoch
    if acc.is_main_process:
        checkpoint.clean_partial(ckpt_root)  # leftovers of an interrupted checkpoint write
    acc.wait_for_everyone()
    resume_from = resolve_resume(t.resume, ckpt_root)
    if resume_from is not None:
        state = checkpoint.verify(resume_from, world)
        # Adapter weights go in before sharding: every rank loads the full tensors, FSDP then shards them.
        load_adapter_into(model, resume_from / "adapter")
    model, optimizer = prepare(acc, model, optimizer)
    if resume_from is not None:
        checkpoint.load_training_state(resume_from, rank, optimizer, scheduler)
        step, epoch, cursor = state["step"], state["data"]["epoch"], state["data"]["cursor"]
        print0(f"resume: from {resume_from} (step {step})")
    if acc.is_main_process:
        write_recipe(run_dir, recipe)
        print0(f"model: {trainable_report(model)}; data: {prepared.stats['rows']} rows, "
               f"{prepared.stats['trained_tokens']} trained tokens; {total_steps} steps")
    # Every rank must run the same number of forwards (a sharded forward is collective): drop the remainder.
    held = prepared.eval[: len(prepared.eval) // world * world]
    eval_batches = batching.batches(held[rank::world], t.micro_batch_size, tok.pad_token_id, False,
                                    recipe.data.max_seq_len)
    metrics = Metrics(run_dir, total_steps, step, recipe.output.progress_bar)
    model.train()
    batches = epoch_batches(prepared.train, epoch, recipe, rank, world, tok.pad_token_id, layout)
    tokens_seen, t_log = 0, time.perf_counter()
    last = {}
    while step < total_steps:
        # Gather this step's micro-batches first: the loss is normalised by the trained tokens of the
        # whole step on every rank, which must be known before the first backward.
        micro = []
        while len(micro) < t.gradient_accumulation_steps:
            if cursor >= len(batches):
                epoch, cursor = epoch + 1, 0
                batches = epoch_batches(prepared.train, epoch, recipe, rank, world, tok.pad_token_id, layout)
            micro.append({k: v.to(dev) for k, v in batches[cursor].items()})
            cursor += 1
        local_tokens = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro)
        step_tokens = global_sum(acc, local_tokens)
        loss_total = 0.0
        for b in micro:
            with batch_kernels(b, dev.type, t):
                loss_sum, _ = token_loss_sum(model, b, dev.type, t)
                # Gradients are averaged over ranks by DDP/FSDP, hence the factor `world`.
                acc.backward(loss_sum * world / step_tokens)
            loss_total += loss_sum.item()
        grad_norm = acc.clip_grad_norm_(model.parameters(), t.max_grad_norm) if t.max_grad_norm else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += step_tokens
        loss = global_sum(acc, loss_total) / step_tokens
        last = {"loss": loss, "lr": scheduler.get_last_lr()[0]}
        metrics.step(step, **last)
        if step % t.log_every == 0 or step == total_steps or step == 1:
            elapsed = time.perf_counter() - t_log
            metrics.log(step, epoch=epoch, loss=round(loss, 6), lr=last["lr"],
                        grad_norm=None if grad_norm is None else round(float(grad_norm), 6),
                        tokens_per_s=round(tokens_seen / max(elapsed, 1e-9), 1))
            tokens_seen, t_log = 0, time.perf_counter()
        if t.eval_every and step % t.eval_every == 0 and eval_batches:
            metrics.log(step, eval_loss=round(evaluate(model, eval_batches, acc, t, recipe.eval.max_batches), 6))
        saved = (t.save_every and step % t.save_every == 0) or step == total_steps
        if saved:
            save_checkpoint(acc, model, optimizer, scheduler, ckpt_root, step, epoch, cursor, t.keep_checkpoints)
        # Checked after a scheduled save too: with save_every 1 every step saves, and a stop must still stop.
        if step < total_steps and stop.requested(acc):
            if not saved:
                save_checkpoint(acc, model, optimizer, scheduler, ckpt_root, step, epoch, cursor, t.keep_checkpoints)
            print0(f"stopped by signal {stop.signum}: wrote checkpoints/step-{step}; re-run the same command to "
                   "resume")
            metrics.close()
            return {"step": step, "stopped": True, **last}
    final = {"step": step, **last}
    if eval_batches:
        final["eval_loss"] = evaluate(model, eval_batches, acc, t, recipe.eval.max_batches)
        metrics.log(step, eval_loss=round(final["eval_loss"], 6))
    export_adapter(acc, model, tok, run_dir)
    metrics.close()
    acc.wait_for_everyone()
    if return_model:
        final["model"] = acc.unwrap_model(model)
    return final


def resolve_resume(resume, ckpt_root: Path) -> Path | None:
    if resume is False:
        if checkpoint.latest(ckpt_root):
            raise RecipeError([f"train.resume: false, but {ckpt_root} holds checkpoints; use another "
                               "output.dir or resume: auto"])
        return None
    if resume in ("auto", True):
        return checkpoint.latest(ckpt_root)
    p = Path(resume)
    if not (p / checkpoint.MANIFEST).exists():
        raise RecipeError([f"train.resume: {resume} is not a complete checkpoint directory"])
    return p


def adapter_state(acc, model) -> dict:
    """Full-shape adapter weights on rank 0, {} elsewhere (gathered from the shards under FSDP).
    Collective: every rank calls it."""
    return gather_full_adapter_state(acc, model)


def load_adapter_into(model, adapter_dir: Path):
    """Checkpointed adapter weights into the (not yet sharded) PeftModel; every key must match."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint adapter does not match the model: missing {missing[:3]}, "
                           f"unexpected {list(result.unexpected_keys)[:3]}")


def save_checkpoint(acc, model, optimizer, scheduler, root, step, epoch, cursor, keep):
    state = adapter_state(acc, model)
    cfg = acc.unwrap_model(model).peft_config["default"]
    checkpoint.save(root, step, rank=acc.process_index, world=acc.num_processes, barrier=acc.wait_for_everyone,
                    adapter=(cfg, state) if acc.is_main_process else None, optimizer=optimizer,
                    scheduler=scheduler, data_state={"epoch": epoch, "cursor": cursor}, keep=keep)


def export_adapter(acc, model, tok, run_dir: Path):
    """RUN_DIR/adapter: PEFT format, full shapes, with the tokenizer beside it."""
    state = adapter_state(acc, model)
    if acc.is_main_process:
        cfg = acc.unwrap_model(model).peft_config["default"]

        def build(out: Path):
            checkpoint.write_adapter(out, cfg, state)
            tok.save_pretrained(str(out))

        checkpoint.publish_dir(run_dir / "adapter", build)  # atomic: a crash never leaves half an adapter
